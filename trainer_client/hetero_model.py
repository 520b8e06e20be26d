"""Typed GNNs in plain torch over typed MFGs, any device: the relational GraphSAGE (``rsage``)
and DGL's ``HeteroGraphConv`` of ``SAGEConv`` (``hetero-sage``).

``rsage`` (:class:`RelGraphSAGE`, layers of :class:`RelGraphConv`) maps the hidden states of
every node type to new ones for the destination node types::

    h_v' = W_self[t] h_v + b[t] + sum_{r = (s, e, t)} W_r agg_{u in N_r(v)} h_u

for a destination v of type t: a self-loop linear (with bias) per node type, one linear
(no bias) per relation, ``agg`` the mean (0 for no in-edges) or the sum over v's sampled
in-edges of relation r, and the relations into t summed. The per-relation mean is the
homogeneous model's kernel (:func:`trainer_client.model.mean_aggregate`: one weighted
``embedding_bag`` over the relation's CSC); the sum is that mean times the in-degree.
Unlike HeteroGraphConv, a node type into which no relation leads keeps a state (its self
loop) from layer to layer, so its relations out of it still count in the next layer.

``hetero-sage`` (:class:`HeteroSAGE`, layers of :class:`HeteroSAGEConv`) is exactly
``dgl.nn.HeteroGraphConv({r: dgl.nn.SAGEConv((d_s, d_t), out, "mean") for r in etypes},
aggregate="sum")`` (DGL 2.1; tested against DGL): per relation r = (s, e, t) its own
``fc_self`` (d_t -> out, with the bias), ``fc_neigh`` (d_s -> out, no bias), created and
initialised in SAGEConv's order (``fc_neigh`` then ``fc_self``; both weights Xavier-uniform
with ReLU gain, the bias nn.Linear's default U(+-1/sqrt(d_t)), which SAGEConv leaves), and::

    h_v' = sum_{r = (s, e, t) run} ( fc_self_r(h_v) + fc_neigh_r(mean_{u in N_r(v)} h_u) )

A relation runs when both its source and destination types have states from the layer
before (HeteroGraphConv's ``stype in inputs and dtype in inputs``), also with no sampled
edges (its mean is 0: it adds ``fc_self_r(h_v)``, as DGL 2.1 does); a node type into which
no relation runs gets no output, so relations out of it are skipped from then on. The
function is rsage's with ``W_self[t]`` / ``b[t]`` the sums over the relations into t; the
parameters (one self loop and bias per relation), their initialisation and so the training
dynamics (Adam, weight decay) are DGL's. The self terms of the relations into a type are one
matmul with the summed weights (the same function and gradients).

How both compute a layer: a destination type's new state is one sum of products
(:func:`trainer_client.model.linear_sum`, SAGEConv's kernel with n terms): its self term and,
for each relation into it, the relation's mean (or sum) times its weight, accumulated into
one output, with each weight gradient computed as ``(x^T grad)^T``. A relation whose sources
are cheaper to project than to aggregate (:func:`trainer_client.model.project_first`'s cost
rule, not DGL's ``in > out``) is projected (:func:`trainer_client.model.project`), aggregated
and added instead. At ``--matmul-precision medium`` each sum is one product of the terms side
by side with bucketed rows (bfloat16 on the ``"cast"`` route), and projections take the same
route. The same function either way (tests/test_hetero_model.py); on the
20,000-paper mag-shaped benchmark graph the step is 4-9 % shorter than with one ``nn.Linear``
and ``addmm_`` per term, and 27-33 % shorter again at ``medium`` on an AMD EPYC (docs/benchmarks.md,
"Issue 14, session 41").

Node types may have different input widths: the first layer's linears take each type's own
width, as DGL's bipartite SAGEConv does, so no input projection is needed. Between layers:
ReLU and dropout; the output is the logits of the ``predict_ntype`` nodes (the MFG's seeds).

The model spec (JSON-able; saved with checkpoints, rebuilt by :func:`build_hetero_model`)::

    {"name": "rsage" | "hetero-sage", "ntypes": [str, ...], "etypes": [[src, rel, dst], ...],
     "predict_ntype": str, "in_feats": int | {ntype: int}, "hidden": int,
     "num_classes": int, "num_layers": int, "aggregator": "mean" | "sum", "dropout": float}

(``hetero-sage`` with ``"sum"``: SAGEConv's form with the sum over in-edges, not a DGL
aggregator.) :func:`hetero_spec` builds one from partition metadata
(``PartitionSetMeta.ntypes``, ``.etypes``, ``.predict_ntype``; an empty ``ntypes`` is the
homogeneous one-type case, where both models are :class:`trainer_client.model.GraphSAGE`).
Parameters are indexed by the positions of ``ntypes`` / ``etypes`` in the spec (rsage:
``layers.{i}.rel_fc.{r}``, ``layers.{i}.self_fc.{t}``; hetero-sage:
``layers.{i}.mods.{r}.fc_self`` / ``.fc_neigh``, DGL's ``mods.{etype}`` by position), so the
same spec gives the same state-dict keys whatever the names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.errors import ConfigError
from common.mfg import CanonicalEtype, HeteroBlock, HeteroMFG
from trainer_client.model import (
    LayerwiseGNN,
    linear_sum,
    mean_aggregate,
    project,
    project_first,
)

__all__ = ["AGGREGATORS", "HETERO_SPEC_KEYS", "HETERO_MODELS", "RelGraphConv", "RelGraphSAGE",
           "HeteroSAGEConv", "HeteroSAGE", "TypedGNN", "check_hetero_spec",
           "build_hetero_model", "hetero_spec"]

AGGREGATORS = ("mean", "sum")
_INT_KEYS = ("hidden", "num_classes", "num_layers")
HETERO_SPEC_KEYS = ("name", "ntypes", "etypes", "predict_ntype", "in_feats") + _INT_KEYS + (
    "aggregator", "dropout")


def aggregate(block, h_src: Tensor, aggregator: str) -> Tensor:
    """Mean (0 for no in-edges) or sum of each destination's sampled in-neighbours' rows."""
    agg = mean_aggregate(block, h_src)
    if aggregator == "sum" and block.num_edges():
        agg = agg * block.in_degrees().to(agg.dtype).unsqueeze(1)
    return agg


class _TypedConv(nn.Module):
    """What both typed layers share: the model's node types / relations (positions index the
    parameters), the lookups of a block's names in them, the source-state check and the
    neighbour term ``W agg(h_src)`` added to a destination type's state."""

    def __init__(self, ntypes: list[str], etypes: list[CanonicalEtype], in_dims: dict[str, int],
                 out_feats: int, aggregator: str):
        super().__init__()
        if aggregator not in AGGREGATORS:
            raise ConfigError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
        self.ntypes, self.etypes = list(ntypes), [tuple(e) for e in etypes]
        self.in_dims, self.out_feats, self.aggregator = dict(in_dims), out_feats, aggregator
        self._type_index = {t: i for i, t in enumerate(self.ntypes)}
        self._rel_index = {e: i for i, e in enumerate(self.etypes)}

    def _type(self, t: str) -> int:
        return self._index(self._type_index, t, f"node type {t!r}", "node types", self.ntypes)

    def _rel(self, rel: CanonicalEtype) -> int:
        return self._index(self._rel_index, rel, f"relation {rel}", "relations", self.etypes)

    @staticmethod
    def _index(index: dict, key, what: str, kind: str, known: list) -> int:
        i = index.get(key)
        if i is None:
            raise ValueError(f"the MFG has {what}, which the model does not know (model "
                             f"{kind} {known}): build the model from this graph's partition "
                             "metadata")
        return i

    @staticmethod
    def _src(rel: CanonicalEtype, b, h: dict[str, Tensor]) -> Tensor:
        hs = h.get(rel[0])
        if hs is None or hs.shape[0] != b.num_src_nodes():
            raise ValueError(f"relation {rel} needs {b.num_src_nodes()} source states of "
                             f"node type {rel[0]!r}, got "
                             f"{'none' if hs is None else hs.shape[0]}")
        return hs

    def _neigh(self, rel: CanonicalEtype, b, h: dict[str, Tensor], w: Tensor,
               terms: list[tuple[Tensor, Tensor]], adds: list[Tensor]) -> None:
        """Relation ``rel``'s term ``w agg(h[src type])`` over its block ``b``: appended to
        ``terms`` as ``(agg, w)`` (aggregated first: one more product of the destination
        type's :func:`~trainer_client.model.linear_sum`), or to ``adds`` as a finished
        ``[num_dst, out]`` tensor where projecting the sources first multiplies and moves less
        (:func:`~trainer_client.model.project_first`; the same function); nothing for no
        edges (the mean and sum over none are 0)."""
        if b.num_edges() == 0:
            return
        hs = self._src(rel, b, h)
        if project_first(b, self.in_dims[rel[0]], self.out_feats):
            adds.append(aggregate(b, project(hs, w.t()), self.aggregator))
        else:
            terms.append((aggregate(b, hs, self.aggregator), w))

    @staticmethod
    def _combine(bias: Tensor | None, terms: list[tuple[Tensor, Tensor]],
                 adds: list[Tensor]) -> Tensor:
        out = linear_sum(bias, terms)
        for a in adds:
            out = out + a
        return out


