"""Layer-wise full-neighbour inference over every node, through the sampler servers.

Why layer-wise (DistDGL's ``inference`` with DistTensor): a sampled forward pass gives a
noisy estimate of the model's output, and an exact full-neighbour pass per seed costs the
whole L-hop receptive field of every seed. Layer by layer, each node's layer-l output is
computed once from all its in-neighbours' layer-(l-1) outputs: the exact full-graph output,
at a cost linear in nodes plus edges per layer.

One code path for homogeneous and typed (heterogeneous) sets and models: every MFG is read
as a :class:`~common.mfg.HeteroMFG` (a homogeneous set is the one-type case, node type
``""``), every layer's states are a dict node type -> rows, and a homogeneous model's
``forward_layer(l, block, h)`` runs on the one relation's block (:func:`forward_layer`).

For layer l = 0..L-1, every node (each rank a share of every part's owned nodes, batched per
(part, node type) of at most ``batch_size``: a sample request's seeds are of one node type;
each part's nodes are grouped by type, and :func:`type_ranges` finds the groups) gets a
one-layer MFG with fanout -1 (all in-neighbours through every relation) from its part's
server, structure only. Layer 0 reads its inputs, by the block's source node ids per type,
from the served input features (NODE_DATA requests to the owning parts), or, for featureless
types with server-held embeddings (``--node-emb-dim``), the embedding rows, exactly as
training builds them (:func:`trainer_client.typed.typed_inputs`); layer l > 0 from the
server-held node tensor of layer l-1's outputs
(:class:`~trainer_client.node_tensors.DistNodeTensor`: one over the global id space, every
type's rows). ``model.forward_layer(l, block, h)`` in eval mode gives the seeds' outputs,
written into layer l's node tensor. A node type whose layer-l output the model does not
produce (hetero-sage: no relation into it runs; and every type but ``predict_ntype`` in the
last layer) is skipped in that layer, as the sampled forward drops it. Ranks meet in a
barrier between layers: layer l+1 reads rows that every rank wrote in layer l.

Evaluation follows the task (:mod:`trainer_client.metrics`): accuracy for multiclass sets,
ROC-AUC (ogb's evaluator, over every rank's valid / test rows gathered) for multi-label
sets; the result names it (``metric``: ``acc`` or ``rocauc``).

Server memory: a node tensor per layer output (float32, one row per node of the graph) lives
on the servers until the next layer is done (``--max-node-tensor-mb`` bounds them); the last
hidden layer (the embeddings) and the logits are kept until :meth:`LayerwiseInference.drop`.

Message sizes: input rows (features or node tensor rows) are read and written in chunks
below ``max_message_bytes``, so a sampled reply carries only the block's structure (about 8
bytes per in-edge of the batch) and no reply grows with the feature width. (A reply over a
client's ZeroMQ message limit is dropped by the transport, not answered with an error: this
keeps inference clear of it.)
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from common.errors import ConfigError
from common.logs import bars_allowed
from common.messages import MFGReply, NodeDataReply, NodeDataRequest, SampleRequest
from common.mfg import Block, HeteroBlock, HeteroMFG
from common.rpc import expect
from trainer_client.checkpoint import MODEL_FORMAT
from trainer_client.node_tensors import DistNodeTensor

log = logging.getLogger("mfgserve.inference")

_CHUNK_SHARE = 2  # a chunk's rows take at most 1/2 of --max-message-mb (room for ids, framing)


# ---------------------------------------------------------------------------- model files
def load_model_file(path: str | os.PathLike) -> dict:
    """A ``best_model.pt`` written by training (format ``mfgserve-model/1``), loaded with
    ``weights_only=True``: nothing but tensors and plain containers is unpickled."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"model file {path} does not exist: train with a run directory "
                          "(--run-dir) to get <run-dir>/best_model.pt, or pass --model FILE")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text suggests weights_only=False: never
        raise ConfigError(f"cannot read model file {path}: it is not a file of tensors and "
                          "plain containers (nothing else is unpickled); pass the "
                          "best_model.pt a training run wrote") from e
    except Exception as e:  # a truncated or foreign file: torch raises many kinds
        raise ConfigError(f"cannot read model file {path}: {str(e).splitlines()[0]}") from e
    if not isinstance(saved, dict) or saved.get("format") != MODEL_FORMAT:
        fmt = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ConfigError(f"{path} is not an mfgserve model file (format {fmt!r}, expected "
                          f"{MODEL_FORMAT!r}); pass the best_model.pt a training run wrote")
    for key in ("model_spec", "state_dict"):
        if not isinstance(saved.get(key), dict):
            raise ConfigError(f"model file {path} has no {key!r} dict; it is damaged")
    return saved


