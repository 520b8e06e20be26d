"""One partition in memory: its topology as a DGL sampling graph, its features and labels.

Local operations only (no networking): sample in-neighbours of owned nodes with DGL's C++
sampler (or, for a request with a sample seed, reproducibly: sampler_server/seeded_sampler.py),
and gather owned nodes' features/labels. Arrays come from the partition set's
memory-mapped ``.npy`` files, so several processes on a node share the page cache.

Typed sets (partition/layout.py: node_type.npy, etype.npy, halo_etype.npy) sample one
relation at a time (``sample_neighbors(..., etype=r)``): a destination's in-edge segment is
sorted by relation, so relation r's in-edges of destination v are one run of it, found by a
binary search over the etypes of each requested row's segment (no per-relation copy
of the graph; nothing held but the memory maps). Those runs are sampled by
sampler_server/seeded_sampler.py, with the request's seed or, unseeded, a fresh random one per
call (DGL's C++ sampler needs a CSC per relation). ``etype=-1`` samples all in-edges as for a
homogeneous set.
"""

from __future__ import annotations

import secrets
import warnings

import numpy as np
import torch
from torch import Tensor

from common import native
from common.dgl_compat import import_dgl
from common.errors import BadRequestError
from common.messages import derive_seed
from common.structs import id_bounds
from partition.layout import Partition, load_node_type, load_partition
from sampler_server.seeded_sampler import sample_csc, sample_runs

# Feature gathers into a caller's buffer (a trainer's ring slot) of at least this many bytes
# write with non-temporal stores (common/native.c's mfg_copy_rows): beyond the cache, the
# reply is read next by another process.
STREAM_MIN_BYTES = 8 << 20


def _as_tensor(a: np.ndarray) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap; never written
        return torch.from_numpy(a)


