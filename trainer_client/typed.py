"""What the trainer does differently on a typed (heterogeneous) partition set.

The servers' ping reply (:class:`common.messages.Pong`) names the set's node types (in id
order, each with whether its feature rows are real: ``featured``), its relations (in relation
id order) and ``predict_ntype`` (labels and splits are of that type only); a homogeneous set
names none. From that:

* :func:`model_name`: ``--model auto`` is ``rsage`` on a typed set and ``sage`` otherwise;
  ``--model rsage`` or ``hetero-sage`` (DGL's HeteroGraphConv of SAGEConv) pick the typed
  model (trainer_client.hetero_model; :func:`typed_spec` builds its spec); a homogeneous
  model (sage, gcn, gat, dgl-sage) on a typed set is refused (ConfigError); a typed model on
  a homogeneous set is its one-type case (node type ``""``, relation ``("", "", "")``).
* :func:`rel_fanout_table`: per layer one fanout per relation id, from ``--fanouts`` (every
  relation) and ``--rel-fanouts`` (named relations), sent as ``SampleRequest.rel_fanouts``.
* :func:`typed_inputs`: the first layer's input per node type. A featured type's input is its
  feature rows. A featureless type (ogbn-mag's author, institution, field_of_study; its
  served rows are zeros) gets, with ``--node-emb-dim D``, the rows of a learnable embedding
  held by the servers (:class:`trainer_client.node_embedding.NodeEmbedding`, DistDGL's
  DistEmbedding: looked up by global id, updated by the servers' sparse Adam from the row
  gradients, saved in checkpoints) instead of its zeros; without it, the zeros (and a
  warning). One embedding table covers every global id (rows of featured types are never
  looked up): each server holds ``part nodes x D x 4`` bytes of rows plus the sparse Adam's
  two moments of the same size and a step count per row, i.e. about ``12 D + 4`` bytes per
  node of its part (the summary's ``node_embedding.bytes_per_server`` reports the measured
  figure). A set partitioned with ``--derive-features mean`` has every type featured: no
  embedding is needed, and ``--node-emb-dim`` is refused there.
* ``--eval full`` (layer-wise inference, trainer_client/inference.py) runs typed sets and
  models too: per layer every node type's nodes, featureless types' inputs from
  :func:`typed_inputs` as here.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from common.config import HETERO_MODEL_NAMES, MODEL_NAMES, TrainerConfig, parse_rel_fanouts
from common.errors import ConfigError
from common.mfg import HeteroMFG
from trainer_client.hetero_model import hetero_spec

log = logging.getLogger("mfgserve.trainer")


def is_typed(info) -> bool:
    """Whether the served partition set is typed (its ping names node types)."""
    return bool(getattr(info, "ntypes", None))


def ntype_names(info) -> list[str]:
    return [t.name for t in getattr(info, "ntypes", [])]


def featureless(info) -> list[str]:
    """The node types whose served feature rows are zeros (not in the set's feat_ntypes)."""
    return [t.name for t in getattr(info, "ntypes", []) if not t.featured]


def model_name(cfg: TrainerConfig, info) -> str:
    """The model to train on the served set (see the module docstring)."""
    typed = is_typed(info)
    if cfg.model == "auto":
        return "rsage" if typed else "sage"
    if typed and cfg.model in MODEL_NAMES:
        raise ConfigError(
            f"--model {cfg.model} trains homogeneous graphs, but partition set "
            f"{info.dataset} is typed (node types {ntype_names(info)}, "
            f"{len(info.etypes)} relations): use --model rsage (or leave --model at auto) or "
            "--model hetero-sage (DGL's HeteroGraphConv of SAGEConv)")
    return cfg.model


def check_typed_run(cfg: TrainerConfig, info) -> None:
    """Refuse options that typed training does not support, each naming what to change."""
    name = model_name(cfg, info)
    if name not in HETERO_MODEL_NAMES:
        if cfg.rel_fanouts:
            raise ConfigError(f"--rel-fanouts sets per-relation fanouts of typed partition "
                              f"sets; {info.dataset} is homogeneous: use --fanouts")
        return
    if is_typed(info) and cfg.node_emb_dim > 0 and not featureless(info):
        raise ConfigError(
            f"--node-emb-dim {cfg.node_emb_dim}: every node type of {info.dataset} has "
            f"features ({ntype_names(info)}; e.g. partitioned with --derive-features mean), "
            "so no type needs a learnable embedding: drop --node-emb-dim")
    if is_typed(info) and cfg.node_emb_dim == 0 and featureless(info):
        log.warning("node types %s of %s have no features (their served rows are zeros); "
                    "give them learnable embeddings with --node-emb-dim N (e.g. 128), or "
                    "partition with --derive-features mean", featureless(info), info.dataset)
    rel_fanout_table(cfg.fanouts, cfg.rel_fanouts, info)  # names checked before any request


def rel_fanout_table(fanouts: list[int], rel_fanouts: str, info) -> list[list[int]] | None:
    """Per layer (input layer first) the fanout of each relation id of a typed set: the
    layer's ``--fanouts`` value, or the one ``--rel-fanouts`` names. None: a homogeneous set
    (requests carry ``fanouts`` only)."""
    if not is_typed(info):
        return None
    rels = [r.rel for r in info.etypes]
    table = [[f] * len(rels) for f in fanouts]
    for layer, named in enumerate(parse_rel_fanouts(rel_fanouts, fanouts)):
        for name, f in named.items():
            ids = [i for i, r in enumerate(rels) if r == name]
            if not ids:
                raise ConfigError(f"--rel-fanouts names relation {name!r}, which partition set "
                                  f"{info.dataset} does not have; its relations: {rels}")
            for i in ids:
                table[layer][i] = f
    return table


def ring_fanouts(cfg: TrainerConfig, info, fanouts: list[int]) -> list[int]:
    """Per layer the most in-neighbours one destination can get (every relation's fanout
    summed; -1 if any takes all): what bounds a batch's input rows for the ring's slots."""
    table = rel_fanout_table(fanouts, cfg.rel_fanouts if fanouts == cfg.fanouts else "", info)
    if table is None:
        return list(fanouts)
    return [-1 if any(f < 0 for f in row) else sum(row) for row in table]


def loader_args(cfg: TrainerConfig, info, fanouts: list[int], rel_fanouts: str) -> dict:
    """DistNodeDataLoader's typed arguments (none for a homogeneous model)."""
    if model_name(cfg, info) not in HETERO_MODEL_NAMES:
        return {}
    return {"hetero": True, "rel_fanouts": rel_fanout_table(fanouts, rel_fanouts, info),
            "seed_ntype": info.predict_ntype if is_typed(info) else ""}


def in_feats(cfg: TrainerConfig, info) -> dict[str, int]:
    """Each node type's input width: its features, or its embedding (featureless types with
    --node-emb-dim); a homogeneous set's one type: features + embedding, concatenated."""
    if not is_typed(info):
        return {"": info.feat_dim + cfg.node_emb_dim}
    emb = set(featureless(info)) if cfg.node_emb_dim > 0 else set()
    return {t: cfg.node_emb_dim if t in emb else info.feat_dim for t in ntype_names(info)}


def typed_spec(cfg: TrainerConfig, info, num_classes: int) -> dict:
    """The spec of the typed model :func:`model_name` picks (``rsage``, the default, or
    ``hetero-sage``) for the served set (trainer_client.hetero_model)."""
    return hetero_spec(_Meta(info), in_feats(cfg, info), cfg.hidden, num_classes,
                       len(cfg.fanouts), dropout=cfg.dropout, name=model_name(cfg, info))


class _Meta:
    """The metadata fields hetero_spec reads, from a ping reply."""

    def __init__(self, info):
        self.ntypes = ntype_names(info)
        self.etypes = [[r.src, r.rel, r.dst] for r in getattr(info, "etypes", [])]
        self.predict_ntype = getattr(info, "predict_ntype", "")


def typed_inputs(mfg: HeteroMFG, emb, info) -> dict[str, Tensor]:
    """The first layer's input per node type (see the module docstring): feature rows as
    float32, a featureless type's embedding rows when ``emb`` is given (looked up by the
    type's input node ids, global), on a homogeneous set features + embedding concatenated."""
    feats = mfg.feat
    if not is_typed(info):
        x = feats[""].float()
        if emb is None:
            return {"": x}
        return {"": torch.cat([x, emb.lookup(mfg.input_nodes[""], device=x.device)], dim=1)}
    no_feat = set(featureless(info)) if emb is not None else set()
    out = {t: feats[t].float() for t in mfg.input_nodes if t not in no_feat}
    want = [t for t in mfg.input_nodes if t in no_feat]
    if want:  # one lookup (one request per part) for every featureless type's rows
        ids = [mfg.input_nodes[t] for t in want]
        rows = emb.lookup(torch.cat(ids), device=ids[0].device)
        out.update(zip(want, torch.split(rows, [i.numel() for i in ids])))
    return out


def seed_labels(mfg) -> Tensor:
    """The seeds' labels of a batch (HeteroMFG: the seed type's)."""
    if isinstance(mfg, HeteroMFG):
        return mfg.label  # type: ignore[return-value]
    return mfg[-1].dstdata["label"]