class RelGraphConv(_TypedConv):
    """One rsage layer (see the module docstring): ``forward(block, h)`` takes a
    :class:`~common.mfg.HeteroBlock` and a dict node type -> source states (rows = that
    type's sources) and returns a dict node type -> destination states, for every node type
    with destinations in the block."""

    def __init__(self, ntypes: list[str], etypes: list[CanonicalEtype], in_dims: dict[str, int],
                 out_feats: int, aggregator: str = "mean"):
        super().__init__(ntypes, etypes, in_dims, out_feats, aggregator)
        self.rel_fc = nn.ModuleList(nn.Linear(in_dims[s], out_feats, bias=False)
                                    for s, _, _ in self.etypes)
        self.self_fc = nn.ModuleList(nn.Linear(in_dims[t], out_feats) for t in self.ntypes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gain = nn.init.calculate_gain("relu")
        for fc in list(self.rel_fc) + list(self.self_fc):
            nn.init.xavier_uniform_(fc.weight, gain=gain)
            if fc.bias is not None:
                nn.init.zeros_(fc.bias)

    def forward(self, block: HeteroBlock, h: dict[str, Tensor]) -> dict[str, Tensor]:
        terms: dict[str, list[tuple[Tensor, Tensor]]] = {}
        adds: dict[str, list[Tensor]] = {}
        for t in block.ntypes:
            nd = block.num_dst[t]
            if nd == 0:
                continue
            if t not in h:
                raise ValueError(f"no input states for node type {t!r}, which has "
                                 f"{nd} destination nodes in this layer")
            terms[t], adds[t] = [(h[t][:nd], self.self_fc[self._type(t)].weight)], []
        for rel, b in block.rels.items():
            if b.num_dst_nodes() == 0:
                continue
            i = self._rel(rel)
            self._neigh(rel, b, h, self.rel_fc[i].weight, terms[rel[2]], adds[rel[2]])
        return {t: self._combine(self.self_fc[self._type(t)].bias, terms[t], adds[t])
                for t in terms}


class _SAGEConvParams(nn.Module):
    """One relation's ``dgl.nn.SAGEConv((in_src, in_dst), out, "mean")`` parameters, created
    and initialised as SAGEConv does (the same random draws in the same order): ``fc_neigh``
    (no bias), ``fc_self`` (with the bias, nn.Linear's default init), then Xavier-uniform with
    ReLU gain on ``fc_self.weight`` and ``fc_neigh.weight``."""

    def __init__(self, in_src: int, in_dst: int, out_feats: int):
        super().__init__()
        self.fc_neigh = nn.Linear(in_src, out_feats, bias=False)
        self.fc_self = nn.Linear(in_dst, out_feats)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gain = nn.init.calculate_gain("relu")
        nn.init.xavier_uniform_(self.fc_self.weight, gain=gain)
        nn.init.xavier_uniform_(self.fc_neigh.weight, gain=gain)


class HeteroSAGEConv(_TypedConv):
    """One hetero-sage layer: ``dgl.nn.HeteroGraphConv`` of one ``SAGEConv`` per relation
    (``mods[r]``, r the relation's position), summed per destination type (see the module
    docstring). ``forward(block, h)`` as :class:`RelGraphConv`'s; the output has the node types
    into which a relation runs (those with no destinations too, as 0-row states)."""

    def __init__(self, ntypes: list[str], etypes: list[CanonicalEtype], in_dims: dict[str, int],
                 out_feats: int, aggregator: str = "mean"):
        super().__init__(ntypes, etypes, in_dims, out_feats, aggregator)
        self.mods = nn.ModuleList(_SAGEConvParams(in_dims[s], in_dims[d], out_feats)
                                  for s, _, d in self.etypes)

    def reset_parameters(self) -> None:
        for m in self.mods:
            m.reset_parameters()

    def forward(self, block: HeteroBlock, h: dict[str, Tensor]) -> dict[str, Tensor]:
        into: dict[str, list[tuple[CanonicalEtype, int]]] = {}
        for rel in block.rels:
            i = self._rel(rel)
            if rel[0] in h and rel[2] in h:  # HeteroGraphConv's rule, edges or not
                into.setdefault(rel[2], []).append((rel, i))
        out: dict[str, Tensor] = {}
        for d, rels in into.items():
            nd, hd = block.num_dst[d], h[d]
            if hd.shape[0] < nd:
                raise ValueError(f"node type {d!r} has {nd} destination nodes in this layer "
                                 f"but {hd.shape[0]} input states")
            fcs = [self.mods[i].fc_self for _, i in rels]
            if len(fcs) == 1:
                w_self, bias = fcs[0].weight, fcs[0].bias
            else:  # sum_r fc_self_r(h) as one product with the summed weights and biases
                w_self = torch.stack([fc.weight for fc in fcs]).sum(0)
                bias = torch.stack([fc.bias for fc in fcs]).sum(0)
            terms, adds = [(hd[:nd], w_self)], []
            for rel, i in rels:
                self._neigh(rel, block.rels[rel], h, self.mods[i].fc_neigh.weight, terms,
                            adds)
            out[d] = self._combine(bias, terms, adds)
        return out


class TypedGNN(LayerwiseGNN):
    """Layers of ``conv_cls`` (a typed layer) with ReLU and dropout between them (the layer
    loop and its layer-count check are :class:`~trainer_client.model.LayerwiseGNN`'s);
    ``forward(mfg, x)`` takes a :class:`~common.mfg.HeteroMFG` (or a list of HeteroBlocks)
    and a dict node type -> input features, and returns the logits of the ``predict_ntype``
    output nodes. ``name`` is the model's spec name."""

    name = ""
    conv_cls: type[_TypedConv]

    def __init__(self, ntypes: list[str], etypes: list[CanonicalEtype],
                 in_feats: dict[str, int], hidden: int, num_classes: int, num_layers: int,
                 predict_ntype: str, aggregator: str = "mean", dropout: float = 0.0):
        if predict_ntype not in ntypes:
            raise ConfigError(f"predict_ntype {predict_ntype!r} is not one of the node types "
                              f"{list(ntypes)}")
        ntypes, etypes = list(ntypes), [tuple(e) for e in etypes]
        outs = [hidden] * (num_layers - 1) + [num_classes]
        layers = []
        dims = dict(in_feats)
        for o in outs:
            layers.append(self.conv_cls(ntypes, etypes, dims, o, aggregator))
            dims = {t: o for t in ntypes}
        super().__init__(layers, dropout)
        self.ntypes, self.etypes = ntypes, etypes
        self.predict_ntype = predict_ntype

    def forward_layer(self, i: int, block: HeteroBlock,
                      h: dict[str, Tensor]) -> dict[str, Tensor]:
        """Layer i and the ReLU + dropout after it (none after the last)."""
        h = self.layers[i](block, h)
        if i == len(self.layers) - 1:
            return h
        # in place: every state is a fresh self-loop output (+ addmm_ / add), whose backward
        # does not read it
        return {t: self.dropout(F.relu(v, inplace=True)) for t, v in h.items()}

    def forward(self, blocks, x: dict[str, Tensor]) -> Tensor:
        if isinstance(blocks, HeteroMFG) and blocks.seed_ntype != self.predict_ntype:
            raise ValueError(f"the MFG's seeds are of node type {blocks.seed_ntype!r}, the "
                             f"model predicts {self.predict_ntype!r}")
        h = super().forward(blocks, x)
        if self.predict_ntype not in h:  # a batch with no seeds
            return x[self.predict_ntype].new_zeros((0, self.layers[-1].out_feats))
        return h[self.predict_ntype]


class RelGraphSAGE(TypedGNN):
    """``rsage``: layers of :class:`RelGraphConv` (see :class:`TypedGNN`)."""

    name = "rsage"
    conv_cls = RelGraphConv


class HeteroSAGE(TypedGNN):
    """``hetero-sage``: layers of :class:`HeteroSAGEConv`, i.e. DGL's ``HeteroGraphConv`` of
    ``SAGEConv`` mean per relation, summed (see :class:`TypedGNN`)."""

    name = "hetero-sage"
    conv_cls = HeteroSAGEConv


#: spec name -> model class (common.config.HETERO_MODEL_NAMES lists the same names)
HETERO_MODELS: dict[str, type[TypedGNN]] = {c.name: c for c in (RelGraphSAGE, HeteroSAGE)}


def _check_int(spec: dict, key: str) -> int:
    v = spec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"model spec: {key!r} must be an integer >= 1, got {v!r}")
    return v


