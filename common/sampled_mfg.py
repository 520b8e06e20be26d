"""The sampler's output: one mini-batch's message-flow graph (MFG), as it travels from the
sampler to the trainer, unchanged (a nested struct of the MFG reply; see common.codec).

Node types and relations are explicit, so one type carries homogeneous and heterogeneous
graphs alike (a homogeneous MFG has one node type ``""`` and one relation per layer):

* ``nodes[t]`` (:class:`NodeSet`): the input nodes of node type t (global ids), their
  features (:class:`Features`: how they travel) and the labels of its output nodes.
* ``layers[l]`` (:class:`Layer`, input layer first): per node type the number of source and
  destination nodes, and per relation (src type, edge type, dst type) its CSC.

Invariants, checked by the structs' ``check()`` (the codec runs them on receipt, innermost
first; :meth:`SampledMFG.check` holds the ones across structs):

* Prefix ids, destinations first: layer l's source nodes of type t are
  ``nodes[t].ids[:num_src[t]]``, its destinations ``nodes[t].ids[:num_dst[t]]``
  (``num_dst <= num_src``); layer l+1's sources are layer l's destinations; layer 0's sources
  are all of ``nodes[t].ids``; the output nodes (seeds) are the last layer's destinations.
* CSC: relation r's sampled in-edges of destination i (of its dst type) are
  ``indices[indptr[i]:indptr[i+1]]``, positions among its src type's sources.

Typed MFGs as the sampler servers build them (sampler_server/neighbor_sampler.py
``sample_typed_mfg``): ``nodes`` has one NodeSet per node type of the partition set, in the
set's ``ntypes`` order (a type with no node in this batch has empty ids), and every layer has
one Relation per relation of the set, in relation id order (``etype`` = the relation's name),
empty where nothing was sampled. The seeds are of one node type: that NodeSet's output nodes,
and the only NodeSet with labels. Features travel per NodeSet; with a shared-memory ring slot
all NodeSets share the request's one slot: their rows lie in it one after the other in
node-set order (type 0's ``num_rows`` rows, then type 1's, ...; in the cached mode only each
type's present rows), so NodeSet t's rows start at the sum of the earlier sets' ``num_rows``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.limits import MAX_LAYERS
from common.structs import Struct, check_ids, id_bounds, need, rises

FEAT_NONE, FEAT_FRAMES, FEAT_RING = "none", "frames", "ring"
FEAT_VIA = (FEAT_NONE, FEAT_FRAMES, FEAT_RING)


def _empty(dtype: torch.dtype = torch.int64) -> Tensor:
    return torch.empty(0, dtype=dtype)


@dataclass
class Features(Struct):
    """How one node type's input features travel. ``via``:

    * ``"frames"``: ``rows`` holds them (a tensor on the wire);
    * ``"ring"``: ``num_rows`` rows were written into the request's shared-memory ring slot
      (common.shm_ring); ``rows`` has no rows, its dtype and width describe them;
    * ``"none"``: not asked for.

    ``present`` empty: a row per input node travelled. Otherwise the cached mode: a bool per
    input node, and only the True ones' rows travelled; the trainer's cache holds the others.
    ``slot_error``: why an offered ring slot could not be used ("" if it was, or none offered).
    """

    via: str
    rows: Tensor
    num_rows: int
    present: Tensor = field(default_factory=lambda: _empty(torch.bool))
    slot_error: str = ""

    @classmethod
    def none(cls, dim: int = 0, dtype: torch.dtype = torch.float32) -> Features:
        return cls(FEAT_NONE, torch.empty((0, dim), dtype=dtype), 0)

    @classmethod
    def frames(cls, rows: Tensor, present: Tensor | None = None,
               slot_error: str = "") -> Features:
        return cls(FEAT_FRAMES, rows, int(rows.shape[0]),
                   _empty(torch.bool) if present is None else present, slot_error)

    @classmethod
    def ring(cls, num_rows: int, dim: int, dtype: torch.dtype,
             present: Tensor | None = None) -> Features:
        return cls(FEAT_RING, torch.empty((0, dim), dtype=dtype), num_rows,
                   _empty(torch.bool) if present is None else present)

    @property
    def cached_rows(self) -> int:
        """Rows the trainer's cache supplies (0 unless ``present`` is set)."""
        return self.present.numel() - self.num_rows if self.present.numel() else 0

    def check(self) -> None:
        need(self.via in FEAT_VIA, "bad_mfg", f"features travel via one of {FEAT_VIA}, "
             f"not {self.via!r}")
        need(self.rows.dim() == 2, "bad_mfg", "feature rows must be 2-D")
        shipped = self.num_rows if self.via == FEAT_FRAMES else 0
        need(self.rows.shape[0] == shipped, "bad_mfg",
             f"features via {self.via} must have {shipped} rows in the message, "
             f"not {self.rows.shape[0]}")
        need(self.via != FEAT_NONE or (self.num_rows == 0 and not self.present.numel()),
             "bad_mfg", "features not sent must have no rows and no present-mask")
        p = self.present
        if p.numel():
            need(p.dtype == torch.bool and p.dim() == 1, "bad_mfg",
                 "the present-mask must be 1-D bool")
            need(int(p.sum()) == self.num_rows, "bad_mfg",
                 "features must hold one row per True in the present-mask")