def relation_runs(indptr: np.ndarray, etype: np.ndarray, rows: np.ndarray, r: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(start, deg) of relation ``r``'s run in each of ``rows``' in-edge segments
    ``[indptr[v], indptr[v + 1])``, whose etypes are sorted: two lower-bound binary searches
    per row, by the native kernel (``mfg_relation_runs``, one pass) where it is loaded and
    the arrays are int64 / int16, else vectorised over all rows in numpy (log2(max degree) +
    1 steps each; the same result)."""
    lib = native.load()
    ip, et = np.asarray(indptr), np.asarray(etype)
    if (lib is not None and ip.dtype == np.int64 and et.dtype == np.int16
            and ip.flags.c_contiguous and et.flags.c_contiguous):
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        start, deg = np.empty(rows.size, dtype=np.int64), np.empty(rows.size, dtype=np.int64)
        if lib.mfg_relation_runs(ip.ctypes.data, ip.size - 1, et.ctypes.data, et.size,
                                 rows.ctypes.data, rows.size, int(r), start.ctypes.data,
                                 deg.ctypes.data) < 0:
            raise IndexError(f"typed sampling: a row outside the CSC's {ip.size - 1} rows, "
                             f"or an in-edge segment outside its {et.size} relation ids")
        return start, deg
    lo, hi = indptr[rows].astype(np.int64), indptr[rows + 1].astype(np.int64)
    start = _lower_bound(etype, lo, hi, r)
    end = _lower_bound(etype, start, hi, r + 1)
    return start, end - start


def _lower_bound(etype: np.ndarray, lo: np.ndarray, hi: np.ndarray, r: int) -> np.ndarray:
    """Per row, the first position in [lo, hi) whose etype is >= r (hi if none)."""
    last = max(etype.shape[0] - 1, 0)
    while True:
        act = lo < hi
        if not act.any():
            return lo
        mid = (lo + hi) >> 1
        less = np.asarray(etype[np.minimum(mid, last)]) < r
        lo = np.where(act & less, mid + 1, lo)
        hi = np.where(act & ~less, mid, hi)


def merge_neighbors(n: int, groups: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge per-group neighbour samples into ``(counts, src)`` for ``n`` nodes.

    Each group is ``(positions, counts, src)``: the positions (among the n nodes) it sampled
    for, their neighbour counts, and the sources concatenated in that order. Groups partition
    the positions; the result lists each node's sources in node order.
    """
    counts = torch.zeros(n, dtype=torch.int64)
    for pos, c, _ in groups:
        counts[pos] = c
    edge_pos = torch.cat([torch.repeat_interleave(pos, c) for pos, c, _ in groups])
    perm = torch.argsort(edge_pos, stable=True)
    return counts, torch.cat([src for _, _, src in groups])[perm]


class PartitionStore:
    """Owned nodes are global ids ``[start, end)``; local id = global id - start. Halo nodes
    (other parts' nodes whose complete in-edge lists and features this part also stores) are
    served locally too; :meth:`is_local` says which nodes this store can answer for."""

    def __init__(self, root: str, part_id: int, seed: int = 0):
        self.dgl = import_dgl()
        self.part: Partition = load_partition(root, part_id)
        self.meta = self.part.meta
        self.part_id = part_id
        self.start = self.meta.node_offsets[part_id]
        self.end = self.meta.node_offsets[part_id + 1]
        self.node_offsets = torch.tensor(self.meta.node_offsets, dtype=torch.int64)
        self.graph = self._sampling_graph(self.part.indptr, self.part.indices)
        self.feat = _as_tensor(self.part.feat)
        self.label = _as_tensor(self.part.label)
        p = self.part
        self.has_halo = p.halo_nodes is not None and len(p.halo_nodes) > 0
        if self.has_halo:
            self.halo_nodes = _as_tensor(np.ascontiguousarray(p.halo_nodes))
            self.halo_graph = self._sampling_graph(p.halo_indptr, p.halo_indices)
            self.halo_feat = _as_tensor(p.halo_feat)
            self.halo_label = _as_tensor(p.halo_label)
        self.typed = self.meta.is_typed
        if self.typed:  # see the module docstring
            self.node_type = _as_tensor(load_node_type(root))  # type: ignore[arg-type]
            self.num_etypes = len(self.meta.etypes)
            self._etype = {id(self.graph): p.etype}
            if self.has_halo:
                self._etype[id(self.halo_graph)] = p.halo_etype
        self.dgl.seed(seed)

    def _sampling_graph(self, indptr: np.ndarray, indices: np.ndarray):
        """A bipartite DGL graph: all N global ids as sources -> the listed nodes as dst."""
        graph = self.dgl.heterograph(
            {("src", "e", "dst"): ("csc", (_as_tensor(indptr), _as_tensor(indices),
                                           torch.empty(0, dtype=torch.int64)))},
            num_nodes_dict={"src": self.meta.num_nodes, "dst": len(indptr) - 1},
        )
        self._indptr = getattr(self, "_indptr", {})
        self._indptr[id(graph)] = _as_tensor(indptr)
        self._csc = getattr(self, "_csc", {})
        self._csc[id(graph)] = (indptr, indices)  # the seeded sampler reads these
        return graph

    def all_owned(self, gids: Tensor) -> bool:
        """Whether every one of ``gids`` (non-empty) is owned here, with no halo to consult.
        (:func:`~common.structs.id_bounds`: numpy's min and max, a quarter of the time of
        torch's on a hop's 10^5 ids; this runs several times a hop.)"""
        if self.has_halo or gids.numel() == 0:
            return False
        lo, hi = id_bounds(gids)
        return lo >= self.start and hi < self.end

    def owner_of(self, gids: Tensor) -> Tensor:
        return torch.searchsorted(self.node_offsets, gids, right=True) - 1

    def _owned_mask(self, gids: Tensor) -> Tensor:
        return (gids >= self.start) & (gids < self.end)

    def _halo_pos(self, gids: Tensor) -> tuple[Tensor, Tensor]:
        """(mask of gids that are halo nodes, their positions in halo_nodes)."""
        if not self.has_halo:
            return torch.zeros_like(gids, dtype=torch.bool), torch.zeros_like(gids)
        pos = torch.searchsorted(self.halo_nodes, gids).clamp(max=self.halo_nodes.numel() - 1)
        return self.halo_nodes[pos] == gids, pos

    def is_local(self, gids: Tensor) -> Tensor:
        """Which nodes this store holds (owned or halo)."""
        mask = self._owned_mask(gids)
        if self.has_halo:
            mask |= self._halo_pos(gids)[0]
        return mask

    def _split_local(self, gids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Positions and local ids of owned nodes, then of halo nodes; error if any is
        neither."""
        owned = self._owned_mask(gids)
        halo, hpos = self._halo_pos(gids)
        halo &= ~owned
        if not bool((owned | halo).all()):
            bad = gids[~(owned | halo)][:5].tolist()
            raise BadRequestError(f"part {self.part_id} does not hold nodes {bad}... (it owns global "
                             f"ids [{self.start}, {self.end}) plus its halo)")
        own_pos = torch.nonzero(owned).flatten()
        halo_pos = torch.nonzero(halo).flatten()
        return own_pos, gids[own_pos] - self.start, halo_pos, hpos[halo_pos]

    def node_types(self, gids: Tensor) -> Tensor:
        """Node type (position in the set's ntypes, int8) of each global id (typed sets)."""
        return self.node_type.index_select(0, gids)

    def _sample(self, graph, local: Tensor, fanout: int, seed: int = -1, etype: int = -1
                ) -> tuple[Tensor, Tensor]:
        if local.numel() == 0:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        if etype >= 0:
            indptr, indices = self._csc[id(graph)]
            start, deg = relation_runs(indptr, self._etype[id(graph)], local.numpy(), etype)
            return sample_runs(start, deg, indices, fanout, seed)
        if seed >= 0:
            return sample_csc(*self._csc[id(graph)], local, fanout, seed)
        sg = self.dgl.sampling.sample_neighbors(graph, {"dst": local}, fanout)
        src, dst = sg.edges()
        # DGL returns each node's edges together, in the order of ``local``, and exactly
        # min(in-degree, fanout) of them: check that cheaply (O(edges)) and skip the sort.
        counts = self._expected_counts(graph, local, fanout)
        if int(counts.sum()) == dst.numel() and torch.equal(
                dst, torch.repeat_interleave(local, counts, output_size=dst.numel())):
            return counts, src
        # Otherwise group the edges by destination, in the order of ``local`` (unique ids).
        order = torch.argsort(local)
        pos = order[torch.searchsorted(local[order], dst)]
        counts = torch.bincount(pos, minlength=local.numel())
        perm = torch.argsort(pos, stable=True)
        return counts, src[perm]

    def _expected_counts(self, graph, local: Tensor, fanout: int) -> Tensor:
        indptr = self._indptr[id(graph)]
        deg = indptr.index_select(0, local + 1) - indptr.index_select(0, local)
        return deg if fanout == -1 else deg.clamp(max=fanout)

    def check_etype(self, etype: int) -> None:
        """A relation id this set has (or -1: all in-edges); else a clear error."""
        if etype == -1:
            return
        if not self.typed:
            raise BadRequestError(
                f"etype {etype} asked for, but partition set {self.meta.set_id} "
                f"({self.meta.dataset}) is homogeneous: send etype -1")
        if not 0 <= etype < self.num_etypes:
            raise BadRequestError(
                f"etype {etype} is not a relation id of partition set {self.meta.dataset}: it "
                f"has {self.num_etypes} relations (0..{self.num_etypes - 1}: "
                f"{self.meta.etypes})")

    def sample_neighbors(self, nodes: Tensor, fanout: int, seed: int = -1, etype: int = -1
                         ) -> tuple[Tensor, Tensor]:
        """Uniformly sample up to ``fanout`` in-neighbours (without replacement; -1: all) of
        each node in ``nodes`` (unique global ids, each owned or in the halo); with ``etype``
        >= 0 (typed sets) only through relation ``etype``.

        Returns ``(counts, src)``: ``counts[i]`` = min(in-degree, fanout) and the sampled
        sources (global ids) of ``nodes[i]`` concatenated in the order of ``nodes``.
        ``seed`` >= 0: the sample is a function of (nodes, fanout, seed, etype), the same in
        every thread, process and replica; -1: DGL's sampler with this process's random
        stream (one relation: a fresh random seed, see the module docstring).
        """
        self.check_etype(etype)
        if etype >= 0 and seed < 0:
            seed = secrets.randbits(63)
        if self.all_owned(nodes):
            return self._sample(self.graph, nodes - self.start, fanout, seed, etype)
        own_pos, own_local, halo_pos, halo_local = self._split_local(nodes)
        if halo_pos.numel() == 0:
            return self._sample(self.graph, own_local, fanout, seed, etype)
        halo_seed = derive_seed(seed, 1) if seed >= 0 else -1  # its own stream
        return merge_neighbors(nodes.numel(), [
            (own_pos, *self._sample(self.graph, own_local, fanout, seed, etype)),
            (halo_pos, *self._sample(self.halo_graph, halo_local, fanout, halo_seed, etype))])

    def gather(self, nodes: Tensor, with_feat: bool, with_label: bool,
               out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Features and labels of held nodes, rows in the order of ``nodes`` (empty tensors
        where not asked for). ``out`` (feature dtype, one row per node): write the features
        there (e.g. a trainer's shared-memory slot) instead of a new tensor."""
        if out is not None and out.dtype != self.feat.dtype:
            feat, label = self.gather(nodes, with_feat, with_label)
            out.copy_(feat)  # the conversion (fp16/bf16 transfer) is this one copy
            return out, label
        if self.all_owned(nodes):
            local = nodes - self.start  # fast path: all owned
            if not with_feat:
                feat = self.feat.new_empty((0, self.feat.shape[1]))
            elif out is not None:
                feat = self._copy_rows(local, out)
            else:
                feat = self.feat.index_select(0, local)
            label = (self.label.index_select(0, local) if with_label
                     else self.empty_label(0))
            return feat, label
        own_pos, own_local, halo_pos, halo_local = self._split_local(nodes)
        n = nodes.numel()
        feat = (out if out is not None and with_feat else
                torch.empty((n if with_feat else 0, self.feat.shape[1]), dtype=self.feat.dtype))
        label = self.empty_label(n if with_label else 0)
        if halo_pos.numel() == 0:
            if with_feat:
                torch.index_select(self.feat, 0, own_local, out=feat)
            if with_label:
                torch.index_select(self.label, 0, own_local, out=label)
            return feat, label
        if with_feat:
            feat[own_pos] = self.feat.index_select(0, own_local)
            feat[halo_pos] = self.halo_feat.index_select(0, halo_local)
        if with_label:
            label[own_pos] = self.label.index_select(0, own_local)
            label[halo_pos] = self.halo_label.index_select(0, halo_local)
        return feat, label

    def _copy_rows(self, local: Tensor, out: Tensor) -> Tensor:
        """``index_select(self.feat, 0, local, out=out)``; by the native kernel (the next rows
        fetched ahead, and non-temporal stores for a reply of ``STREAM_MIN_BYTES`` or more)
        where it is loaded and both matrices are plain contiguous rows of one dtype."""
        lib = native.load()
        f = self.feat
        if (lib is None or not f.is_contiguous() or not out.is_contiguous()
                or out.dtype != f.dtype or f.dim() != 2 or out.dim() != 2
                or out.shape[0] != local.numel() or out.shape[1] != f.shape[1]):
            return torch.index_select(f, 0, local, out=out)
        ids = local.to(torch.int64).contiguous()
        row_bytes = f.shape[1] * f.element_size()
        got = lib.mfg_copy_rows(f.data_ptr(), row_bytes, f.shape[0], ids.data_ptr(), ids.numel(),
                                out.data_ptr(), int(ids.numel() * row_bytes >= STREAM_MIN_BYTES))
        if got != ids.numel():
            raise IndexError(f"feature gather: a node outside this part's {f.shape[0]} rows")
        return out

    def empty_label(self, n: int) -> Tensor:
        """An uninitialised label tensor for ``n`` nodes, of the part's label dtype and row
        shape: int64 ``[n]`` (multiclass) or float32 ``[n, num_tasks]`` (binary tasks)."""
        return torch.empty((n, *self.label.shape[1:]), dtype=self.label.dtype)

    def seeds(self, split: str) -> Tensor:
        return _as_tensor(np.ascontiguousarray(getattr(self.part, split)))