def check_hetero_spec(spec: dict) -> dict:
    """``spec`` validated and normalised (a new dict: ``in_feats`` a dict per node type,
    ``etypes`` lists of three names); :class:`ConfigError` names the key that is missing,
    unknown or out of range and what it accepts."""
    if not isinstance(spec, dict):
        raise ConfigError(f"model spec must be a dict, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(HETERO_SPEC_KEYS))
    if unknown:
        raise ConfigError(f"model spec: unknown key(s) {unknown}; accepted: "
                          f"{list(HETERO_SPEC_KEYS)}")
    name = spec.get("name")
    if name not in HETERO_MODELS:
        raise ConfigError(f"model spec: 'name' must be one of {list(HETERO_MODELS)}, "
                          f"got {name!r}")
    ntypes = spec.get("ntypes")
    if (not isinstance(ntypes, list) or not ntypes
            or not all(isinstance(t, str) for t in ntypes) or len(set(ntypes)) != len(ntypes)):
        raise ConfigError(f"model spec: 'ntypes' must be a non-empty list of distinct node "
                          f"type names, got {ntypes!r}")
    etypes = spec.get("etypes")
    if not isinstance(etypes, list) or not etypes:
        raise ConfigError(f"model spec: 'etypes' must be a non-empty list of [src type, "
                          f"relation, dst type], got {etypes!r}")
    rels = []
    for e in etypes:
        if (not isinstance(e, (list, tuple)) or len(e) != 3
                or not all(isinstance(x, str) for x in e)):
            raise ConfigError(f"model spec: each of 'etypes' must be [src type, relation, "
                              f"dst type], got {e!r}")
        if e[0] not in ntypes or e[2] not in ntypes:
            raise ConfigError(f"model spec: relation {list(e)} names a node type not in "
                              f"'ntypes' {ntypes}")
        rels.append(list(e))
    if len({tuple(e) for e in rels}) != len(rels):
        raise ConfigError(f"model spec: 'etypes' lists a relation twice: {rels}")
    p = spec.get("predict_ntype")
    if p not in ntypes:
        raise ConfigError(f"model spec: 'predict_ntype' must be one of {ntypes}, got {p!r}")
    f = spec.get("in_feats")
    if isinstance(f, int) and not isinstance(f, bool):
        f = {t: f for t in ntypes}
    if not isinstance(f, dict) or sorted(f) != sorted(ntypes):
        raise ConfigError(f"model spec: 'in_feats' must be an integer or a dict with a width "
                          f"for each node type {ntypes}, got {f!r}")
    in_feats = {t: _check_int(f, t) for t in ntypes}
    out: dict = {"name": name, "ntypes": list(ntypes), "etypes": rels,
                 "predict_ntype": p, "in_feats": in_feats}
    for key in _INT_KEYS:
        out[key] = _check_int(spec, key)
    agg = spec.get("aggregator", "mean")
    if agg not in AGGREGATORS:
        raise ConfigError(f"model spec: 'aggregator' must be one of {list(AGGREGATORS)}, "
                          f"got {agg!r}")
    out["aggregator"] = agg
    d = spec.get("dropout", 0.0)
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
        raise ConfigError(f"model spec: 'dropout' must be a number in [0, 1), got {d!r}")
    out["dropout"] = float(d)
    return out


def build_hetero_model(spec: dict) -> TypedGNN:
    """The model ``spec`` describes (see the module docstring), freshly initialised: a
    :class:`RelGraphSAGE` (``rsage``) or a :class:`HeteroSAGE` (``hetero-sage``)."""
    s = check_hetero_spec(spec)
    return HETERO_MODELS[s["name"]](
        s["ntypes"], [tuple(e) for e in s["etypes"]], s["in_feats"], s["hidden"],
        s["num_classes"], s["num_layers"], s["predict_ntype"], s["aggregator"], s["dropout"])


def hetero_spec(meta, in_feats: int | dict[str, int], hidden: int, num_classes: int,
                num_layers: int, aggregator: str = "mean", dropout: float = 0.0,
                name: str = "rsage") -> dict:
    """A checked spec of model ``name`` (``rsage`` or ``hetero-sage``) from partition
    metadata (anything with ``ntypes``, ``etypes`` and ``predict_ntype``, e.g.
    ``PartitionSetMeta``); empty ``ntypes``: the homogeneous graph, one node type ``""`` and
    one relation ``("", "", "")`` (what its MFGs carry)."""
    ntypes = list(meta.ntypes) or [""]
    etypes = [list(e) for e in meta.etypes] if meta.ntypes else [["", "", ""]]
    return check_hetero_spec({
        "name": name, "ntypes": ntypes, "etypes": etypes,
        "predict_ntype": meta.predict_ntype if meta.ntypes else "", "in_feats": in_feats,
        "hidden": hidden, "num_classes": num_classes, "num_layers": num_layers,
        "aggregator": aggregator, "dropout": dropout})
