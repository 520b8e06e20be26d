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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from common.errors import BadRequestError
from common.messages import derive_seed
from common.sampled_mfg import Layer, SampledMFG
from sampler_server.partition_store import PartitionStore, merge_neighbors


class Peers(Protocol):
    """Requests to the servers of other partitions; each call sends all, then waits for all."""

    def sample_neighbors(self, requests: dict[int, Tensor], fanout: int,
                         seeds: dict[int, int] | None = None
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
    order, assumed unique) followed by the other ids of ``src`` (sorted, each once), and
    ``src_local[i]`` is the position of ``src[i]`` in ``nodes``.

    ``scratch`` (:func:`new_scratch`: int32, one slot per global node, all -1) makes this O(len)
    with no hashing or full sort; it is returned all -1 again. Without it, a sort-based version
    is used. The scratch version runs in numpy: its fancy indexing is several times faster than
    torch's for these scattered reads and writes, and int32 halves the memory they touch.
    """
    if scratch is None:
        new = torch.unique(src[~torch.isin(src, dst)])
        nodes = torch.cat([dst, new])
        uniq, inv = torch.unique(nodes, return_inverse=True)
        pos = torch.empty_like(inv)
        pos[inv] = torch.arange(nodes.numel())
        return nodes, pos[torch.searchsorted(uniq, src)]
    d, s = dst.numpy(), src.numpy()
    nd = d.size
    scratch[d] = np.arange(nd, dtype=np.int32)
    cand = s[scratch[s] < 0]
    # Any one write per repeated id wins; exactly one position per distinct id then reads
    # back its own index, which picks each distinct new id once.
    slots = np.arange(cand.size, dtype=np.int32)
    scratch[cand] = slots
    new = np.sort(cand[scratch[cand] == slots])  # sorted: gathers read memory in order
    scratch[new] = np.arange(nd, nd + new.size, dtype=np.int32)
    src_local = scratch[s].astype(np.int64)
    scratch[d] = -1
    scratch[new] = -1
    return torch.cat([dst, torch.from_numpy(new)]), torch.from_numpy(src_local)


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

    def sample(self, nodes: Tensor, fanout: int, sample_seed: int = -1, hop: int = 0
               ) -> tuple[Tensor, Tensor]:
        """(counts, src) for unique ``nodes`` of any part, in the order of ``nodes``; with
        ``sample_seed`` >= 0 a function of (nodes, fanout, sample_seed, hop)."""
        groups = self._split(nodes)
        remote = self._remote(groups, nodes)
        seeds = {p: derive_seed(sample_seed, hop, p) if sample_seed >= 0 else -1
                 for p in groups}
        results: dict[int, tuple[Tensor, Tensor]] = {}
        if remote:
            t0 = time.perf_counter()
            results.update(self.peers.sample_neighbors(  # type: ignore[union-attr]
                remote, fanout, seeds))
            self.timings.remote_s += time.perf_counter() - t0
            self.timings.remote_requests += len(remote)
        own = groups.get(self.store.part_id)
        if own is not None:
            t0 = time.perf_counter()
            results[self.store.part_id] = self.store.sample_neighbors(
                nodes if len(groups) == 1 else nodes.index_select(0, own), fanout,
                seeds[self.store.part_id])
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