def check_model(saved: dict, info, path: str = "the model file", pool=None) -> None:
    """Refuse a model that does not fit the served graph, naming each difference (and, with
    the ``pool``, what ``mfgserve-infer``'s files do not hold yet: typed sets and models,
    multi-label sets; ``--eval full`` evaluates those)."""
    spec = saved["model_spec"]
    refuse_typed(spec.get("name", ""), info, path)
    if pool is not None:
        refuse_multilabel(pool, info)
    diff = []
    if spec.get("in_feats") != info.feat_dim:
        diff.append(f"input features {spec.get('in_feats')} (the servers' feature dim is "
                    f"{info.feat_dim})")
    if spec.get("num_classes") != info.num_classes:
        diff.append(f"{spec.get('num_classes')} classes (the servers' dataset has "
                    f"{info.num_classes})")
    set_id = saved.get("set_id", "")
    if set_id and set_id != info.set_id:
        diff.append(f"partition set {set_id} (the servers serve {info.set_id})")
    if diff:
        raise ConfigError(f"{path} was trained for another graph: {'; '.join(diff)}. Start "
                          "the servers on the partition set it was trained on, or pass its "
                          "model file")


def refuse_multilabel(pool, info) -> None:
    """``mfgserve-infer`` writes a class prediction per node (``pred.npy``) and accuracies:
    a multi-label set (binary tasks, ROC-AUC) is refused before any work, naming the
    evaluation that runs it (``--eval full`` measures its ROC-AUC layer-wise)."""
    from trainer_client.metrics import task_of

    task = task_of(info)
    if task.binary:
        raise ConfigError(
            f"mfgserve-infer writes class predictions and accuracy, but dataset "
            f"{info.dataset} has {task.num_tasks} binary tasks evaluated by ROC-AUC; "
            "evaluate it with the trainer's --eval full (layer-wise full-graph ROC-AUC) or "
            "--eval sampled")


def refuse_typed(model_name: str, info, what: str = "the model") -> None:
    """``mfgserve-infer`` writes every node's logits per part; a typed model
    (common.config.HETERO_MODEL_NAMES: rsage, hetero-sage) or a typed partition set (whose
    logits exist for ``predict_ntype`` only) is refused, naming what runs it (``--eval
    full``: layer-wise inference of typed models)."""
    from common.config import HETERO_MODEL_NAMES

    ntypes = [t.name for t in getattr(info, "ntypes", [])]
    if model_name in HETERO_MODEL_NAMES or ntypes:
        where = (f"partition set {info.dataset} is typed (node types {ntypes})" if ntypes
                 else f"{what} is a typed model ({model_name})")
        raise ConfigError(f"mfgserve-infer does not export typed graphs or models yet: "
                          f"{where}; evaluate layer-wise with the trainer's --eval full, or "
                          "with --eval sampled")


def model_from_file(saved: dict, device: torch.device) -> nn.Module:
    """The saved model, rebuilt from its spec, with its weights, in eval mode."""
    from trainer_client.models import build_model

    model = build_model(dict(saved["model_spec"]))
    try:
        model.load_state_dict(saved["state_dict"])
    except RuntimeError as e:
        raise ConfigError(f"the model file's weights do not fit its model_spec "
                          f"{saved['model_spec']}: {str(e).splitlines()[0]}") from e
    return model.to(device).eval()


