"""Multi-hop MFG sampling over a partitioned graph (domain logic, no networking).

:class:`DistributedNeighbors` answers "sample in-neighbours of these nodes" for nodes of any
partition: owned nodes go to the local :class:`PartitionStore`, the rest to a :class:`Peers`
object (implemented over the wire by the server process). :func:`sample_mfg` builds the MFG
hop by hop from the seeds outwards, so a trainer gets the same MFG it would get from one server
holding the whole graph.

With a sample seed (>= 0) every hop and every part gets its own seed,
``derive_seed(sample_seed, hop, part)``: the part's own store samples with it, and a
NeighborsRequest to another part's server carries it, so the MFG is the same whichever
thread, process or replica serves the request (sampler_server/seeded_sampler.py). Without
halos it is even the same whichever part's server receives it; with halos a server samples
the halo nodes it holds itself, under its own part's seed (the loader sends a batch to the
same part every time, so its MFG still repeats).

Typed sets (:func:`sample_typed_mfg`): each hop samples every relation whose destination
type has nodes in the frontier, with that relation's fanout, through the same local / halo /
peer split (a peer gets ``NeighborsRequest(etype=r)``); relation r of hop h on part p samples
under ``derive_seed(sample_seed, hop, part, r)``. All sources of a hop are relabelled
together (destinations first, as above), then split by node type, which keeps the prefix rule
per type.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from common import native
from common.errors import BadRequestError
from common.messages import derive_seed
from common.sampled_mfg import Features, Layer, NodeSet, Relation, SampledMFG
from sampler_server.partition_store import PartitionStore, merge_neighbors


class Peers(Protocol):
    """Requests to the servers of other partitions; each call sends all, then waits for all."""

    def sample_neighbors(self, requests: dict[int, Tensor], fanout: int,
                         seeds: dict[int, int] | None = None, etype: int = -1
                         ) -> dict[int, tuple[Tensor, Tensor]]: ...

    def gather(self, requests: dict[int, Tensor], with_feat: bool, with_label: bool
               ) -> dict[int, tuple[Tensor, Tensor]]: ...


@dataclass
class Timings:
    """Seconds spent per stage while serving one request."""

    sample_s: float = 0.0
    gather_s: float = 0.0
    remote_s: float = 0.0
    remote_requests: int = 0


def relabel(dst: Tensor, src: Tensor, scratch: np.ndarray | None = None) -> tuple[Tensor, Tensor]:
    """Compact ids: returns ``(nodes, src_local)`` where ``nodes`` lists ``dst`` first (in
    order, assumed unique) followed by the other ids of ``src``, each once, in ascending
    order, and ``src_local[i]`` is the position of ``src[i]`` in ``nodes``.

    Ascending, not DGL ``to_block``'s order of first appearance (the same node sets, the same
    edges): the last hop's ``nodes`` are the rows the server gathers, and rows read front to
    back stream from memory far faster than in a random order (docs/benchmarks.md, session
    22); the next hop also reads the CSC rows of a sorted frontier in order.

    ``scratch`` (:func:`new_scratch`: int32, one slot per global node, all -1) makes this O(len)
    with no hashing; it is returned all -1 again. With it, the native kernel (common/native.c,
    GIL released) does the work; where that is not loaded, the same result comes from numpy
    passes (fancy indexing several times faster than torch's for these scattered reads and
    writes; int32 halves the memory they touch). Without a scratch, a sort-based version gives
    the same result too.
    """
    if scratch is None:
        return _relabel_sorting(dst, src)
    lib = native.load()
    if lib is None:
        return _relabel_numpy(dst, src, scratch)
    nd, ns = dst.numel(), src.numel()
    dst, src = dst.long().contiguous(), src.long().contiguous()
    nodes = torch.empty(nd + ns, dtype=torch.int64)
    nodes[:nd] = dst
    src_local = torch.empty(ns, dtype=torch.int64)
    nn = lib.mfg_relabel(dst.data_ptr(), nd, src.data_ptr(), ns, scratch.size,
                         scratch.ctypes.data, nodes.data_ptr() + 8 * nd, src_local.data_ptr())
    if nn == native.NO_MEMORY:
        raise MemoryError(f"relabel: no memory for the work arrays of {ns} sources")
    if nn < 0:
        raise ValueError(f"relabel: an id is outside [0, {scratch.size}) (the scratch's "
                         "node count)")
    return nodes[:nd + nn], src_local


def _relabel_numpy(dst: Tensor, src: Tensor, scratch: np.ndarray) -> tuple[Tensor, Tensor]:
    """:func:`relabel` in numpy passes over the same scratch."""
    d, s = dst.numpy(), src.numpy()
    nd = d.size
    scratch[d] = np.arange(nd, dtype=np.int32)
    new = np.unique(s[scratch[s] < 0])  # sorted, once each
    scratch[new] = np.arange(nd, nd + new.size, dtype=np.int32)
    src_local = scratch[s].astype(np.int64)
    scratch[d] = -1
    scratch[new] = -1
    return torch.cat([dst, torch.from_numpy(new)]), torch.from_numpy(src_local)


def _relabel_sorting(dst: Tensor, src: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`relabel` by sorting, with no scratch (the reference for the other two)."""
    uniq = torch.unique(src)  # sorted
    nodes = torch.cat([dst, uniq[~torch.isin(uniq, dst)]])
    order = torch.argsort(nodes)
    return nodes, order[torch.searchsorted(nodes[order], src)]


