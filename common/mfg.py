"""The trainer's view of a sampled MFG: DGL's "blocks" in plain torch, on any device.

An :class:`MFG` is a list of :class:`Block` s, input layer first, built from the sampler's
output (:class:`~common.sampled_mfg.SampledMFG`, whose ``check()`` states and enforces the
invariants: destinations first among sources, ids as prefixes of ``input_nodes``, CSC
consistency) by :meth:`MFG.of`, which shares its tensors (no copy). Block l's source ids are
``srcdata[NID]`` (``input_nodes[:num_src]``), its destination ids ``dstdata[NID]``;
``output_nodes`` (the seeds) are the last block's destinations.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from common import native
from common.sampled_mfg import FEAT_FRAMES, SampledMFG

NID = "_ID"  # the same key DGL uses for node ids in srcdata/dstdata


def owners(ids: Tensor, offsets: Sequence[int], base: Sequence[int] | None = None,
           with_part: bool = True) -> tuple[Tensor | None, Tensor]:
    """Each global node id's part ``p`` (``offsets[p] <= id < offsets[p + 1]``; ``offsets``
    rising from 0) and its row there, ``id - offsets[p]``, plus ``base[p]`` where given
    (common/joined_rows.py: each part's first row in one matrix over them all); ``(None,
    rows)`` without ``with_part``. One native pass on the CPU (common/native.c
    ``mfg_owners``), else torch's comparisons (a few parts) or ``searchsorted``. ValueError
    for an id outside ``[0, offsets[-1])``."""
    offsets = [int(o) for o in offsets]
    num_parts = len(offsets) - 1
    lib = native.load() if ids.device.type == "cpu" and ids.dtype == torch.int64 else None
    if lib is not None:
        ids = ids.contiguous()
        bounds = torch.tensor(offsets, dtype=torch.int64)
        at = None if base is None else torch.tensor(list(base), dtype=torch.int64)
        part = torch.empty_like(ids) if with_part else None
        rows = torch.empty_like(ids)
        if lib.mfg_owners(bounds.data_ptr(), num_parts, None if at is None else at.data_ptr(),
                          ids.data_ptr(), ids.numel(), None if part is None else part.data_ptr(),
                          rows.data_ptr()) < 0:
            raise ValueError(f"node ids outside the parts' [0, {offsets[-1]}) or node "
                             f"offsets {offsets} not rising from 0")
        return part, rows
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= offsets[-1]):
        raise ValueError(f"node ids outside the parts' [0, {offsets[-1]})")
    if num_parts <= 8:  # a few parts: one comparison pass per boundary
        part = torch.zeros_like(ids)
        for bound in offsets[1:-1]:
            part += ids >= bound
    else:
        part = torch.searchsorted(torch.tensor(offsets[1:-1], dtype=ids.dtype,
                                               device=ids.device), ids, right=True)
    shift = torch.tensor(offsets[:-1], dtype=ids.dtype, device=ids.device)
    if base is not None:
        shift = shift - torch.tensor(list(base), dtype=ids.dtype, device=ids.device)
    return (part if with_part else None), ids - shift.index_select(0, part)


class SourceRows:
    """Input features not gathered yet: source node i's row is read from the partition
    set's feature matrices, ``matrices[p][ids[i] - offsets[p]]`` for the part ``p`` that owns
    global id ``ids[i]`` (one part: ``matrix[ids[i]]``).

    A CPU trainer on the host that holds the partition files reads them from the parts'
    memory-mapped feature matrices (``--local-features``, trainer_client/local_features.py)
    instead of a copy the server gathered for it. :class:`~trainer_client.model.SAGEConv`
    reads these rows inside its mean (one pass over the matrices, no ``[num_src, dim]``
    copy); anything else takes :meth:`gather`'s copy, the same rows a server would have
    sent."""

    def __init__(self, matrices: Tensor | Sequence[Tensor], ids: Tensor,
                 offsets: Sequence[int] | None = None):
        self.matrices = [matrices] if isinstance(matrices, Tensor) else list(matrices)
        if offsets is None:
            if len(self.matrices) != 1:
                raise ValueError("several parts' matrices need their node offsets")
            offsets = [0, self.matrices[0].shape[0]]
        if len(offsets) != len(self.matrices) + 1:
            raise ValueError(f"{len(self.matrices)} matrices need {len(self.matrices) + 1} "
                             f"node offsets, got {len(offsets)}")
        self.offsets = [int(o) for o in offsets]
        self.ids = ids
        self._split: tuple[Tensor, Tensor] | None = None

    @property
    def matrix(self) -> Tensor:
        """The one part's matrix (a one-part set)."""
        if len(self.matrices) != 1:
            raise ValueError(f"{len(self.matrices)} parts' rows: no single matrix")
        return self.matrices[0]

    @property
    def num_parts(self) -> int:
        return len(self.matrices)

    def owners(self) -> tuple[Tensor, Tensor]:
        """``(part, local row)`` of each source (int64 each; computed once; :func:`owners`)."""
        if self._split is None:
            part, local = owners(self.ids, self.offsets)
            assert part is not None  # (asked for)
            self._split = part, local
        return self._split

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.ids.numel(), self.matrices[0].shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.matrices[0].dtype

    @property
    def device(self) -> torch.device:
        return self.matrices[0].device

    requires_grad = False

    def dim(self) -> int:
        return 2

    def gather(self, n: int | None = None) -> Tensor:
        """The first ``n`` (default all) sources' rows as one tensor."""
        ids = self.ids if n is None else self.ids[:n]
        if len(self.matrices) == 1:
            return self.matrices[0].index_select(0, ids)
        part, local = (t[:ids.numel()] for t in self.owners())
        out = self.matrices[0].new_empty((ids.numel(), self.shape[1]))
        if self._copy_native(part, local, out):
            return out
        for p, m in enumerate(self.matrices):
            at = (part == p).nonzero().squeeze(1)
            if at.numel():
                out.index_copy_(0, at, m.index_select(0, local.index_select(0, at)))
        return out

    def _copy_native(self, part: Tensor, local: Tensor, out: Tensor) -> bool:
        """:meth:`gather`'s rows of several parts in one pass (common/native.c
        ``mfg_copy_part_rows``); False where that does not apply (not on the CPU, the library
        not loaded, a matrix not contiguous or not of the output's dtype and width)."""
        if out.device.type != "cpu" or not all(
                m.is_contiguous() and m.dtype == out.dtype and m.shape[1:] == out.shape[1:]
                for m in self.matrices):
            return False
        lib = native.load()
        if lib is None:
            return False
        bases = torch.tensor([m.data_ptr() for m in self.matrices], dtype=torch.int64)
        num_rows = torch.tensor([m.shape[0] for m in self.matrices], dtype=torch.int64)
        part, local = part.contiguous(), local.contiguous()
        got = lib.mfg_copy_part_rows(bases.data_ptr(), num_rows.data_ptr(), len(self.matrices),
                                     out.stride(0) * out.element_size(), part.data_ptr(),
                                     local.data_ptr(), part.numel(), out.data_ptr())
        if got < 0:
            raise ValueError(f"rows outside their parts' matrices ({num_rows.tolist()} rows)")
        return True

    def float(self) -> SourceRows | Tensor:
        return self if self.dtype == torch.float32 else self.gather().float()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SourceRows | Tensor:
        if torch.device(device) == self.device:
            return self
        return self.gather().to(device, non_blocking=non_blocking)

    def pin_memory(self) -> Tensor:
        return self.gather().pin_memory()

    def __repr__(self) -> str:
        return (f"SourceRows({self.ids.numel()} of {self.offsets[-1]} rows in "
                f"{len(self.matrices)} part(s), dim {self.shape[1]})")


