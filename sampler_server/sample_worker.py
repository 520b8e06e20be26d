"""Serving one SampleRequest: the work a sampler thread or a sampler process does.

A :class:`SampleWorker` owns what must not be shared between threads or processes: its
sockets to peer servers, its relabel scratch buffer and its map of trainers' shared-memory
rings. The partition itself (:class:`PartitionStore`) is read-only and memory-mapped, so
threads share one object and processes share the page cache.

Typed sets: the MFG has one NodeSet per node type (sampler_server/neighbor_sampler.py's
sample_typed_mfg). Each NodeSet's features travel like a homogeneous MFG's (frames or ring,
fp16/bf16 transfer, the cache's present-mask per NodeSet over its own ids); with a ring slot
all NodeSets' rows share the one slot, in node-set order (type 0's rows, then type 1's, ...;
in the cached mode only each type's present rows), each NodeSet's Features saying how many
rows (``num_rows``) are its own (common/sampled_mfg.py). Labels: only the seeds' type's
NodeSet has them (its output nodes are the seeds); the others' are empty.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from common import codec
from common.cluster import ClusterSpec
from common.config import ServerConfig
from common.errors import MfgServeError, ProtocolError
from common.messages import FEAT_TRANSFER_DTYPES, MFGReply, SampleRequest
from common.sampled_mfg import FEAT_RING, Features, SampledMFG
from common.shm_ring import ShmError, ShmWriter
from common.sockets import CurveKeys
from common.stats import RequestTimings, SampleCounts
from partition.layout import HOT_RANK_FILE, cached_mask
from sampler_server.neighbor_sampler import (
    DistributedNeighbors,
    Timings,
    new_scratch,
    sample_mfg,
    sample_typed_mfg,
)
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


def typed_fanouts(msg: SampleRequest, store: PartitionStore) -> list[list[int]] | None:
    """The per-layer, per-relation fanouts of a request to a typed set (None for a
    homogeneous set); a request that does not fit the set is a ProtocolError naming the
    field: ``rel_fanouts`` for a homogeneous set or of the wrong width, seeds of several node
    types."""
    meta = store.meta
    if not store.typed:
        if msg.rel_fanouts:
            raise ProtocolError("bad_field", f"rel_fanouts is for typed partition sets; "
                                f"{meta.dataset} is homogeneous: send fanouts only")
        return None
    num = len(meta.etypes)
    if msg.rel_fanouts and len(msg.rel_fanouts[0].fanouts) != num:
        raise ProtocolError(
            "bad_field", f"rel_fanouts needs one fanout per relation of {meta.dataset} "
            f"({num}: {[' '.join(t) for t in meta.etypes]}) in each layer, got "
            f"{len(msg.rel_fanouts[0].fanouts)}")
    types = torch.unique(store.node_types(msg.seeds))
    if types.numel() != 1:
        counts = {meta.ntypes[int(t)]: int((store.node_types(msg.seeds) == t).sum())
                  for t in types}
        raise ProtocolError("bad_seeds", f"seeds must all be of one node type, got {counts}: "
                            "send one request per node type")
    if msg.rel_fanouts:
        return [list(r.fanouts) for r in msg.rel_fanouts]
    return [[f] * num for f in msg.fanouts]


class SampleWorker:
    def __init__(self, cfg: ServerConfig, store: PartitionStore, hot_rank,
                 ctx: zmq.Context, cluster: ClusterSpec | None, keys: CurveKeys | None,
                 stop: threading.Event | None = None, shm: ShmWriter | None = None):
        self.cfg = cfg
        self.store = store
        self.hot_rank = hot_rank
        # stop: the server's stop event; a peer wait ends with it (see ReplicaSet.stop)
        self.peers = (WirePeers(ctx, cluster, cfg, curve=keys, set_id=store.meta.set_id,
                                stop=stop) if cluster else None)
        self.scratch = new_scratch(store.meta.num_nodes)
        # shm: the writer this process's sampler threads share (each ring mapped once); a
        # worker closes only a writer of its own (the shared one lives as long as the process)
        self.own_shm = shm is None
        self.shm = shm if shm is not None else ShmWriter()

    def close(self) -> None:
        if self.own_shm:
            self.shm.close()
        if self.peers:
            self.peers.close()

    def _cached(self, gids: torch.Tensor, ratio: float) -> torch.Tensor:
        """Which of ``gids`` a trainer with cache ratio ``ratio`` holds (partition.layout)."""
        rank = hot_rank_or_error(self.hot_rank, self.cfg.parts)
        mask = cached_mask(rank, gids.numpy(), self.store.meta.node_offsets, ratio)
        return torch.from_numpy(np.asarray(mask))

    def _features(self, msg: SampleRequest, neighbors: DistributedNeighbors,
                  node_sets: list[torch.Tensor], want: torch.dtype) -> list[Features]:
        """The features of each of ``node_sets`` (one id tensor per node type) as they
        travel: gathered into the request's ring slot if it has one that fits (the sets' rows
        one after the other, see the module docstring), else as rows on the wire (in the
        store's dtype: the caller converts); in the cached mode only the rows the trainer
        does not cache."""
        dim = self.store.feat.shape[1]
        if not msg.with_feat:
            return [Features.none(dim, want) for _ in node_sets]
        presents: list[torch.Tensor | None] = [None] * len(node_sets)
        if msg.cache_ratio > 0:
            presents = [~self._cached(ids, msg.cache_ratio) for ids in node_sets]
            # the trainer holds the others' features
            node_sets = [ids[p] for ids, p in zip(node_sets, presents)]  # type: ignore[index]
        nodes = node_sets[0] if len(node_sets) == 1 else torch.cat(node_sets)
        sizes = [ids.numel() for ids in node_sets]
        error = ""
        if msg.slot is not None:
            t0 = time.perf_counter()
            try:  # counted as gather time: the first use of a slot's pages populates them
                slot = self.shm.target(msg.slot, nodes.numel(), dim, want)
            except ShmError as e:
                slot, error = None, str(e)
            neighbors.timings.gather_s += time.perf_counter() - t0
            if slot is not None:  # gather straight into the trainer's ring slot
                neighbors.gather(nodes, True, False, out=slot)
                del slot  # release the mapping's buffer export
                return [Features.ring(n, dim, want, p) for n, p in zip(sizes, presents)]
        rows, _ = neighbors.gather(nodes, True, False)
        split = [rows] if len(node_sets) == 1 else torch.split(rows, sizes)
        return [Features.frames(r, p, error) for r, p in zip(split, presents)]

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
        rel_fanouts = typed_fanouts(msg, self.store)
        mfg = (sample_mfg(msg.seeds, msg.fanouts, neighbors, msg.sample_seed)
               if rel_fanouts is None else
               sample_typed_mfg(msg.seeds, rel_fanouts, neighbors, msg.sample_seed))
        want = FEAT_TRANSFER_DTYPES[msg.feat_dtype] or self.store.feat.dtype
        feats = self._features(msg, neighbors, [ns.ids for ns in mfg.nodes], want)
        _, label = neighbors.gather(msg.seeds, False, msg.with_label)
        t0 = time.perf_counter()
        feats = [f if f.rows.dtype == want else dataclasses.replace(f, rows=f.rows.to(want))
                 for f in feats]  # the conversion is counted as encode time
        remote_bytes = (peers.bytes_received if peers else 0) - peer_bytes0
        ring = feats[0].via == FEAT_RING
        times = RequestTimings(
            sample_s=timings.sample_s, gather_s=timings.gather_s, remote_s=timings.remote_s,
            remote_requests=timings.remote_requests, remote_bytes=remote_bytes,
            cached_rows=sum(f.cached_rows for f in feats), queue_s=queue_s,
            shm_rows=sum(f.num_rows for f in feats) if ring else 0)
        reply = MFGReply(mfg=_with_data(mfg, feats, label), timings=times.to_wire())
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
            encode_s=times.encode_s, ring_replies=int(ring),
            ring_rows=times.shm_rows)


def _with_data(mfg: SampledMFG, feats: list[Features], label: torch.Tensor) -> SampledMFG:
    """``mfg`` with each NodeSet's features, and ``label`` on the seeds' NodeSet (the one
    whose output nodes are the seeds; the only one in a homogeneous MFG)."""
    if len(mfg.nodes) == 1:
        return mfg.with_data(feats[0], label)
    out = mfg.layers[-1].num_dst
    nodes = [dataclasses.replace(ns, feat=f, label=label if out[t] else ns.label)
             for t, (ns, f) in enumerate(zip(mfg.nodes, feats))]
    return dataclasses.replace(mfg, nodes=nodes)