# ---------------------------------------------------------------------------- node types
def type_ranges(pool, info) -> list[list[tuple[str, int, int]]]:
    """Per part, its owned nodes' groups ``(node type, lo, hi)`` (global ids, in the set's
    ``ntypes`` order, empty groups left out). A part's nodes are grouped by type in
    ``ntypes`` order (partition/layout.py), so each boundary is found by a binary search over
    the part's ids, asking each probed node's type with a one-node sample request (its reply
    names the seed's type: the node set with output nodes); every part searches at once.
    A homogeneous set: one group ``("", lo, hi)`` per part."""
    offsets = [int(x) for x in info.node_offsets]
    parts = range(len(offsets) - 1)
    names = [t.name for t in getattr(info, "ntypes", [])]
    if not names:
        return [[("", offsets[p], offsets[p + 1])] for p in parts]

    def types_of(ids: dict[int, int]) -> dict[int, int]:
        replies = pool.scatter_gather(
            {p: SampleRequest(seeds=torch.tensor([i]), fanouts=[1], with_feat=False,
                              with_label=False) for p, i in ids.items()}, MFGReply)
        return {p: next(k for k, n in enumerate(r.mfg.layers[-1].num_dst) if n > 0)
                for p, r in replies.items()}

    # starts[p][k]: the first id of part p whose type index is >= k (k = 0..T)
    starts = {p: [offsets[p]] + [offsets[p + 1]] * len(names) for p in parts}
    for k in range(1, len(names)):
        lo = {p: starts[p][k - 1] for p in parts}
        hi = {p: offsets[p + 1] for p in parts}
        while True:
            open_ = {p: (lo[p] + hi[p]) // 2 for p in parts if lo[p] < hi[p]}
            if not open_:
                break
            for p, t in types_of(open_).items():
                if t >= k:
                    hi[p] = open_[p]
                else:
                    lo[p] = open_[p] + 1
        for p in parts:
            starts[p][k] = lo[p]
    return [[(names[k], starts[p][k], starts[p][k + 1]) for k in range(len(names))
             if starts[p][k] < starts[p][k + 1]] for p in parts]


# ---------------------------------------------------------------------------- batches
def node_batches(groups: list[list[tuple[str, int, int]]], batch_size: int, rank: int,
                 world_size: int, nodes: Tensor | None = None,
                 ntypes: set[str] | None = None) -> list[tuple[int, str, Tensor]]:
    """This rank's (part, node type, seeds) batches: of every part's group of one node type
    (:func:`type_ranges`; only the types in ``ntypes``, if given), a near-equal share of its
    nodes (or of those among ``nodes``, sorted unique global ids), cut into batches of at
    most ``batch_size``; the parts' batches interleaved so that every server has work at
    once."""
    per_part = []
    for p, part_groups in enumerate(groups):
        batches = []
        for t, lo, hi in part_groups:
            if ntypes is not None and t not in ntypes:
                continue
            own = (torch.arange(lo, hi) if nodes is None
                   else nodes[(nodes >= lo) & (nodes < hi)])
            share = torch.tensor_split(own, world_size)[rank]
            batches += [(p, t, b) for b in torch.split(share, batch_size) if b.numel()]
        per_part.append(batches)
    out = []
    for i in range(max((len(b) for b in per_part), default=0)):
        out += [batches[i] for batches in per_part if i < len(batches)]
    return out


def stream_blocks(pool, batches: list[tuple[int, str, Tensor]], *, with_label: bool,
                  max_inflight: int) -> Iterator[HeteroMFG]:
    """One-layer full-neighbour MFGs of ``batches`` (structure, and the seeds' labels when
    asked; no features), in order, ``max_inflight`` requested ahead; requests still in flight
    when iteration stops are cancelled."""
    todo = deque(batches)
    inflight: deque = deque()
    try:
        while todo or inflight:
            while todo and len(inflight) < max_inflight:
                part, ntype, seeds = todo.popleft()
                inflight.append((ntype, pool.submit(part, SampleRequest(
                    seeds=seeds, fanouts=[-1], with_feat=False, with_label=with_label))))
            ntype, handle = inflight[0]
            reply = expect(pool.wait(handle), MFGReply, handle.channel.endpoint)
            inflight.popleft()
            yield HeteroMFG.of(reply.mfg, feat={}, seed_ntype=ntype)
    finally:
        for _, handle in inflight:
            pool.cancel(handle)


class ServedFeatures:
    """The servers' input features as a row source like a node tensor: :meth:`read` asks
    each owning part for its rows (NODE_DATA), in rounds below ``max_message_bytes``, as
    float32."""

    def __init__(self, pool, node_offsets: list[int], feat_dim: int, max_message_bytes: int):
        self.pool = pool
        self.offsets = torch.tensor(list(node_offsets), dtype=torch.int64)
        self.row_shape = (feat_dim,)
        self.chunk = chunk_rows(max_message_bytes, 4 * feat_dim)

    def read(self, ids: Tensor) -> Tensor:
        out = torch.empty((ids.numel(), *self.row_shape), dtype=torch.float32)
        for start in range(0, ids.numel(), self.chunk):
            part = ids[start:start + self.chunk]
            owner = torch.searchsorted(self.offsets, part, right=True) - 1
            split = {int(p): torch.nonzero(owner == p).flatten() + start
                     for p in torch.unique(owner).tolist()}
            replies = self.pool.scatter_gather(
                {p: NodeDataRequest(nodes=ids[pos], with_feat=True) for p, pos in split.items()},
                NodeDataReply)
            for p, pos in split.items():
                out[pos] = replies[p].feat.float()
        return out


def chunk_rows(max_message_bytes: int, row_bytes: int) -> int:
    """Rows per read or write so that one message stays below ``max_message_bytes``."""
    return max(1, max_message_bytes // _CHUNK_SHARE // max(row_bytes, 1))


def _read_rows(src, ids: dict[str, Tensor]) -> dict[str, Tensor]:
    """``src``'s rows (features or a node tensor) of every type's ids, in one read."""
    if not ids:
        return {}
    rows = src.read(torch.cat(list(ids.values())))
    return dict(zip(ids, torch.split(rows, [v.numel() for v in ids.values()])))


# ---------------------------------------------------------------------------- models
def forward_layer(model: nn.Module, layer: int, block: HeteroBlock,
                  h: dict[str, Tensor]) -> dict[str, Tensor]:
    """Layer ``layer`` of ``model`` on a typed block: a typed model's own ``forward_layer``;
    a homogeneous model's on the block's one relation (the one-type case)."""
    from trainer_client.hetero_model import TypedGNN

    if isinstance(model, TypedGNN):
        return model.forward_layer(layer, block, h)
    if len(block.rels) != 1 or len(block.ntypes) != 1:
        raise ConfigError(f"a homogeneous model cannot run a typed graph (relations "
                          f"{list(block.rels)}); train a typed model (--model rsage)")
    (b,), (t,) = block.rels.values(), block.ntypes
    return {t: model.forward_layer(layer, b, h[t])}


def _probe_block(ntypes: list[str], rels: list[tuple[str, str, str]]) -> HeteroBlock:
    """One node of every type, one edge per relation: enough for ``forward_layer`` to show
    which types get an output and its width."""
    return HeteroBlock(ntypes, dict.fromkeys(ntypes, 1), dict.fromkeys(ntypes, 1),
                       {r: Block(torch.tensor([0, 1]), torch.tensor([0]), 1, 1) for r in rels})


# ---------------------------------------------------------------------------- collectives
def _distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def _all_sum(values: Sequence[float], world_size: int, device: torch.device,
             dtype: torch.dtype = torch.int64) -> list:
    t = torch.tensor(values, dtype=dtype, device=device)
    if _distributed(world_size):
        dist.all_reduce(t)
    return [v if dtype.is_floating_point else int(v) for v in t.tolist()]


def _barrier(world_size: int) -> None:
    if _distributed(world_size):
        dist.barrier()


def _shared_token(world_size: int, device: torch.device) -> str:
    """A random name part that every rank agrees on (rank 0's, broadcast)."""
    t = torch.tensor([secrets.randbits(48)], dtype=torch.int64, device=device)
    if _distributed(world_size):
        dist.broadcast(t, 0)
    return f"{int(t.item()):012x}"


# ---------------------------------------------------------------------------- inference
@dataclass
class InferenceResult:
    """The metric (``acc``, or ``rocauc`` for multi-label sets) over the valid/test nodes
    (identical on every rank), seconds per layer, and, when the outputs were kept, the node
    tensors holding them on the servers (``logits``, and ``emb``: the last hidden layer's
    output, when the model has one)."""

    valid: float
    test: float
    layer_s: list[float]
    num_nodes: int
    metric: str = "acc"
    kept: dict[str, DistNodeTensor] = field(default_factory=dict)

    @property
    def valid_acc(self) -> float:
        return self._acc(self.valid)

    @property
    def test_acc(self) -> float:
        return self._acc(self.test)

    def _acc(self, value: float) -> float:
        if self.metric != "acc":
            raise AttributeError(f"this result measures {self.metric}, not accuracy")
        return value

    def metrics(self) -> dict[str, float]:
        """``{"valid_<metric>": ..., "test_<metric>": ...}``, as the trainer's summary."""
        return {f"valid_{self.metric}": self.valid, f"test_{self.metric}": self.test}


class _Scores:
    """The last layer's valid / test predictions, per the task: correct / total counts
    (accuracy), or the rows themselves (ROC-AUC, scored once over every rank's rows)."""

    def __init__(self, binary: bool, splits: dict[str, Tensor]):
        self.binary = binary
        self.splits = splits
        self.counts = [0, 0, 0, 0]  # valid correct, valid total, test correct, test total
        self.rows: dict[str, list[tuple[Tensor, Tensor]]] = {"valid": [], "test": []}

    def add(self, seeds: Tensor, out: Tensor, labels: Tensor) -> None:
        out, labels = out.float().cpu(), labels.cpu()
        for i, split in enumerate(("valid", "test")):
            ids = self.splits.get(split)
            if ids is None or not ids.numel():
                continue
            mask = torch.isin(seeds, ids)
            if self.binary:
                self.rows[split].append((out[mask], labels[mask].float()))
            else:
                self.counts[2 * i] += int((out[mask].argmax(1) == labels[mask]).sum())
                self.counts[2 * i + 1] += int(mask.sum())

    def result(self, world_size: int, rank: int, width: int,
               device: torch.device) -> tuple[float, float]:
        """(valid, test), the same on every rank (collectives: every rank calls it)."""
        if not self.binary:
            c = _all_sum(self.counts, world_size, device)
            return c[0] / max(c[1], 1), c[2] / max(c[3], 1)
        from trainer_client.metrics import check_shared_score, gather_rows, rank0_rocauc

        scores, errors = [], []
        for split in ("valid", "test"):
            rows = self.rows[split]
            pred = (torch.cat([r[0] for r in rows]) if rows else torch.empty((0, width)))
            label = (torch.cat([r[1] for r in rows]) if rows else torch.empty((0, width)))
            pred = gather_rows(pred.to(device), world_size)
            label = gather_rows(label.to(device), world_size)
            empty = self.splits.get(split) is None or not self.splits[split].numel()
            score, error = (rank0_rocauc(label.cpu().numpy(), pred.cpu().numpy(), rank)
                            if not empty else (0.0, ""))
            scores.append(score)
            errors.append(error)
        total = _all_sum(scores, world_size, device, torch.float64)
        return tuple(check_shared_score(s, e, f"{split} ROC-AUC (layer-wise inference)")
                     for s, e, split in zip(total, errors, ("valid", "test")))  # type: ignore


class LayerwiseInference:
    """Layer-wise inference of ``model`` (with ``num_layers`` and ``forward_layer``; a
    homogeneous or a typed model) over the graph the ``pool``'s servers serve; ``info`` is
    their Pong; ``emb``: the run's server-held node embedding (``--node-emb-dim``), whose rows
    are the layer-0 inputs of featureless types (typed sets) or are concatenated to the
    features (homogeneous sets), as in training. Every rank of a DDP job constructs it and
    calls :meth:`run` together, with the same arguments."""

    def __init__(self, model: nn.Module, pool, info, *, batch_size: int,
                 device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1,
                 max_inflight: int = 4, max_message_bytes: int = 512 << 20,
                 progress: bool = False, emb=None):
        from trainer_client.metrics import task_of
        from trainer_client.typed import featureless, is_typed

        self.model = getattr(model, "module", model)  # a DDP wrapper's module
        self.pool, self.info, self.emb = pool, info, emb
        self.task = task_of(info)
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.max_inflight = max_inflight
        self.max_message_bytes = max_message_bytes
        self.progress = bars_allowed(progress) and rank == 0
        self.prefix = f"infer-{_shared_token(world_size, self.device)}"
        self.tensors: dict[str, DistNodeTensor] = {}
        self.features = ServedFeatures(pool, info.node_offsets, info.feat_dim,
                                       max_message_bytes)
        self.typed = is_typed(info)
        self.ntypes = [t.name for t in info.ntypes] if self.typed else [""]
        self.rels = ([(r.src, r.rel, r.dst) for r in info.etypes] if self.typed
                     else [("", "", "")])
        self.predict = info.predict_ntype if self.typed else ""
        # types whose layer-0 input is the embedding, not the served (zero) features
        self.emb_types = set(featureless(info)) if emb is not None and self.typed else set()

    # ------------------------------------------------------------------ node tensors
    def _tensor(self, key: str, dim: int) -> DistNodeTensor:
        t = DistNodeTensor(self.pool, f"{self.prefix}-{key}", [dim],
                           node_offsets=self.info.node_offsets,
                           max_message_bytes=self.max_message_bytes)
        self.tensors[key] = t
        return t

    def _release(self, key: str) -> None:
        """Forget a node tensor; rank 0 frees it (call after a barrier: nobody reads it)."""
        t = self.tensors.pop(key)
        if self.rank == 0:
            t.drop()

    def drop(self) -> None:
        """Free every node tensor still held, once every rank is done with them."""
        _barrier(self.world_size)
        for key in list(self.tensors):
            self._release(key)

    def _abandon(self) -> None:
        """After a failure: free this job's node tensors, best effort (the servers may be
        gone, or fail: the original error matters more)."""
        if self.rank == 0:
            for t in self.tensors.values():
                try:
                    t.drop()
                except Exception as e:
                    log.warning("could not free node tensor %s: %s", t.name, e)
        self.tensors.clear()

    def _in_width(self, t: str) -> int:
        if t in self.emb_types:
            return int(self.emb.dim)
        if not self.typed and self.emb is not None:
            return int(self.info.feat_dim + self.emb.dim)
        return int(self.info.feat_dim)

    def plan(self) -> list[tuple[int, list[str]]]:
        """Per layer its output width and the node types it gives an output for (the
        model is in eval mode), from one probe node of every type."""
        out = []
        h = {t: torch.zeros((1, self._in_width(t)), device=self.device) for t in self.ntypes}
        try:
            for layer in range(int(self.model.num_layers)):
                block = _probe_block(self.ntypes, self.rels).to(self.device)
                h = forward_layer(self.model, layer, block, h)
                widths = {int(v.shape[1]) for v in h.values()}
                out.append((widths.pop() if widths else 0, [t for t in self.ntypes if t in h]))
        except (RuntimeError, ValueError) as e:  # a shape mismatch, before any request
            emb = f", node embedding dim {self.emb.dim}" if self.emb is not None else ""
            raise ConfigError(
                f"the model does not fit the servers' inputs (feature dim "
                f"{self.info.feat_dim}{emb}): {str(e).splitlines()[0]}; a model trained "
                "with --node-emb-dim needs its node embedding as well") from e
        if self.predict not in out[-1][1]:
            raise ConfigError(f"the model gives no output for node type {self.predict!r}, "
                              "the one the labels are of")
        return out

    def out_dims(self) -> list[int]:
        """Each layer's output width (see :meth:`plan`)."""
        return [w for w, _ in self.plan()]

    # ------------------------------------------------------------------ layers
    @torch.no_grad()
    def run(self, splits: dict[str, Tensor], keep_outputs: bool) -> InferenceResult:
        """Every layer; the task's metric (accuracy, or ROC-AUC for multi-label sets) over
        ``splits['valid']`` and ``['test']`` (global ids of ``predict_ntype``).

        With ``keep_outputs`` the last layer covers every node of ``predict_ntype`` and the
        logits and embeddings stay on the servers (``result.kept``; free them with
        :meth:`drop`); without, the last layer covers only the valid and test nodes and every
        tensor is freed."""
        was_training = self.model.training
        self.model.eval()
        scores = _Scores(self.task.binary, splits)
        layer_s = []
        try:
            plan = self.plan()
            groups = type_ranges(self.pool, self.info)
            for layer in range(len(plan)):
                t0 = time.perf_counter()
                self._run_layer(layer, plan, groups, splits, keep_outputs, scores)
                layer_s.append(time.perf_counter() - t0)
            valid, test = scores.result(self.world_size, self.rank, plan[-1][0], self.device)
        except BaseException:
            self._abandon()
            raise
        finally:
            self.model.train(was_training)
        result = InferenceResult(valid=valid, test=test, layer_s=layer_s,
                                 num_nodes=int(self.info.num_nodes),
                                 metric=self.task.eval_metric)
        if keep_outputs:
            result.kept = {("logits" if k == "logits" else "emb"): t
                           for k, t in self.tensors.items()}
        else:
            self.drop()
        return result

    def _run_layer(self, layer: int, plan: list[tuple[int, list[str]]],
                   groups: list[list[tuple[str, int, int]]], splits: dict[str, Tensor],
                   keep_outputs: bool, scores: _Scores) -> None:
        last = layer == len(plan) - 1
        width, produced = plan[layer]
        src = self.tensors[f"h{layer - 1}"] if layer else self.features
        present = set(plan[layer - 1][1]) if layer else set(self.ntypes)
        dst = None
        if not last:
            dst = self._tensor(f"h{layer}", width)
        elif keep_outputs:
            dst = self._tensor("logits", width)
        nodes = None if keep_outputs or not last else _eval_nodes(splits)
        wanted = {self.predict} if last else set(produced)
        batches = node_batches(groups, self.batch_size, self.rank, self.world_size, nodes,
                               wanted)
        blocks = stream_blocks(self.pool, batches, with_label=last,
                               max_inflight=self.max_inflight)
        for mfg in self._bar(blocks, len(batches), layer):
            out = self._forward(layer, mfg, src, present)[mfg.seed_ntype]
            if last:
                scores.add(mfg.output_nodes, out, mfg.label)  # type: ignore[arg-type]
            if dst is not None:
                dst.write(mfg.output_nodes, out.float().cpu())
        _barrier(self.world_size)  # layer + 1 reads what every rank wrote
        if layer and not (keep_outputs and last):
            self._release(f"h{layer - 1}")  # the embeddings stay when the outputs are kept

    def _forward(self, layer: int, mfg: HeteroMFG, src, present: set[str]
                 ) -> dict[str, Tensor]:
        ids = {t: v for t, v in mfg.input_nodes.items() if t in present}
        if layer:
            h = {t: v.to(self.device) for t, v in _read_rows(src, ids).items()}
        else:  # the served features (not of embedding types), then training's inputs
            from trainer_client.typed import typed_inputs

            feats = _read_rows(src, {t: v for t, v in ids.items() if t not in self.emb_types})
            for t, x in feats.items():
                mfg.blocks[0].srcdata[t]["feat"] = x
            h = {t: v.to(self.device) for t, v in typed_inputs(mfg, self.emb, self.info).items()}
        return forward_layer(self.model, layer, mfg[0].to(self.device), h)

    def _bar(self, blocks: Iterator[HeteroMFG], total: int, layer: int) -> Iterator[HeteroMFG]:
        if not self.progress:
            return blocks
        from tqdm import tqdm

        return tqdm(blocks, total=total, leave=False, dynamic_ncols=True,
                    desc=f"inference layer {layer}")


def _eval_nodes(splits: dict[str, Tensor]) -> Tensor:
    empty = torch.empty(0, dtype=torch.int64)
    return torch.unique(torch.cat([splits.get("valid", empty), splits.get("test", empty)]))


def full_graph_eval(model: nn.Module, pool, info, splits: dict[str, Tensor], *,
                    batch_size: int, device, rank: int, world_size: int, progress: bool,
                    max_message_bytes: int = 512 << 20, emb=None) -> dict[str, float]:
    """``--eval full``: the task's metric (``valid_acc``/``test_acc``, or ``valid_rocauc``/
    ``test_rocauc`` for multi-label sets) of ``model``'s full-graph output (layer-wise
    inference, the last layer over the valid and test nodes only), homogeneous or typed sets
    and models alike; ``emb``: the run's server-held node embedding, if any. Every rank calls
    it; the result is the same on all. The model's train/eval mode is kept."""
    was = emb.training if emb is not None else False
    try:
        job = LayerwiseInference(model, pool, info, batch_size=batch_size, device=device,
                                 rank=rank, world_size=world_size, progress=progress,
                                 max_message_bytes=max_message_bytes,
                                 emb=emb.eval() if emb is not None else None)
        return job.run(splits, keep_outputs=False).metrics()
    finally:
        if emb is not None:
            emb.train(was)


# ---------------------------------------------------------------------------- files
def _write_npy(path: Path, shape: tuple[int, ...], dtype, fill) -> dict:
    """Write ``path`` chunk by chunk (``fill(array)``) through a memory map: a part's
    outputs never need to fit in memory twice. Returns its index entry."""
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    fill(arr)
    arr.flush()
    del arr
    return {"shape": list(shape), "dtype": np.dtype(dtype).name}


def _fill_rows(t: DistNodeTensor, lo: int, hi: int, chunk: int):
    """A ``fill`` for :func:`_write_npy`: rows ``[lo, hi)`` of ``t``, ``chunk`` at a time."""
    def fill(arr) -> None:
        for s in range(lo, hi, chunk):
            arr[s - lo:min(s + chunk, hi) - lo] = t.read(torch.arange(s, min(s + chunk, hi))).numpy()
    return fill


def export_part(result: InferenceResult, out_dir: Path, part: int, lo: int, hi: int,
                orig_ids: np.ndarray | None, max_message_bytes: int) -> dict:
    """Write ``part-K/{logits,pred,emb,orig_ids}.npy`` for global ids ``[lo, hi)`` from the
    node tensors kept on the servers; returns the part's index entry (file paths relative to
    ``out_dir``). Without ``orig_ids`` the global ids are written in their place."""
    d = out_dir / f"part-{part}"
    d.mkdir(parents=True, exist_ok=True)
    n = hi - lo
    widths = {k: int(t.row_shape[0]) for k, t in result.kept.items()}
    chunk = chunk_rows(max_message_bytes, 4 * max(widths.values()))

    def fill_pred(arr) -> None:
        logits = np.load(d / "logits.npy", mmap_mode="r")
        for s in range(0, n, chunk):
            arr[s:s + chunk] = logits[s:s + chunk].argmax(1)

    def fill_ids(arr) -> None:
        arr[:] = orig_ids if orig_ids is not None else np.arange(lo, hi, dtype=np.int64)

    files = {"logits": ((n, widths["logits"]), np.float32,
                        _fill_rows(result.kept["logits"], lo, hi, chunk)),
             "pred": ((n,), np.int64, fill_pred)}
    if "emb" in result.kept:
        files["emb"] = ((n, widths["emb"]), np.float32,
                        _fill_rows(result.kept["emb"], lo, hi, chunk))
    files["orig_ids"] = ((n,), np.int64, fill_ids)
    entry: dict = {"part": part, "global_ids": [lo, hi], "num_nodes": n, "files": {}}
    for name, (shape, dtype, fill) in files.items():
        entry["files"][name] = {"path": f"part-{part}/{name}.npy",
                                **_write_npy(d / f"{name}.npy", shape, dtype, fill)}
    return entry