def count_index(index: Tensor, n: int) -> Tensor:
    """How often each of ``0..n-1`` occurs in ``index`` (int64). ``torch.bincount`` on CUDA
    reads the maximum back to the host (the host waits for the device); a scatter-add there
    does not."""
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=n)
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(
        0, index, torch.ones_like(index, dtype=torch.int64))


class Block:
    """One layer of an MFG: a bipartite CSC graph from source to destination nodes."""

    def __init__(self, indptr: Tensor, indices: Tensor, num_src: int, num_dst: int):
        self.indptr = indptr
        self.indices = indices
        self._num_src = int(num_src)
        self._num_dst = int(num_dst)
        self.srcdata: dict[str, Tensor] = {}
        self.dstdata: dict[str, Tensor] = {}
        self._dst_index: Tensor | None = None
        self._mean_w: Tensor | None = None
        self._mean_t: tuple[Tensor, Tensor, Tensor] | None = None

    def num_src_nodes(self) -> int:
        return self._num_src

    def num_dst_nodes(self) -> int:
        return self._num_dst

    def num_edges(self) -> int:
        return int(self.indices.numel())

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def in_degrees(self) -> Tensor:
        return self.indptr[1:] - self.indptr[:-1]

    def dst_index(self) -> Tensor:
        """Destination position of every edge (CSC expanded), cached per device."""
        if self._dst_index is None or self._dst_index.device != self.indices.device:
            self._dst_index = torch.repeat_interleave(
                torch.arange(self._num_dst, device=self.indptr.device), self.in_degrees(),
                output_size=self.num_edges())
        return self._dst_index

    def mean_bags(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
        """The mean over each destination's sampled in-neighbours as weighted bags:
        ``(indices, offsets, weights)`` for ``F.embedding_bag(indices, h_src, offsets,
        mode="sum", per_sample_weights=weights, include_last_offset=True)``: bag i is
        destination i's in-edges (the CSC as is), each weighted 1 / in_degree(i), so an
        empty bag gives 0. Built once per block, device and dtype."""
        w = self._mean_w
        if w is None or w.device != self.indices.device or w.dtype != dtype:
            deg = self.in_degrees()
            w = torch.repeat_interleave(1.0 / deg.clamp(min=1).to(dtype), deg,
                                        output_size=self.num_edges())
            self._mean_w = w
        return self.indices, self.indptr, w

    def mean_bags_t(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
        """The transpose of :meth:`mean_bags` (bag j: source j's out-edges, indexing
        destinations, same weights): the backward of the mean w.r.t. the sources."""
        t = self._mean_t
        if t is None or t[0].device != self.indices.device or t[2].dtype != dtype:
            _, _, w = self.mean_bags(dtype)
            t = self._transpose_native(w)
            if t is None:
                order = torch.argsort(self.indices, stable=True)
                counts = count_index(self.indices, self._num_src)
                offsets = torch.zeros(self._num_src + 1, dtype=self.indptr.dtype,
                                      device=self.indptr.device)
                torch.cumsum(counts, 0, out=offsets[1:])
                t = (self.dst_index()[order], offsets, w[order])
            self._mean_t = t
        return t

    def _transpose_native(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """:meth:`mean_bags_t` by common/native.c's ``mfg_transpose_csc`` (one counting pass
        and one scatter; the same bags, edges and weights as the stable argsort, in the same
        order) for a CPU block with int64 CSC and float32 weights where the library is
        loaded; None elsewhere."""
        ip, ix = self.indptr, self.indices
        if (ix.device.type != "cpu" or w.dtype != torch.float32 or ip.dtype != torch.int64
                or ix.dtype != torch.int64 or not (ip.is_contiguous() and ix.is_contiguous()
                                                   and w.is_contiguous())):
            return None
        lib = native.load()
        if lib is None:
            return None
        offsets = torch.empty(self._num_src + 1, dtype=torch.int64)
        dst = torch.empty(ix.numel(), dtype=torch.int64)
        w_t = torch.empty(ix.numel(), dtype=torch.float32)
        got = lib.mfg_transpose_csc(ip.data_ptr(), self._num_dst, ix.data_ptr(), ix.numel(),
                                    self._num_src, w.data_ptr(), offsets.data_ptr(),
                                    dst.data_ptr(), w_t.data_ptr())
        if got == native.NO_MEMORY:
            raise MemoryError(f"mean_bags_t: no memory for {self._num_src} cursors")
        if got < 0:
            raise ValueError(f"mean_bags_t: the block's CSC is not {self._num_dst} rows "
                             f"rising from 0 to {ix.numel()} edges of sources in "
                             f"[0, {self._num_src})")
        return dst, offsets, w_t

    def edges(self) -> tuple[Tensor, Tensor]:
        """(source positions, destination positions) of every edge."""
        return self.indices, self.dst_index()

    def _apply(self, fn) -> Block:
        out = Block(fn(self.indptr), fn(self.indices), self._num_src, self._num_dst)
        out.srcdata = {k: fn(v) for k, v in self.srcdata.items()}
        out.dstdata = {k: fn(v) for k, v in self.dstdata.items()}
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Block:
        return self._apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Block:
        return self._apply(lambda t: t.pin_memory())

    def to_dgl(self):
        """This block as a DGL block (``dgl.create_block``), with srcdata/dstdata copied."""
        from common.dgl_compat import import_dgl

        dgl = import_dgl()
        # Explicit edge ids (CSC order): with none, DGL's CPU backward of an op reading edge
        # data (GATConv's u_mul_e) fails ("Check notnull: edges" in its libxsmm SpMM).
        eids = torch.arange(self.num_edges(), device=self.indices.device)
        blk = dgl.create_block(("csc", (self.indptr, self.indices, eids)),
                               num_src_nodes=self._num_src, num_dst_nodes=self._num_dst)
        # Node data only: a tensor with one row per node (an inference block carries an
        # empty label tensor, no labels being served; DGL refuses a row count that differs).
        for frame, data, n in ((blk.srcdata, self.srcdata, self._num_src),
                               (blk.dstdata, self.dstdata, self._num_dst)):
            for k, v in data.items():
                if isinstance(v, SourceRows):
                    v = v.gather()
                if v.dim() > 0 and v.shape[0] == n:
                    frame[k] = v
        return blk

    def __repr__(self) -> str:
        return (f"Block(num_src_nodes={self._num_src}, num_dst_nodes={self._num_dst}, "
                f"num_edges={self.num_edges()})")


class MFG(Sequence[Block]):
    """The blocks of one mini-batch (input layer first) plus its node id lists."""

    def __init__(self, blocks: list[Block], input_nodes: Tensor, output_nodes: Tensor):
        self.blocks = blocks
        self.input_nodes = input_nodes
        self.output_nodes = output_nodes

    @classmethod
    def of(cls, sampled: SampledMFG, feat: Tensor | None = None) -> MFG:
        """The blocks of a (homogeneous) sampled MFG, sharing its tensors. ``feat``: the
        input features (``blocks[0].srcdata["feat"]``); by default the rows that came in
        frames, if all of them did. Labels go to ``blocks[-1].dstdata["label"]``."""
        nodes = sampled.only
        if any(len(layer.rels) != 1 for layer in sampled.layers):
            raise ValueError("an MFG of several relations is heterogeneous; Block holds one")
        ids = nodes.ids
        blocks = []
        for layer in sampled.layers:
            (rel,), ns, nd = layer.rels, layer.num_src[0], layer.num_dst[0]
            b = Block(rel.indptr, rel.indices, ns, nd)
            b.srcdata[NID] = ids[:ns]
            b.dstdata[NID] = ids[:nd]
            blocks.append(b)
        f = nodes.feat
        if feat is None and f.via == FEAT_FRAMES and not f.present.numel():
            feat = f.rows
        if feat is not None:
            blocks[0].srcdata["feat"] = feat
        blocks[-1].dstdata["label"] = nodes.label
        return cls(blocks, ids, sampled.output_nodes)

    def __getitem__(self, i):  # type: ignore[override]
        return self.blocks[i]

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    def _apply(self, fn) -> MFG:
        return MFG([fn(b) for b in self.blocks], self.input_nodes, self.output_nodes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MFG:
        out = self._apply(lambda b: b.to(device, non_blocking))
        out.input_nodes = self.input_nodes.to(device, non_blocking=non_blocking)
        out.output_nodes = self.output_nodes.to(device, non_blocking=non_blocking)
        return out

    def pin_memory(self) -> MFG:
        out = self._apply(lambda b: b.pin_memory())
        out.input_nodes = self.input_nodes.pin_memory()
        out.output_nodes = self.output_nodes.pin_memory()
        return out

    def to_dgl(self) -> list:
        """The blocks as a list of DGL blocks, usable with dgl.nn modules."""
        return [b.to_dgl() for b in self.blocks]

    def __repr__(self) -> str:
        return f"MFG({self.blocks}, input_nodes={self.input_nodes.numel()})"


# --- typed (heterogeneous) MFGs -------------------------------------------------------------

#: A relation's canonical name: (source node type, edge type, destination node type).
CanonicalEtype = tuple[str, str, str]

#: The names DGL gives the one node / edge type of a homogeneous graph: :meth:`HeteroBlock.to_dgl`
#: uses them for the ``""`` of a homogeneous SampledMFG (DGL modules key their per-relation
#: submodules by name, and a torch module name cannot be empty).
DGL_NTYPE, DGL_ETYPE = "_N", "_E"


def _dgl_name(name: str, default: str) -> str:
    return name or default


class HeteroBlock:
    """One layer of a typed MFG: per node type its source / destination counts (and ids, in
    ``srcdata[ntype][NID]`` / ``dstdata[ntype][NID]``), and per relation one :class:`Block`
    (CSC over that relation's destinations, indices = positions among its source type's
    sources) keyed by the canonical name ``(src_type, etype, dst_type)``."""

    def __init__(self, ntypes: list[str], num_src: dict[str, int], num_dst: dict[str, int],
                 rels: dict[CanonicalEtype, Block]):
        self.ntypes = list(ntypes)
        self.num_src = {t: int(num_src[t]) for t in self.ntypes}
        self.num_dst = {t: int(num_dst[t]) for t in self.ntypes}
        self.rels = rels
        self.srcdata: dict[str, dict[str, Tensor]] = {t: {} for t in self.ntypes}
        self.dstdata: dict[str, dict[str, Tensor]] = {t: {} for t in self.ntypes}

    @property
    def canonical_etypes(self) -> list[CanonicalEtype]:
        return list(self.rels)

    def _one_type(self, ntype: str | None) -> str:
        if ntype is not None:
            return ntype
        if len(self.ntypes) != 1:
            raise ValueError(f"this block has node types {self.ntypes}: name one")
        return self.ntypes[0]

    def num_src_nodes(self, ntype: str | None = None) -> int:
        return self.num_src[self._one_type(ntype)]

    def num_dst_nodes(self, ntype: str | None = None) -> int:
        return self.num_dst[self._one_type(ntype)]

    def num_edges(self, rel: CanonicalEtype | None = None) -> int:
        if rel is not None:
            return self.rels[rel].num_edges()
        return sum(b.num_edges() for b in self.rels.values())

    def _apply(self, fn) -> HeteroBlock:
        out = HeteroBlock(self.ntypes, self.num_src, self.num_dst,
                          {k: b._apply(fn) for k, b in self.rels.items()})
        out.srcdata = {t: {k: fn(v) for k, v in d.items()} for t, d in self.srcdata.items()}
        out.dstdata = {t: {k: fn(v) for k, v in d.items()} for t, d in self.dstdata.items()}
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> HeteroBlock:
        return self._apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> HeteroBlock:
        return self._apply(lambda t: t.pin_memory())

    def to_dgl(self):
        """This layer as a DGL heterograph block (``dgl.create_block`` with one CSC per
        canonical relation and per-type node counts), node data copied per type; usable with
        ``dgl.nn.HeteroGraphConv``. A homogeneous MFG's ``""`` names become DGL's default
        ``"_N"`` / ``"_E"``."""
        from common.dgl_compat import import_dgl

        dgl = import_dgl()
        data = {}
        for (s, e, d), b in self.rels.items():
            # explicit edge ids, as Block.to_dgl (DGL's CPU backward of edge-data ops)
            eids = torch.arange(b.num_edges(), device=b.indices.device)
            key = (_dgl_name(s, DGL_NTYPE), _dgl_name(e, DGL_ETYPE), _dgl_name(d, DGL_NTYPE))
            data[key] = ("csc", (b.indptr, b.indices, eids))
        names = {t: _dgl_name(t, DGL_NTYPE) for t in self.ntypes}
        blk = dgl.create_block(data, num_src_nodes={names[t]: n for t, n in self.num_src.items()},
                               num_dst_nodes={names[t]: n for t, n in self.num_dst.items()})
        for side, ours, counts in ((blk.srcnodes, self.srcdata, self.num_src),
                                   (blk.dstnodes, self.dstdata, self.num_dst)):
            for t, frame in ours.items():
                for k, v in frame.items():  # node data only: one row per node of the type
                    if v.dim() > 0 and v.shape[0] == counts[t]:
                        side[names[t]].data[k] = v
        return blk

    def __repr__(self) -> str:
        return (f"HeteroBlock(num_src_nodes={self.num_src}, num_dst_nodes={self.num_dst}, "
                f"num_edges={ {k: b.num_edges() for k, b in self.rels.items()} })")


class HeteroMFG(Sequence[HeteroBlock]):
    """The typed blocks of one mini-batch (input layer first), its input node ids per node
    type (``input_nodes[ntype]``), and its output nodes (seeds), all of ``seed_ntype``.

    Built by :meth:`of` from any :class:`~common.sampled_mfg.SampledMFG`, typed or not (a
    homogeneous one is the one-type case: node type ``""``, relation ``("", "", "")``), so one
    code path takes both. Input features per type are ``feat[ntype]`` (also
    ``blocks[0].srcdata[ntype]["feat"]``), the seeds' labels ``label`` (also
    ``blocks[-1].dstdata[seed_ntype]["label"]``)."""

    def __init__(self, blocks: list[HeteroBlock], input_nodes: dict[str, Tensor],
                 seed_ntype: str, output_nodes: Tensor):
        self.blocks = blocks
        self.input_nodes = input_nodes
        self.seed_ntype = seed_ntype
        self.output_nodes = output_nodes

    @property
    def ntypes(self) -> list[str]:
        return list(self.input_nodes)

    @property
    def feat(self) -> dict[str, Tensor]:
        return {t: d["feat"] for t, d in self.blocks[0].srcdata.items() if "feat" in d}

    @property
    def label(self) -> Tensor | None:
        return self.blocks[-1].dstdata[self.seed_ntype].get("label")

    @classmethod
    def of(cls, sampled: SampledMFG, feat: dict[str, Tensor] | None = None,
           seed_ntype: str | None = None) -> HeteroMFG:
        """The typed blocks of ``sampled``, sharing its tensors (``sampled.check()`` holds
        its invariants). ``feat``: input features per node type (by default the rows that
        came in frames, for each type all of whose rows did). ``seed_ntype``: the type of the
        output nodes; by default the only node type, or else the one type with output nodes
        (a type must be named when several have some, or none does)."""
        names = [ns.ntype for ns in sampled.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node type names must be unique in an MFG, got {names}")
        last = sampled.layers[-1].num_dst
        if seed_ntype is None and len(names) == 1:
            seed_ntype = names[0]
        if seed_ntype is None:
            with_out = [t for t, n in zip(names, last) if n > 0]
            if len(with_out) != 1:
                raise ValueError(f"cannot tell the seed node type: node types {with_out} have "
                                 "output nodes; pass seed_ntype")
            seed_ntype = with_out[0]
        if seed_ntype not in names:
            raise ValueError(f"seed node type {seed_ntype!r} is not in this MFG's node types "
                             f"{names}")
        blocks = []
        for layer in sampled.layers:
            rels = {}
            for r in layer.rels:
                key = (names[r.src_type], r.etype, names[r.dst_type])
                rels[key] = Block(r.indptr, r.indices, layer.num_src[r.src_type],
                                  layer.num_dst[r.dst_type])
            hb = HeteroBlock(names, dict(zip(names, layer.num_src)),
                             dict(zip(names, layer.num_dst)), rels)
            for t, ns in zip(names, sampled.nodes):
                hb.srcdata[t][NID] = ns.ids[:hb.num_src[t]]
                hb.dstdata[t][NID] = ns.ids[:hb.num_dst[t]]
            blocks.append(hb)
        feats = dict(feat) if feat is not None else {}
        if feat is None:
            for t, ns in zip(names, sampled.nodes):
                f = ns.feat
                if f.via == FEAT_FRAMES and not f.present.numel():
                    feats[t] = f.rows
        for t, x in feats.items():
            if t not in blocks[0].srcdata:
                raise ValueError(f"features given for node type {t!r}, which this MFG does "
                                 f"not have (node types {names})")
            blocks[0].srcdata[t]["feat"] = x
        seed = names.index(seed_ntype)
        blocks[-1].dstdata[seed_ntype]["label"] = sampled.nodes[seed].label
        ids = {t: ns.ids for t, ns in zip(names, sampled.nodes)}
        return cls(blocks, ids, seed_ntype, ids[seed_ntype][:last[seed]])

    def __getitem__(self, i):  # type: ignore[override]
        return self.blocks[i]

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[HeteroBlock]:
        return iter(self.blocks)

    def _apply(self, fn) -> HeteroMFG:
        return HeteroMFG([b._apply(fn) for b in self.blocks],
                         {t: fn(v) for t, v in self.input_nodes.items()}, self.seed_ntype,
                         fn(self.output_nodes))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> HeteroMFG:
        return self._apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> HeteroMFG:
        return self._apply(lambda t: t.pin_memory())

    def to_dgl(self) -> list:
        """The blocks as DGL heterograph blocks (see :meth:`HeteroBlock.to_dgl`)."""
        return [b.to_dgl() for b in self.blocks]

    def __repr__(self) -> str:
        return (f"HeteroMFG({self.blocks}, input_nodes="
                f"{ {t: v.numel() for t, v in self.input_nodes.items()} }, "
                f"seed_ntype={self.seed_ntype!r})")


# --- copying an MFG to a device ---------------------------------------------------------------


def mfg_tensors(mfg: MFG | HeteroMFG) -> list[Tensor]:
    """Every tensor an MFG holds (ids, per-block CSC, src/dst data)."""
    if isinstance(mfg, HeteroMFG):
        out = [*mfg.input_nodes.values(), mfg.output_nodes]
        for hb in mfg.blocks:
            for b in hb.rels.values():
                out += [b.indptr, b.indices]
            for side in (hb.srcdata, hb.dstdata):
                out += [v for d in side.values() for v in d.values()]
        return out
    out = [mfg.input_nodes, mfg.output_nodes]
    for b in mfg.blocks:
        out += [b.indptr, b.indices, *b.srcdata.values(), *b.dstdata.values()]
    return out


def _map_tensors(mfg: MFG | HeteroMFG, fn) -> MFG | HeteroMFG:
    """``mfg`` with ``fn`` applied to every tensor it holds, its node id lists included."""
    if isinstance(mfg, MFG):  # its _apply maps blocks, not tensors
        return MFG([b._apply(fn) for b in mfg.blocks], fn(mfg.input_nodes),
                   fn(mfg.output_nodes))
    return mfg._apply(fn)


def _source_key(t: Tensor) -> tuple:
    """Tensors with the same key are copied once: 1-D contiguous views starting at the same
    address (the blocks' node id slices ``ids[:n]`` of the MFG's ids), else the object."""
    if t.dim() == 1 and t.is_contiguous() and t.numel():
        return (t.data_ptr(), t.dtype, t.device)
    return ("object", id(t))


def to_device(mfg: MFG | HeteroMFG, device: torch.device | str) -> MFG | HeteroMFG:
    """``mfg`` on ``device`` with non-blocking copies on the current stream, none of which
    makes the host wait.

    CUDA copies from pageable memory synchronously: the host waits until the stream reaches
    the copy and finishes it (behind a batch's feature copy, tens to hundreds of MB, nothing
    of that would overlap compute). So for CUDA every pageable source (a block's CSC, the ids,
    the labels: the reply's frames) is first copied into page-locked memory from torch's
    caching host allocator, the same host copy CUDA's own staging makes, and then copied
    without a wait; the features in a trainer's registered ring slot are page-locked already.
    Views that start at the same address are copied once, the longest of them, and sliced on
    the device: the blocks' node id slices of the MFG's ids cost one copy, not one per block
    and side."""
    sources: dict[tuple, Tensor] = {}
    for t in mfg_tensors(mfg):
        k = _source_key(t)
        if k not in sources or t.numel() > sources[k].numel():
            sources[k] = t
    stage = torch.device(device).type == "cuda"
    moved = {k: (t.pin_memory() if stage and t.device.type == "cpu" and not t.is_pinned()
                 else t).to(device, non_blocking=True)
             for k, t in sources.items()}

    def place(t: Tensor) -> Tensor:
        d = moved[_source_key(t)]
        return d if d.numel() == t.numel() else d[: t.numel()]

    return _map_tensors(mfg, place)
