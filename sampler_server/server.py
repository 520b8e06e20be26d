"""The sampler server process: one ROUTER socket, an IO loop, and sampling threads.

Threads and sockets::

    trainers / peers --> ROUTER (IO thread) --SAMPLE jobs--> bounded queue --> sampler threads
                               ^                                                 |
                               +------ PULL (inproc) <------ PUSH (per thread) --+

The IO thread answers cheap, local-only requests inline (PING, NEIGHBORS_REQ, NODE_DATA_REQ,
SEEDS_REQ, STATS_REQ, SHUTDOWN) so that a peer's request is never stuck behind a full-MFG job
that itself waits on that peer: two servers sampling across each other cannot deadlock.
SAMPLE requests go to the sampler threads through a bounded queue; when it is full the client
gets a ``busy`` error reply (its credits should prevent that). Every malformed message gets an
``ERROR`` reply and the server keeps serving.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from common import codec
from common.cluster import ClusterSpec
from common.config import ServerConfig
from common.errors import MfgServeError, PeerTimeoutError, ProtocolError, RemoteError
from common.messages import (
    FEAT_TRANSFER_DTYPES,
    Ack,
    CacheFillReply,
    CacheFillRequest,
    ErrorReply,
    Message,
    MFGReply,
    NeighborsReply,
    NeighborsRequest,
    NodeDataReply,
    NodeDataRequest,
    Ping,
    Pong,
    SampleRequest,
    SeedsReply,
    SeedsRequest,
    Shutdown,
    StatsReply,
    StatsRequest,
)
from common.shm_ring import ShmError, ShmWriter, SlotRef
from common.sockets import CurveKeys, bound_endpoint, make_socket
from partition.layout import HOT_RANK_FILE, cached_mask, load_hot_rank
from sampler_server.neighbor_sampler import DistributedNeighbors, Timings, sample_mfg
from sampler_server.partition_store import PartitionStore
from sampler_server.peer_client import WirePeers

log = logging.getLogger("mfgserve.server")


class SamplerServer:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.max_bytes = cfg.max_message_mb << 20
        self.store = PartitionStore(cfg.parts, cfg.part_id, seed=cfg.seed)
        self.hot_rank = load_hot_rank(cfg.parts)
        self.cluster = ClusterSpec.load(cfg.cluster) if cfg.cluster else None
        if self.cluster and self.cluster.num_parts != self.store.meta.num_parts:
            raise MfgServeError(
                f"cluster file {cfg.cluster} lists {self.cluster.num_parts} parts but the "
                f"partition set {cfg.parts} has {self.store.meta.num_parts}; fix the cluster file")
        self.server_id = uuid.uuid4().hex[:8]
        self.ctx = zmq.Context()
        self.authenticator = None
        server_keys = self.peer_keys = None
        if cfg.curve_secret_key:
            server_keys = CurveKeys.load(cfg.curve_secret_key)
            if not Path(cfg.curve_authorized_keys).is_dir():
                raise MfgServeError(f"--curve-authorized-keys {cfg.curve_authorized_keys} is not "
                                    "a directory of client public keys")
            from zmq.auth.thread import ThreadAuthenticator

            self.authenticator = ThreadAuthenticator(self.ctx)
            self.authenticator.start()
            self.authenticator.configure_curve(domain="*",
                                               location=cfg.curve_authorized_keys)
            if self.cluster is not None:
                if not self.cluster.curve_server_key:
                    raise MfgServeError(f"cluster file {cfg.cluster} has no curve_server_key, "
                                        "but this server uses CurveZMQ; add it")
                # Towards its peers a server is a client with its own keypair.
                self.peer_keys = CurveKeys(server_keys.public, server_keys.secret,
                                           CurveKeys.load(cfg.curve_secret_key,
                                                          self.cluster.curve_server_key
                                                          ).server_public)
        self.frontend = make_socket(self.ctx, zmq.ROUTER, cfg.bind, bind=True, hwm=10000,
                                    max_message_bytes=self.max_bytes, curve=server_keys,
                                    heartbeat_s=cfg.heartbeat_s,
                                    heartbeat_timeout_s=cfg.heartbeat_timeout_s)
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.endpoint = bound_endpoint(self.frontend)
        self.results_ep = f"inproc://results-{self.server_id}"
        self.results = make_socket(self.ctx, zmq.PULL, self.results_ep, bind=True, hwm=0)
        self.jobs: queue.Queue = queue.Queue(maxsize=cfg.max_queue)
        self.stop_event = threading.Event()
        self.fatal: str | None = None  # set when the server must stop because it broke
        self.stats: dict[str, float] = {
            "requests": 0, "sample_requests": 0, "errors": 0, "busy": 0, "bytes_out": 0,
            "sample_s": 0.0, "gather_s": 0.0, "remote_s": 0.0, "encode_s": 0.0,
            "remote_requests": 0, "remote_bytes": 0, "seeds_served": 0,
        }
        self.stats_lock = threading.Lock()
        self.workers = [threading.Thread(target=self._worker, args=(i,), daemon=True,
                                         name=f"sampler-{i}") for i in range(cfg.num_workers)]

    # ------------------------------------------------------------------ IO thread
    def serve_forever(self) -> None:
        for w in self.workers:
            w.start()
        if self.cfg.ready_file:
            tmp = self.cfg.ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(self.endpoint)
            os.replace(tmp, self.cfg.ready_file)
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                events = dict(poller.poll(200))
                if self.results in events:
                    self._drain_results()
                if self.frontend in events:
                    for _ in range(64):  # bounded burst, then look at results again
                        try:
                            frames = self.frontend.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(frames)
        finally:
            self.close()

    def _drain_results(self) -> None:
        while True:
            try:
                frames = self.results.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.frontend.send_multipart(frames, copy=False)

    def _reply(self, ident: Any, msg: Message, rid: int) -> None:
        frames = codec.encode(msg, rid)
        self.stats["bytes_out"] += sum(memoryview(f).nbytes for f in frames)
        self.frontend.send_multipart([ident, *frames], copy=False)

    def _error(self, ident: Any, rid: int, code: str, message: str) -> None:
        with self.stats_lock:
            self.stats["errors"] += 1
        log.warning("part %d: error reply [%s]: %s", self.cfg.part_id, code, message)
        self._reply(ident, ErrorReply(code=code, message=message), rid)

    def _handle(self, frames: list) -> None:
        self.stats["requests"] += 1
        if len(frames) < 2:
            return  # no envelope to answer: nothing to do
        ident, body = frames[0], frames[1:]
        rid = codec.peek_request_id(body[0])
        try:
            msg, rid = codec.decode(body, self.max_bytes)
            self._dispatch(ident, msg, rid)
        except ProtocolError as e:
            self._error(ident, rid, e.code, str(e))
        except (ValueError, RuntimeError, MfgServeError) as e:
            self._error(ident, rid, "bad_request", str(e))
        except Exception as e:  # a bug must not take the server down for everyone else
            log.exception("part %d: internal error", self.cfg.part_id)
            self._error(ident, rid, "internal", f"{type(e).__name__}: {e}")

    def _dispatch(self, ident: Any, msg: Message, rid: int) -> None:
        store = self.store
        if isinstance(msg, SampleRequest):
            n, top = store.meta.num_nodes, int(msg.seeds.max())  # check() ensured non-empty
            if top >= n:
                raise ProtocolError("id_out_of_range",
                                    f"seed id {top} is outside [0, {n}): dataset "
                                    f"{store.meta.dataset} has {n} nodes")
            try:
                self.jobs.put_nowait((ident, msg, rid, time.perf_counter()))
            except queue.Full:
                self.stats["busy"] += 1
                self._error(ident, rid, "busy",
                            f"part {self.cfg.part_id} has {self.cfg.max_queue} sample requests "
                            "queued; lower the trainers' --max-inflight or raise --max-queue")
        elif isinstance(msg, NeighborsRequest):
            counts, src = store.sample_neighbors(msg.nodes, msg.fanout)
            self._reply(ident, NeighborsReply(counts=counts, src=src), rid)
        elif isinstance(msg, NodeDataRequest):
            feat, label = store.gather(msg.nodes, msg.with_feat, msg.with_label)
            self._reply(ident, NodeDataReply(feat=feat, label=label), rid)
        elif isinstance(msg, Ping):
            m = store.meta
            self._reply(ident, Pong(
                part_id=self.cfg.part_id, num_parts=m.num_parts, num_nodes=m.num_nodes,
                feat_dim=m.feat_dim, num_classes=m.num_classes, node_offsets=m.node_offsets,
                feat_dtype=str(store.feat.dtype).replace("torch.", ""), dataset=m.dataset,
                pid=os.getpid(), server_id=self.server_id), rid)
        elif isinstance(msg, CacheFillRequest):
            self._reply(ident, self._cache_fill(msg), rid)
        elif isinstance(msg, SeedsRequest):
            self._reply(ident, SeedsReply(seeds=store.seeds(msg.split)), rid)
        elif isinstance(msg, StatsRequest):
            with self.stats_lock:
                values = dict(self.stats)
            values["queue_len"] = self.jobs.qsize()
            self._reply(ident, StatsReply(values=values), rid)
        elif isinstance(msg, Shutdown):
            self._reply(ident, Ack(), rid)
            self.stop_event.set()
        else:
            raise ProtocolError("unexpected_type",
                                f"a server does not accept {type(msg).__name__} messages")

    # ------------------------------------------------------------------ sampler threads
    def _worker(self, index: int) -> None:
        """One sampling thread. Errors inside a request become error replies; anything that
        breaks the thread itself stops the whole server (exit code 1), so that clients see
        a dropped connection and fail over instead of waiting on a server that cannot work."""
        push = peers = None
        shm = ShmWriter()
        try:
            push = make_socket(self.ctx, zmq.PUSH, self.results_ep, bind=False, hwm=0)
            peers = (WirePeers(self.ctx, self.cluster, self.cfg.part_id,
                               self.cfg.peer_timeout_s, self.max_bytes, curve=self.peer_keys,
                               heartbeat=(self.cfg.heartbeat_s, self.cfg.heartbeat_timeout_s))
                     if self.cluster else None)
            scratch = torch.full((self.store.meta.num_nodes,), -1, dtype=torch.int64)
            while not self.stop_event.is_set():
                shm.expire()
                try:
                    ident, msg, rid, t_in = self.jobs.get(timeout=0.2)
                except queue.Empty:
                    continue
                frames = self._serve_sample(msg, rid, peers, scratch, t_in,
                                            time.perf_counter() - t_in, shm)
                push.send_multipart([ident, *frames], copy=False)
        except Exception as e:
            log.exception("part %d: sampler thread %d failed; stopping the server",
                          self.cfg.part_id, index)
            self.fatal = f"sampler thread {index} failed: {type(e).__name__}: {e}"
            self.stop_event.set()
        finally:
            shm.close()
            if peers:
                peers.close()
            if push is not None:
                push.close(0)

    def _shm_slot(self, msg: SampleRequest, shm: ShmWriter, rows: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor | None, int, str]:
        """(the request's ring slot as a rows x dim tensor or None, rows written there or -1,
        why the slot could not be used or "")."""
        if not msg.with_feat or msg.shm_fd < 0:
            return None, -1, ""
        ref = SlotRef(msg.shm_pid, msg.shm_fd, msg.shm_token, msg.shm_offset, msg.shm_capacity)
        try:
            slot = shm.target(ref, rows, self.store.feat.shape[1], dtype)
        except ShmError as e:
            return None, -1, str(e)
        return slot, (rows if slot is not None else -1), ""

    def _serve_sample(self, msg: SampleRequest, rid: int, peers: WirePeers | None,
                      scratch: torch.Tensor, t_in: float, queue_s: float,
                      shm: ShmWriter) -> list:
        timings = Timings()
        peer_bytes0 = peers.bytes_received if peers else 0
        try:
            neighbors = DistributedNeighbors(self.store, peers, timings, scratch)
            mfg = sample_mfg(msg.seeds, msg.fanouts, neighbors)
            present = torch.empty(0, dtype=torch.bool)
            send = mfg.input_nodes
            if msg.cache_ratio > 0 and msg.with_feat:
                present = ~self._cached(mfg.input_nodes, msg.cache_ratio)
                send = mfg.input_nodes[present]  # the trainer holds the others' features
            want = FEAT_TRANSFER_DTYPES[msg.feat_dtype] or self.store.feat.dtype
            slot, shm_rows, shm_error = self._shm_slot(msg, shm, send.numel(), want)
            if slot is not None:  # gather straight into the trainer's ring slot
                neighbors.gather(send, True, False, out=slot)
                del slot  # release the mapping's buffer export
                feat = torch.empty((0, self.store.feat.shape[1]), dtype=want)
            else:
                feat, _ = neighbors.gather(send, msg.with_feat, False)
            _, label = neighbors.gather(msg.seeds, False, msg.with_label)
            t0 = time.perf_counter()
            if msg.with_feat and feat.dtype != want:
                feat = feat.to(want)  # counted as encode time
            reply = MFGReply(input_nodes=mfg.input_nodes, num_src=mfg.num_src,
                             num_dst=mfg.num_dst, indptr=mfg.indptr, indices=mfg.indices,
                             feat=feat, label=label, feat_present=present, timings={},
                             feat_shm_rows=shm_rows, shm_error=shm_error)
            reply.timings = {"sample_s": timings.sample_s, "gather_s": timings.gather_s,
                             "remote_s": timings.remote_s,
                             "remote_requests": float(timings.remote_requests),
                             "remote_bytes": float((peers.bytes_received if peers else 0)
                                                   - peer_bytes0),
                             "cached_rows": float(mfg.input_nodes.numel() - send.numel()),
                             "queue_s": queue_s, "shm_rows": float(max(shm_rows, 0))}
            frames = codec.encode(reply, rid)
            encode_s = time.perf_counter() - t0
            # Encoded again with the totals (cheap: tensors are not copied); the first
            # encode is the timed one.
            reply.timings["encode_s"] = encode_s
            reply.timings["server_s"] = time.perf_counter() - t_in
            frames = codec.encode(reply, rid)
            with self.stats_lock:
                s = self.stats
                s["sample_requests"] += 1
                s["seeds_served"] += msg.seeds.numel()
                s["sample_s"] += timings.sample_s
                s["gather_s"] += timings.gather_s
                s["remote_s"] += timings.remote_s
                s["remote_requests"] += timings.remote_requests
                s["remote_bytes"] += reply.timings["remote_bytes"]
                s["encode_s"] += encode_s
                s["bytes_out"] += sum(memoryview(f).nbytes for f in frames)
            return frames
        except ProtocolError as e:
            code, text = e.code, str(e)
        except PeerTimeoutError as e:
            code, text = "peer_timeout", str(e)
        except RemoteError as e:
            code, text = "peer_error", str(e)
        except Exception as e:
            log.exception("part %d: sampling failed", self.cfg.part_id)
            code, text = "internal", f"{type(e).__name__}: {e}"
        with self.stats_lock:
            self.stats["errors"] += 1
        return codec.encode(ErrorReply(code=code, message=text), rid)

    def _hot_rank(self):
        if self.hot_rank is None:
            raise ProtocolError("no_hot_rank", f"partition set {self.cfg.parts} has no "
                                f"{HOT_RANK_FILE}: re-run partition-ogbn with "
                                "--presample-batches > 0, or use --cache-ratio 0")
        return self.hot_rank

    def _cached(self, gids: torch.Tensor, ratio: float) -> torch.Tensor:
        """Which of ``gids`` a trainer with cache ratio ``ratio`` holds (partition.layout)."""
        mask = cached_mask(self._hot_rank(), gids.numpy(), self.store.meta.node_offsets, ratio)
        return torch.from_numpy(mask)

    def _cache_fill(self, msg: CacheFillRequest) -> CacheFillReply:
        rank = self._hot_rank()
        st = self.store
        limit = int(msg.cache_ratio * (st.end - st.start))
        local = np.nonzero(np.asarray(rank[st.start:st.end]) < limit)[0]
        nodes = torch.from_numpy(local.astype(np.int64) + st.start)
        feat, _ = st.gather(nodes, True, False)
        want = FEAT_TRANSFER_DTYPES[msg.feat_dtype]
        return CacheFillReply(nodes=nodes, feat=feat if want is None else feat.to(want))

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        self.stop_event.set()
        for w in self.workers:
            if w.is_alive() and w is not threading.current_thread():
                w.join(timeout=self.cfg.peer_timeout_s + 1)
        self.frontend.close(0)
        self.results.close(0)
        if self.authenticator is not None:
            self.authenticator.stop()
        if not any(w.is_alive() for w in self.workers):
            self.ctx.term()  # else a thread still holds a socket; process exit reclaims it
