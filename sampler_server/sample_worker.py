"""Serving one SampleRequest: the work a sampler thread or a sampler process does.

A :class:`SampleWorker` owns what must not be shared between threads or processes: its
sockets to peer servers, its relabel scratch buffer and its map of trainers' shared-memory
rings. The partition itself (:class:`PartitionStore`) is read-only and memory-mapped, so
threads share one object and processes share the page cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from common import codec
from common.cluster import ClusterSpec
from common.config import ServerConfig
from common.errors import MfgServeError, ProtocolError
from common.messages import FEAT_TRANSFER_DTYPES, MFGReply, SampleRequest
from common.sampled_mfg import FEAT_RING, Features
from common.shm_ring import ShmError, ShmWriter
from common.sockets import CurveKeys
from common.stats import RequestTimings, SampleCounts
from partition.layout import HOT_RANK_FILE, cached_mask
from sampler_server.neighbor_sampler import DistributedNeighbors, Timings, new_scratch, sample_mfg
from sampler_server.partition_store import PartitionStore
from sampler_server.peer_client import WirePeers

if TYPE_CHECKING:  # the runtime owns the context; this module only passes it on
    import zmq

log = logging.getLogger("mfgserve.server")

def peer_keys(cfg: ServerConfig, cluster: ClusterSpec | None) -> CurveKeys | None:
    """Towards its peers a server is a client with its own key pair (CurveZMQ), or None."""
    if not cfg.curve_secret_key or cluster is None:
        return None
    if not cluster.curve_server_key:
        raise MfgServeError(f"cluster file {cfg.cluster} has no curve_server_key, but this "
                            "server uses CurveZMQ; add it")
    own = CurveKeys.load(cfg.curve_secret_key)
    return CurveKeys(own.public, own.secret,
                     CurveKeys.load(cfg.curve_secret_key, cluster.curve_server_key).server_public)


def hot_rank_or_error(hot_rank, parts: str):
    if hot_rank is None:
        raise ProtocolError("no_hot_rank", f"partition set {parts} has no {HOT_RANK_FILE}: "
                            "re-run partition-ogbn with --presample-batches > 0, or use "
                            "--cache-ratio 0")
    return hot_rank


def _check_reply_size(frames: list, msg: SampleRequest) -> None:
    """Refuse a reply larger than the trainer accepts (``max_reply_bytes``): sent, it would be
    dropped by the trainer's socket along with the connection, and the trainer would see a
    server that went away instead of the cause."""
    if not msg.max_reply_bytes:
        return
    size = sum(memoryview(f).nbytes for f in frames)
    if size > msg.max_reply_bytes:
        raise ProtocolError(
            "too_large", f"the reply to this batch ({msg.seeds.numel()} seeds, fanouts "
            f"{msg.fanouts}) is {size / 2**20:.1f} MiB, above the {msg.max_reply_bytes / 2**20:.0f}"
            " MiB the trainer accepts: raise the trainer's --max-message-mb, or lower "
            "--batch-size or --fanouts (same host: the shared-memory ring carries the features "
            "outside the message)")


class SampleWorker:
    def __init__(self, cfg: ServerConfig, store: PartitionStore, hot_rank,
                 ctx: zmq.Context, cluster: ClusterSpec | None, keys: CurveKeys | None):
        self.cfg = cfg
        self.store = store
        self.hot_rank = hot_rank
        self.peers = (WirePeers(ctx, cluster, cfg, curve=keys, set_id=store.meta.set_id)
                      if cluster else None)
        self.scratch = new_scratch(store.meta.num_nodes)
        self.shm = ShmWriter()

    def close(self) -> None:
        self.shm.close()
        if self.peers:
            self.peers.close()

    def _cached(self, gids: torch.Tensor, ratio: float) -> torch.Tensor:
        """Which of ``gids`` a trainer with cache ratio ``ratio`` holds (partition.layout)."""
        rank = hot_rank_or_error(self.hot_rank, self.cfg.parts)
        mask = cached_mask(rank, gids.numpy(), self.store.meta.node_offsets, ratio)
        return torch.from_numpy(np.asarray(mask))

    def _features(self, msg: SampleRequest, neighbors: DistributedNeighbors, nodes: torch.Tensor,
                  want: torch.dtype) -> Features:
        """The features of ``nodes`` as they travel: gathered into the request's ring slot
        if it has one that fits, else as rows on the wire (in the store's dtype: the caller
        converts); in the cached mode only the rows the trainer does not cache."""
        dim = self.store.feat.shape[1]
        if not msg.with_feat:
            return Features.none(dim, want)
        present = None
        if msg.cache_ratio > 0:
            present = ~self._cached(nodes, msg.cache_ratio)
            nodes = nodes[present]  # the trainer holds the others' features
        error = ""
        if msg.slot is not None:
            try:
                slot = self.shm.target(msg.slot, nodes.numel(), dim, want)
            except ShmError as e:
                slot, error = None, str(e)
            if slot is not None:  # gather straight into the trainer's ring slot
                neighbors.gather(nodes, True, False, out=slot)
                del slot  # release the mapping's buffer export
                return Features.ring(nodes.numel(), dim, want, present)
        rows, _ = neighbors.gather(nodes, True, False)
        return Features.frames(rows, present, error)

    def idle(self) -> None:
        """Between requests: forget the rings of trainers that went away."""
        self.shm.expire()

    def serve(self, msg: SampleRequest, rid: int, t_in: float) -> tuple[list, SampleCounts]:
        """(reply frames, counts to add). A request that cannot be served raises; the
        executor turns that into an error reply (common.service.error_reply)."""
        queue_s = time.perf_counter() - t_in
        timings = Timings()
        peers = self.peers
        peer_bytes0 = peers.bytes_received if peers else 0
        neighbors = DistributedNeighbors(self.store, peers, timings, self.scratch)
        mfg = sample_mfg(msg.seeds, msg.fanouts, neighbors, msg.sample_seed)
        want = FEAT_TRANSFER_DTYPES[msg.feat_dtype] or self.store.feat.dtype
        feat = self._features(msg, neighbors, mfg.input_nodes, want)
        _, label = neighbors.gather(msg.seeds, False, msg.with_label)
        t0 = time.perf_counter()
        if feat.rows.dtype != want:
            feat = dataclasses.replace(feat, rows=feat.rows.to(want))  # counted as encode time
        remote_bytes = (peers.bytes_received if peers else 0) - peer_bytes0
        times = RequestTimings(
            sample_s=timings.sample_s, gather_s=timings.gather_s, remote_s=timings.remote_s,
            remote_requests=timings.remote_requests, remote_bytes=remote_bytes,
            cached_rows=feat.cached_rows, queue_s=queue_s,
            shm_rows=feat.num_rows if feat.via == FEAT_RING else 0)
        reply = MFGReply(mfg=mfg.with_data(feat, label), timings=times.to_wire())
        frames = codec.encode(reply, rid)
        times.encode_s = time.perf_counter() - t0
        # Encoded again with the totals (cheap: tensors are not copied); the first
        # encode is the timed one.
        times.server_s = time.perf_counter() - t_in
        reply.timings = times.to_wire()
        frames = codec.encode(reply, rid)
        _check_reply_size(frames, msg)
        return frames, SampleCounts(
            sample_requests=1, seeds_served=msg.seeds.numel(), sample_s=timings.sample_s,
            gather_s=timings.gather_s, remote_s=timings.remote_s,
            remote_requests=timings.remote_requests, remote_bytes=remote_bytes,
            encode_s=times.encode_s, ring_replies=int(feat.via == FEAT_RING),
            ring_rows=times.shm_rows)