def new_scratch(num_nodes: int) -> np.ndarray:
    """A relabel buffer for a graph of ``num_nodes`` nodes (one per sampling thread)."""
    if num_nodes >= 2**31:
        raise ValueError("relabel's int32 scratch needs fewer than 2**31 nodes")
    return np.full(num_nodes, -1, dtype=np.int32)


class DistributedNeighbors:
    def __init__(self, store: PartitionStore, peers: Peers | None, timings: Timings,
                 scratch: np.ndarray | None = None):
        self.store = store
        self.peers = peers
        self.timings = timings
        self.scratch = scratch  # per-thread relabel buffer, see relabel()

    def _split(self, nodes: Tensor) -> dict[int, Tensor]:
        """Positions of ``nodes`` grouped by the part that answers for them: this store for
        owned and halo nodes, else the owner."""
        if self.store.all_owned(nodes):
            return {self.store.part_id: torch.arange(nodes.numel())}
        owners = self.store.owner_of(nodes)
        if self.store.has_halo:
            owners[self.store.is_local(nodes)] = self.store.part_id
        parts = torch.unique(owners).tolist()
        return {p: torch.nonzero(owners == p).flatten() for p in parts}

    def _remote(self, groups: dict[int, Tensor], nodes: Tensor) -> dict[int, Tensor]:
        remote = {p: nodes[pos] for p, pos in groups.items() if p != self.store.part_id}
        if remote and self.peers is None:
            raise BadRequestError(
                f"nodes of parts {sorted(remote)} are needed but this server (part "
                f"{self.store.part_id}) has no cluster file to reach their servers; "
                "start it with --cluster")
        return remote

    def sample(self, nodes: Tensor, fanout: int, sample_seed: int = -1, hop: int = 0,
               etype: int = -1) -> tuple[Tensor, Tensor]:
        """(counts, src) for unique ``nodes`` of any part, in the order of ``nodes`` (through
        relation ``etype`` only, when >= 0); with ``sample_seed`` >= 0 a function of (nodes,
        fanout, sample_seed, hop, etype)."""
        groups = self._split(nodes)
        remote = self._remote(groups, nodes)
        rel = () if etype < 0 else (etype,)
        seeds = {p: derive_seed(sample_seed, hop, p, *rel) if sample_seed >= 0 else -1
                 for p in groups}
        results: dict[int, tuple[Tensor, Tensor]] = {}
        if remote:
            t0 = time.perf_counter()
            results.update(self.peers.sample_neighbors(  # type: ignore[union-attr]
                remote, fanout, seeds, etype))
            self.timings.remote_s += time.perf_counter() - t0
            self.timings.remote_requests += len(remote)
        own = groups.get(self.store.part_id)
        if own is not None:
            t0 = time.perf_counter()
            results[self.store.part_id] = self.store.sample_neighbors(
                nodes if len(groups) == 1 else nodes.index_select(0, own), fanout,
                seeds[self.store.part_id], etype)
            self.timings.sample_s += time.perf_counter() - t0
        if len(groups) == 1:
            return results[next(iter(groups))]
        return merge_neighbors(nodes.numel(),
                               [(pos, *results[p]) for p, pos in groups.items()])

    def gather(self, nodes: Tensor, with_feat: bool, with_label: bool,
               out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Features / labels of ``nodes`` of any part, rows in the order of ``nodes``;
        features written into ``out`` when given (see PartitionStore.gather)."""
        groups = self._split(nodes)
        remote = self._remote(groups, nodes)
        results: dict[int, tuple[Tensor, Tensor]] = {}
        if remote:
            t0 = time.perf_counter()
            results.update(self.peers.gather(remote, with_feat, with_label))  # type: ignore[union-attr]
            self.timings.remote_s += time.perf_counter() - t0
            self.timings.remote_requests += len(remote)
        own = groups.get(self.store.part_id)
        t0 = time.perf_counter()
        single = len(groups) == 1
        if own is not None:
            results[self.store.part_id] = self.store.gather(
                nodes if single else nodes.index_select(0, own), with_feat, with_label,
                out if single else None)
        if single:
            res = results[next(iter(groups))]
            if out is not None and with_feat and res[0] is not out:
                out.copy_(res[0])
                res = (out, res[1])
        else:
            feat_dim = self.store.feat.shape[1]
            feat = out if out is not None and with_feat else torch.empty(
                (nodes.numel() if with_feat else 0, feat_dim), dtype=self.store.feat.dtype)
            label = self.store.empty_label(nodes.numel() if with_label else 0)
            for p, pos in groups.items():
                f, lab = results[p]
                if with_feat:
                    feat[pos] = f.to(feat.dtype)
                if with_label:
                    label[pos] = lab
            res = (feat, label)
        self.timings.gather_s += time.perf_counter() - t0
        return res


def sample_mfg(seeds: Tensor, fanouts: list[int], neighbors: DistributedNeighbors,
               sample_seed: int = -1) -> SampledMFG:
    """Sample an MFG for unique ``seeds`` (``fanouts[0]`` is the input layer's fanout), without
    features or labels yet (:meth:`SampledMFG.with_data` adds them); reproducibly when
    ``sample_seed`` >= 0 (hop 0 samples the seeds' neighbours)."""
    nodes = seeds
    layers = []
    for hop, fanout in enumerate(reversed(fanouts)):
        counts, src = neighbors.sample(nodes, fanout, sample_seed, hop)
        t0 = time.perf_counter()
        all_nodes, src_local = relabel(nodes, src, neighbors.scratch)
        indptr = torch.zeros(nodes.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=indptr[1:])
        layers.append(Layer.homogeneous(all_nodes.numel(), nodes.numel(), indptr, src_local))
        neighbors.timings.sample_s += time.perf_counter() - t0
        nodes = all_nodes
    layers.reverse()
    return SampledMFG.homogeneous(nodes, layers)


def _by_type(nt: np.ndarray, ntypes: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds): ``order[bounds[t]:bounds[t + 1]]`` are the positions of type t's
    nodes in ``nt``, in their order (a stable counting sort of the int8 types)."""
    order = np.argsort(nt, kind="stable")
    bounds = np.zeros(ntypes + 1, dtype=np.int64)
    np.cumsum(np.bincount(nt, minlength=ntypes), out=bounds[1:])
    return order, bounds


def sample_typed_mfg(seeds: Tensor, rel_fanouts: list[list[int]],
                     neighbors: DistributedNeighbors, sample_seed: int = -1) -> SampledMFG:
    """:func:`sample_mfg` for a typed set: ``rel_fanouts[l][r]`` is relation r's fanout in
    layer l (input layer first; 0: not sampled). ``seeds`` (unique) share one node type. The
    MFG has one NodeSet per node type of the set (ids only: features and labels are the
    caller's) and, per layer, one Relation per relation of the set (CSC over its destination
    type's destinations, indices among its source type's sources). The bookkeeping runs in
    numpy (single-threaded, no per-op overhead worth counting on a few 10k ids)."""
    store = neighbors.store
    meta = store.meta
    tid = {t: i for i, t in enumerate(meta.ntypes)}
    rels = [(tid[s], name, tid[d]) for s, name, d in meta.etypes]
    ntypes = len(meta.ntypes)
    node_type = store.node_type.numpy()
    nodes = seeds
    nt = node_type[seeds.numpy()]
    order, bounds = _by_type(nt, ntypes)
    layers = []
    for hop, fans in enumerate(reversed(rel_fanouts)):
        num_dst = np.diff(bounds).tolist()
        sampled = []
        for r, (_, _, d) in enumerate(rels):
            if fans[r] == 0 or num_dst[d] == 0:
                sampled.append((torch.zeros(num_dst[d], dtype=torch.int64),
                                torch.zeros(0, dtype=torch.int64)))
            else:
                pos = torch.from_numpy(order[bounds[d]:bounds[d + 1]])
                sampled.append(neighbors.sample(nodes.index_select(0, pos), fans[r],
                                                sample_seed, hop, etype=r))
        t0 = time.perf_counter()
        srcs = [src.numpy() for _, src in sampled]
        all_nodes, src_local = relabel(nodes, torch.from_numpy(np.concatenate(srcs)),
                                       neighbors.scratch)
        nt = np.concatenate([nt, node_type[all_nodes.numpy()[nodes.numel():]]])
        order, bounds = _by_type(nt, ntypes)
        # each node's position among the nodes of its own type (stable: the prefix rule)
        typed_pos = np.empty(nt.size, dtype=np.int64)
        typed_pos[order] = np.arange(nt.size) - np.repeat(bounds[:-1], np.diff(bounds))
        local = typed_pos[src_local.numpy()]
        out, at = [], 0
        for (s, name, d), (counts, src) in zip(rels, sampled):
            indptr = torch.zeros(num_dst[d] + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=indptr[1:])
            out.append(Relation(indptr, torch.from_numpy(local[at:at + src.numel()]), s, d,
                                name))
            at += src.numel()
        layers.append(Layer(np.diff(bounds).tolist(), num_dst, out))
        neighbors.timings.sample_s += time.perf_counter() - t0
        nodes = all_nodes
    layers.reverse()
    ids = nodes.numpy()
    return SampledMFG([NodeSet(torch.from_numpy(ids[order[bounds[t]:bounds[t + 1]]]),
                               Features.none(), torch.empty(0, dtype=torch.int64), ntype=name)
                       for t, name in enumerate(meta.ntypes)], layers)
