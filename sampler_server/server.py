"""The sampler server process: one ROUTER socket, an IO loop, and sampling workers.

Threads, sockets and (with ``--sampler-procs N``) processes::

    trainers / peers --> ROUTER (IO thread) --SAMPLE jobs--> bounded queue --> sampler threads
                               ^                                                 |
                               +------ PULL (inproc) <------ PUSH (per thread) --+

    with --sampler-procs N, instead of threads:
    trainers / peers --> ROUTER (IO thread) --jobs--> ROUTER backend (private ipc) --> N sampler
                               ^                                                   processes
                               +------------------ replies, stats <----------------+

The IO thread answers cheap, local-only requests inline (PING, NEIGHBORS_REQ, NODE_DATA_REQ,
SEEDS_REQ, STATS_REQ, SHUTDOWN) so that a peer's request is never stuck behind a full-MFG job
that itself waits on that peer: two servers sampling across each other cannot deadlock.
SAMPLE requests go to the samplers through a bounded queue (sampler processes take a job only
when idle); when it is full the client gets a ``busy`` error reply (its credits should prevent
that). Every malformed message gets an ``ERROR`` reply and the server keeps serving. A sampler
thread or process that breaks stops the server (exit 1), so clients fail over.

Sampler processes map the same partition files, so the page cache holds one copy of the
partition for all of them; ``STATS`` reports the memory of the server and its workers (rss,
pss, uss from psutil).
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil
import torch
import zmq

from common import codec
from common.cluster import ClusterSpec
from common.config import ServerConfig
from common.errors import ConfigError, MfgServeError, ProtocolError
from common.lifetime import die_with_parent
from common.messages import (
    FEAT_TRANSFER_DTYPES,
    Ack,
    CacheFillReply,
    CacheFillRequest,
    ErrorReply,
    Message,
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
from common.sockets import CurveKeys, bound_endpoint, make_socket, read_token
from partition.layout import load_hot_rank
from sampler_server.backlog import PeerBacklog
from sampler_server.partition_store import PartitionStore
from sampler_server.sample_worker import STAT_KEYS, SampleWorker, hot_rank_or_error, peer_keys
from sampler_server.sampler_proc import T_IN, worker_argv

log = logging.getLogger("mfgserve.server")
SAMPLER_START_TIMEOUT_S = 300.0


def process_memory() -> dict[str, float]:
    """This process's and its children's memory (psutil): rss sums resident pages (shared
    ones counted once per process), pss splits shared pages among the processes mapping them
    (the honest total), uss is what exiting them would free."""
    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    out = {"mem_rss_bytes": 0.0, "mem_pss_bytes": 0.0, "mem_uss_bytes": 0.0,
           "sampler_processes": float(len(procs))}
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except (psutil.Error, OSError):
            continue
        out["mem_rss_bytes"] += info.rss
        out["mem_pss_bytes"] += getattr(info, "pss", info.rss)
        out["mem_uss_bytes"] += getattr(info, "uss", info.rss)
    return out


class SamplerServer:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.max_bytes = cfg.max_message_mb << 20
        self.store = PartitionStore(cfg.parts, cfg.part_id, seed=cfg.seed)
        self.hot_rank = load_hot_rank(cfg.parts)
        self.cluster = ClusterSpec.load(cfg.cluster) if cfg.cluster else None
        if self.cluster is None and self.store.meta.num_parts > 1:
            raise ConfigError(
                f"partition set {cfg.parts} has {self.store.meta.num_parts} parts, so this "
                "server must reach the other parts' servers to sample across part boundaries: "
                "pass --cluster FILE.yaml listing every part's server endpoints")
        self.shutdown_token = read_token(cfg.shutdown_token_file)
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
            self.peer_keys = peer_keys(cfg, self.cluster)
        self.frontend = make_socket(self.ctx, zmq.ROUTER, cfg.bind, bind=True, hwm=10000,
                                    max_message_bytes=self.max_bytes, curve=server_keys,
                                    heartbeat_s=cfg.heartbeat_s,
                                    heartbeat_timeout_s=cfg.heartbeat_timeout_s)
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.backlog = PeerBacklog(cfg.max_peer_backlog_mb << 20)
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
        self.workers: list[threading.Thread] = []
        self.procs: list[subprocess.Popen] = []
        self.backend = None
        self.proc_dir: str | None = None
        self.pending: deque = deque()  # process mode: jobs not yet given to a process
        self.idle: deque = deque()  # process mode: identities of idle sampler processes
        if cfg.sampler_procs > 0:
            self._start_procs()
        else:
            self.workers = [threading.Thread(target=self._worker, args=(i,), daemon=True,
                                             name=f"sampler-{i}")
                            for i in range(cfg.num_workers)]

    def _start_procs(self) -> None:
        """Start the sampler processes and wait until each has loaded the partition."""
        self.proc_dir = tempfile.mkdtemp(prefix="mfgserve-samplers-")  # 0700
        backend_ep = f"ipc://{self.proc_dir}/backend.sock"
        self.backend = make_socket(self.ctx, zmq.ROUTER, backend_ep, bind=True, hwm=0)
        for i in range(self.cfg.sampler_procs):
            self.procs.append(subprocess.Popen(worker_argv(self.cfg, backend_ep, i),
                                               stdin=subprocess.DEVNULL,
                                               preexec_fn=die_with_parent))
        deadline = time.monotonic() + SAMPLER_START_TIMEOUT_S
        try:
            while len(self.idle) < len(self.procs):
                self._check_procs()
                if self.fatal:
                    raise MfgServeError(f"part {self.cfg.part_id}: {self.fatal}")
                if time.monotonic() > deadline:
                    raise MfgServeError(
                        f"part {self.cfg.part_id}: {len(self.procs) - len(self.idle)} sampler "
                        f"process(es) not ready after {SAMPLER_START_TIMEOUT_S:.0f}s; use "
                        "fewer --sampler-procs or check memory")
                if self.backend.poll(200):
                    frames = self.backend.recv_multipart()
                    if frames[1] == b"READY":
                        self.idle.append(frames[0])
        except BaseException:
            # The server never starts serving, so close() will not run: stop the workers
            # that did start and remove the private directory here.
            self._stop_procs()
            self.backend.close(0)
            shutil.rmtree(self.proc_dir, ignore_errors=True)
            raise

    def _check_procs(self) -> None:
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and not self.fatal:
                self.fatal = (f"sampler process {i} (pid {proc.pid}) exited with code {code}; "
                              "see its log lines above")
                self.stop_event.set()

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
        if self.backend is not None:
            poller.register(self.backend, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                events = dict(poller.poll(200))
                if self.procs:
                    self._check_procs()
                if self.results in events:
                    self._drain_results()
                if self.backend is not None and self.backend in events:
                    self._drain_backend()
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
            self._send(frames[0], frames[1:])

    def _drain_backend(self) -> None:
        """Replies from sampler processes: add their stats, forward, hand out more jobs."""
        assert self.backend is not None
        while True:
            try:
                frames = self.backend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            wid, kind = frames[0].bytes, frames[1].bytes
            if kind == b"R":
                self._add_stats(msgpack.unpackb(frames[2].bytes))
                self._send(frames[3], frames[4:])
            self.idle.append(wid)
        self._pump_jobs()

    def _pump_jobs(self) -> None:
        assert self.backend is not None
        while self.idle and self.pending:
            ident, body, t_in = self.pending.popleft()
            self.backend.send_multipart([self.idle.popleft(), b"JOB", ident,
                                         T_IN.pack(t_in), *body], copy=False)

    def _add_stats(self, delta: dict) -> None:
        with self.stats_lock:
            for k, v in delta.items():
                if k in STAT_KEYS:
                    self.stats[k] += v

    def _send(self, ident: Any, frames: list) -> None:
        """Every reply leaves through here: bounded per peer (sampler_server/backlog.py)."""
        self.backlog.send(self.frontend, ident, frames)

    def _reply(self, ident: Any, msg: Message, rid: int) -> None:
        frames = codec.encode(msg, rid)
        self.stats["bytes_out"] += sum(memoryview(f).nbytes for f in frames)
        self._send(ident, frames)

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
            self._dispatch(ident, msg, rid, body)
        except ProtocolError as e:
            self._error(ident, rid, e.code, str(e))
        except (ValueError, RuntimeError, MfgServeError) as e:
            self._error(ident, rid, "bad_request", str(e))
        except Exception as e:  # a bug must not take the server down for everyone else
            log.exception("part %d: internal error", self.cfg.part_id)
            self._error(ident, rid, "internal", f"{type(e).__name__}: {e}")

    def _check_set(self, msg: Message) -> None:
        """A request naming another partition set would get answers from the wrong graph."""
        want, own = getattr(msg, "set_id", ""), self.store.meta.set_id
        if want and want != own:
            raise ProtocolError(
                "wrong_partition_set",
                f"part {self.cfg.part_id} at {self.endpoint} serves partition set {own} "
                f"({self.cfg.parts}), but the request is for partition set {want}: servers "
                "of different partitionings are mixed; start every server of the cluster "
                "on the same partition-ogbn output")

    def _dispatch(self, ident: Any, msg: Message, rid: int, body: list) -> None:
        store = self.store
        self._check_set(msg)
        if isinstance(msg, SampleRequest):
            n, top = store.meta.num_nodes, int(msg.seeds.max())  # check() ensured non-empty
            if top >= n:
                raise ProtocolError("id_out_of_range",
                                    f"seed id {top} is outside [0, {n}): dataset "
                                    f"{store.meta.dataset} has {n} nodes")
            try:
                if self.backend is not None:
                    if len(self.pending) >= self.cfg.max_queue:
                        raise queue.Full
                    self.pending.append((ident, body, time.perf_counter()))
                    self._pump_jobs()
                else:
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
                pid=os.getpid(), server_id=self.server_id, set_id=m.set_id), rid)
        elif isinstance(msg, CacheFillRequest):
            self._reply(ident, self._cache_fill(msg), rid)
        elif isinstance(msg, SeedsRequest):
            self._reply(ident, SeedsReply(seeds=store.seeds(msg.split)), rid)
        elif isinstance(msg, StatsRequest):
            with self.stats_lock:
                values = dict(self.stats)
            values["queue_len"] = self.jobs.qsize() + len(self.pending) + (
                len(self.procs) - len(self.idle) if self.procs else 0)
            values.update(process_memory())
            values["replies_dropped"] = float(self.backlog.dropped)
            values["backlog_bytes"] = float(self.backlog.queued_bytes())
            self._reply(ident, StatsReply(values=values), rid)
        elif isinstance(msg, Shutdown):
            if not self.shutdown_token or not hmac.compare_digest(
                    msg.token.encode(), self.shutdown_token.encode()):
                raise ProtocolError(
                    "forbidden", "Shutdown refused: it needs the token of this server's "
                    "--shutdown-token-file" if self.shutdown_token else "Shutdown refused: "
                    "this server was started without --shutdown-token-file; stop it with "
                    "SIGTERM")
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
        push = worker = None
        try:
            push = make_socket(self.ctx, zmq.PUSH, self.results_ep, bind=False, hwm=0)
            worker = SampleWorker(self.cfg, self.store, self.hot_rank, self.ctx, self.cluster,
                                  self.peer_keys)
            while not self.stop_event.is_set():
                worker.shm.expire()
                try:
                    ident, msg, rid, t_in = self.jobs.get(timeout=0.2)
                except queue.Empty:
                    continue
                frames, delta = worker.serve(msg, rid, t_in)
                self._add_stats(delta)
                push.send_multipart([ident, *frames], copy=False)
        except Exception as e:
            log.exception("part %d: sampler thread %d failed; stopping the server",
                          self.cfg.part_id, index)
            self.fatal = f"sampler thread {index} failed: {type(e).__name__}: {e}"
            self.stop_event.set()
        finally:
            if worker is not None:
                worker.close()
            if push is not None:
                push.close(0)

    def _cache_fill(self, msg: CacheFillRequest) -> CacheFillReply:
        rank = hot_rank_or_error(self.hot_rank, self.cfg.parts)
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
        self._stop_procs()
        self.frontend.close(0)
        self.results.close(0)
        if self.backend is not None:
            self.backend.close(0)
        if self.proc_dir:
            shutil.rmtree(self.proc_dir, ignore_errors=True)
        if self.authenticator is not None:
            self.authenticator.stop()
        if not any(w.is_alive() for w in self.workers):
            self.ctx.term()  # else a thread still holds a socket; process exit reclaims it

    def _stop_procs(self) -> None:
        """Tell every sampler process to stop; kill those that do not within the deadline."""
        if not self.procs:
            return
        assert self.backend is not None
        for wid in set(self.idle):
            self.backend.send_multipart([wid, b"STOP"])
        # Busy ones finish their job first; their STOP goes when they report back.
        deadline = time.monotonic() + self.cfg.peer_timeout_s + 2
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            if self.backend.poll(100):
                frames = self.backend.recv_multipart()
                self.backend.send_multipart([frames[0], b"STOP"])
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