@dataclass
class NodeSet(Struct):
    """One node type's input nodes (global ids, see the module's prefix rule), their
    features, and the labels of its output nodes (empty if not asked for)."""

    ids: Tensor
    feat: Features
    label: Tensor
    ntype: str = ""  # "" in a homogeneous graph

    def check(self) -> None:
        check_ids(self.ids, "input node ids")
        n = self.ids.numel()
        f = self.feat
        if f.present.numel():
            need(f.present.numel() == n, "bad_mfg", "the present-mask needs a bool per input node")
        else:
            need(f.via == FEAT_NONE or f.num_rows == n, "bad_mfg",
                 f"features must have a row per input node ({n}), got {f.num_rows}")


@dataclass
class Relation(Struct):
    """One relation's sampled edges in one layer, as CSC over its destination nodes."""

    indptr: Tensor
    indices: Tensor
    src_type: int = 0  # positions in SampledMFG.nodes
    dst_type: int = 0
    etype: str = ""  # "" in a homogeneous graph

    def check(self) -> None:
        ip, ix = self.indptr, self.indices
        need(ip.dtype == torch.int64 and ip.dim() == 1 and ip.numel() >= 1, "bad_mfg",
             "indptr must be 1-D int64 with at least one entry")
        need(ix.dtype == torch.int64 and ix.dim() == 1, "bad_mfg", "indices must be 1-D int64")
        need(int(ip[0]) == 0 and int(ip[-1]) == ix.numel() and rises(ip),
             "bad_mfg", "indptr must rise from 0 to len(indices)")
        need(self.src_type >= 0 and self.dst_type >= 0, "bad_mfg", "node types must be >= 0")


@dataclass
class Layer(Struct):
    """One layer: per node type its source / destination counts, and one CSC per relation."""

    num_src: list[int]
    num_dst: list[int]
    rels: list[Relation]

    @classmethod
    def homogeneous(cls, num_src: int, num_dst: int, indptr: Tensor, indices: Tensor) -> Layer:
        return cls([num_src], [num_dst], [Relation(indptr, indices)])

    def check(self) -> None:
        types = len(self.num_src)
        need(types == len(self.num_dst) >= 1, "bad_mfg",
             "num_src and num_dst need one count per node type")
        need(all(0 <= d <= s for s, d in zip(self.num_src, self.num_dst)), "bad_mfg",
             "need 0 <= num_dst <= num_src for every node type")
        keys = {(r.src_type, r.etype, r.dst_type) for r in self.rels}
        need(len(keys) == len(self.rels), "bad_mfg", "a relation appears twice in a layer")
        for r in self.rels:
            need(r.src_type < types and r.dst_type < types, "bad_mfg",
                 "a relation names a node type the layer does not have")
            need(r.indptr.numel() == self.num_dst[r.dst_type] + 1, "bad_mfg",
                 "indptr must have num_dst + 1 entries")
            if r.indices.numel():
                lo, hi = id_bounds(r.indices)
                need(lo >= 0 and hi < self.num_src[r.src_type], "bad_mfg",
                     "indices outside [0, num_src)")


@dataclass
class SampledMFG(Struct):
    """A sampled mini-batch: see the module docstring."""

    nodes: list[NodeSet]
    layers: list[Layer]

    @classmethod
    def homogeneous(cls, ids: Tensor, layers: list[Layer], feat: Features | None = None,
                    label: Tensor | None = None) -> SampledMFG:
        return cls([NodeSet(ids, feat or Features.none(), _empty() if label is None else label)],
                   layers)

    def with_data(self, feat: Features, label: Tensor) -> SampledMFG:
        """This homogeneous MFG with its features and labels (a new object)."""
        (ns,) = self.nodes
        return dataclasses.replace(self, nodes=[dataclasses.replace(ns, feat=feat, label=label)])

    @property
    def only(self) -> NodeSet:
        """The node set of a homogeneous MFG."""
        if len(self.nodes) != 1:
            raise ValueError(f"this MFG has {len(self.nodes)} node types; heterogeneous MFGs "
                             "are read per node type (nodes[t])")
        return self.nodes[0]

    @property
    def input_nodes(self) -> Tensor:
        return self.only.ids

    @property
    def output_nodes(self) -> Tensor:
        return self.only.ids[: self.layers[-1].num_dst[0]]

    def check(self) -> None:
        need(1 <= len(self.layers) <= MAX_LAYERS, "bad_mfg",
             f"an MFG has 1..{MAX_LAYERS} layers, got {len(self.layers)}")
        types = len(self.nodes)
        need(all(len(layer.num_src) == types for layer in self.layers), "bad_mfg",
             "every layer needs counts for each node type")
        need(self.layers[0].num_src == [ns.ids.numel() for ns in self.nodes], "bad_mfg",
             "the input layer's sources must be all input nodes")
        for prev, layer in zip(self.layers, self.layers[1:]):
            need(layer.num_src == prev.num_dst, "bad_mfg",
                 "a layer's sources must be the previous layer's destinations")
        for ns, out in zip(self.nodes, self.layers[-1].num_dst):
            need(ns.label.dim() >= 1 and ns.label.shape[0] in (0, out), "bad_mfg",
                 "labels must be empty or one per output node")
