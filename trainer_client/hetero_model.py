"""Relational GraphSAGE (R-GCN with mean or sum) in plain torch over typed MFGs, any device.

One layer maps the hidden states of every node type to new ones for the destination node
types (:class:`RelGraphConv`)::

    h_v' = W_self[t] h_v + b[t] + sum_{r = (s, e, t)} W_r agg_{u in N_r(v)} h_u

for a destination v of type t: a self-loop linear (with bias) per node type, one linear
(no bias) per relation, ``agg`` the mean (0 for no in-edges) or the sum over v's sampled
in-edges of relation r, and the relations into t summed. The per-relation mean is the
homogeneous model's kernel (:func:`trainer_client.model.mean_aggregate`: one weighted
``embedding_bag`` over the relation's CSC); the sum is that mean times the in-degree.

This is what ``dgl.nn.HeteroGraphConv({r: dgl.nn.SAGEConv((d_s, d_t), out, "mean")},
aggregate="sum")`` computes when, per destination type, the relations' ``fc_self`` weights
and biases sum to ``W_self[t]`` / ``b[t]`` (tested against DGL); on a homogeneous MFG (one
node type, one relation) it is :class:`trainer_client.model.GraphSAGE`.

Unlike HeteroGraphConv, a node type into which no relation leads keeps a state (its self
loop) from layer to layer, so its relations out of it still count in the next layer (DGL's
HeteroGraphConv gives such a type no output, and its relations are skipped from then on);
with reverse relations every type has one leading into it and the two agree.

Node types may have different input widths: the first layer's linears take each type's own
width (``W_r`` its source type's, ``W_self[t]`` type t's), as DGL's bipartite SAGEConv does,
so no input projection is needed. Between layers: ReLU and dropout; the output is the logits
of the ``predict_ntype`` nodes (the MFG's seeds).

The model spec (JSON-able; saved with checkpoints, rebuilt by :func:`build_hetero_model`)::

    {"name": "rsage", "ntypes": [str, ...], "etypes": [[src, rel, dst], ...],
     "predict_ntype": str, "in_feats": int | {ntype: int}, "hidden": int,
     "num_classes": int, "num_layers": int, "aggregator": "mean" | "sum", "dropout": float}

:func:`hetero_spec` builds one from partition metadata (``PartitionSetMeta.ntypes``,
``.etypes``, ``.predict_ntype``; an empty ``ntypes`` is the homogeneous one-type case).
Parameters are indexed by the positions of ``ntypes`` / ``etypes`` in the spec
(``layers.{i}.rel_fc.{r}``, ``layers.{i}.self_fc.{t}``), so the same spec gives the same
state-dict keys whatever the names.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from common.errors import ConfigError
from common.mfg import CanonicalEtype, HeteroBlock, HeteroMFG
from trainer_client.model import LayerwiseGNN, mean_aggregate

__all__ = ["AGGREGATORS", "HETERO_SPEC_KEYS", "RelGraphConv", "RelGraphSAGE",
           "check_hetero_spec", "build_hetero_model", "hetero_spec"]

AGGREGATORS = ("mean", "sum")
HETERO_MODEL_NAME = "rsage"
_INT_KEYS = ("hidden", "num_classes", "num_layers")
HETERO_SPEC_KEYS = ("name", "ntypes", "etypes", "predict_ntype", "in_feats") + _INT_KEYS + (
    "aggregator", "dropout")


def aggregate(block, h_src: Tensor, aggregator: str) -> Tensor:
    """Mean (0 for no in-edges) or sum of each destination's sampled in-neighbours' rows."""
    agg = mean_aggregate(block, h_src)
    if aggregator == "sum" and block.num_edges():
        agg = agg * block.in_degrees().to(agg.dtype).unsqueeze(1)
    return agg


class RelGraphConv(nn.Module):
    """One relational layer (see the module docstring): ``forward(block, h)`` takes a
    :class:`~common.mfg.HeteroBlock` and a dict node type -> source states (rows = that
    type's sources) and returns a dict node type -> destination states, for every node type
    with destinations in the block."""

    def __init__(self, ntypes: list[str], etypes: list[CanonicalEtype], in_dims: dict[str, int],
                 out_feats: int, aggregator: str = "mean"):
        super().__init__()
        if aggregator not in AGGREGATORS:
            raise ConfigError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
        self.ntypes, self.etypes = list(ntypes), [tuple(e) for e in etypes]
        self.in_dims, self.out_feats, self.aggregator = dict(in_dims), out_feats, aggregator
        self._type_index = {t: i for i, t in enumerate(self.ntypes)}
        self._rel_index = {e: i for i, e in enumerate(self.etypes)}
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

    def _type(self, t: str) -> int:
        i = self._type_index.get(t)
        if i is None:
            raise ValueError(f"the MFG has node type {t!r}, which the model does not know "
                             f"(model node types {self.ntypes}): build the model from this "
                             "graph's partition metadata")
        return i

    def forward(self, block: HeteroBlock, h: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for t in block.ntypes:
            nd = block.num_dst[t]
            if nd == 0:
                continue
            if t not in h:
                raise ValueError(f"no input states for node type {t!r}, which has "
                                 f"{nd} destination nodes in this layer")
            out[t] = self.self_fc[self._type(t)](h[t][:nd])
        for rel, b in block.rels.items():
            s, _, d = rel
            if b.num_dst_nodes() == 0:
                continue
            i = self._rel_index.get(rel)
            if i is None:
                raise ValueError(f"the MFG has relation {rel}, which the model does not know "
                                 f"(model relations {self.etypes}): build the model from "
                                 "this graph's partition metadata")
            if b.num_edges() == 0:
                continue  # mean and sum over no edges: 0
            hs = h.get(s)
            if hs is None or hs.shape[0] != b.num_src_nodes():
                raise ValueError(f"relation {rel} needs {b.num_src_nodes()} source states of "
                                 f"node type {s!r}, got "
                                 f"{'none' if hs is None else hs.shape[0]}")
            w = self.rel_fc[i].weight
            # project first when that shrinks the rows moved along edges (same function)
            if self.in_dims[s] > self.out_feats:
                out[d] = out[d] + aggregate(b, F.linear(hs, w), self.aggregator)
            else:  # accumulate in place: addmm_'s backward does not need its output
                out[d] = out[d].addmm_(aggregate(b, hs, self.aggregator), w.t())
        return out


class RelGraphSAGE(LayerwiseGNN):
    """Layers of :class:`RelGraphConv` with ReLU and dropout between them (the layer loop and
    its layer-count check are :class:`~trainer_client.model.LayerwiseGNN`'s); ``forward(mfg,
    x)`` takes a :class:`~common.mfg.HeteroMFG` (or a list of HeteroBlocks) and a dict node
    type -> input features, and returns the logits of the ``predict_ntype`` output nodes."""

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
            layers.append(RelGraphConv(ntypes, etypes, dims, o, aggregator))
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
    if spec.get("name") != HETERO_MODEL_NAME:
        raise ConfigError(f"model spec: 'name' must be {HETERO_MODEL_NAME!r}, "
                          f"got {spec.get('name')!r}")
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
    out: dict = {"name": HETERO_MODEL_NAME, "ntypes": list(ntypes), "etypes": rels,
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


def build_hetero_model(spec: dict) -> RelGraphSAGE:
    """The model ``spec`` describes (see the module docstring), freshly initialised."""
    s = check_hetero_spec(spec)
    return RelGraphSAGE(s["ntypes"], [tuple(e) for e in s["etypes"]], s["in_feats"],
                        s["hidden"], s["num_classes"], s["num_layers"], s["predict_ntype"],
                        s["aggregator"], s["dropout"])


def hetero_spec(meta, in_feats: int | dict[str, int], hidden: int, num_classes: int,
                num_layers: int, aggregator: str = "mean", dropout: float = 0.0) -> dict:
    """A checked spec from partition metadata (anything with ``ntypes``, ``etypes`` and
    ``predict_ntype``, e.g. ``PartitionSetMeta``); empty ``ntypes``: the homogeneous graph,
    one node type ``""`` and one relation ``("", "", "")`` (what its MFGs carry)."""
    ntypes = list(meta.ntypes) or [""]
    etypes = [list(e) for e in meta.etypes] if meta.ntypes else [["", "", ""]]
    return check_hetero_spec({
        "name": HETERO_MODEL_NAME, "ntypes": ntypes, "etypes": etypes,
        "predict_ntype": meta.predict_ntype if meta.ntypes else "", "in_feats": in_feats,
        "hidden": hidden, "num_classes": num_classes, "num_layers": num_layers,
        "aggregator": aggregator, "dropout": dropout})
