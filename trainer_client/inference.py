"""Layer-wise full-neighbour inference over every node, through the sampler servers.

Why layer-wise (DistDGL's ``inference`` with DistTensor): a sampled forward pass gives a
noisy estimate of the model's output, and an exact full-neighbour pass per seed costs the
whole L-hop receptive field of every seed. Layer by layer, each node's layer-l output is
computed once from all its in-neighbours' layer-(l-1) outputs: the exact full-graph output,
at a cost linear in nodes plus edges per layer.

For layer l = 0..L-1, every node (each rank a share of every part's owned nodes, in batches
of ``batch_size``) gets a one-layer MFG with fanout -1 (all in-neighbours) from its part's
server, structure only. Layer 0 reads its inputs, by the block's source node ids, from the
served input features (NODE_DATA requests to the owning parts); layer l > 0 from the
server-held node tensor of layer l-1's outputs
(:class:`~trainer_client.node_tensors.DistNodeTensor`). ``model.forward_layer(l, block, h)``
in eval mode gives the seeds' outputs, written into layer l's node tensor. Ranks meet in a
barrier between layers: layer l+1 reads rows that every rank wrote in layer l.

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from common.errors import ConfigError
from common.logs import bars_allowed
from common.messages import MFGReply, NodeDataReply, NodeDataRequest, SampleRequest
from common.mfg import MFG, Block
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
    the ``pool``, a multi-label set: layer-wise inference measures accuracy)."""
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
    """Layer-wise inference measures accuracy: a multi-label set (binary tasks, ROC-AUC) is
    refused before any work, naming the evaluation to use."""
    from trainer_client.metrics import task_of

    task = task_of(info)
    if task.binary:
        raise ConfigError(
            f"full-graph inference measures accuracy, but dataset {info.dataset} has "
            f"{task.num_tasks} binary tasks evaluated by ROC-AUC; evaluate it with the "
            "trainer's sampled evaluation (--eval sampled)")


def refuse_typed(model_name: str, info, what: str = "the model") -> None:
    """Layer-wise inference runs homogeneous models over homogeneous sets only: a typed model
    (common.config.HETERO_MODEL_NAMES: rsage, hetero-sage) or a typed partition set is
    refused, naming what to use instead."""
    from common.config import HETERO_MODEL_NAMES

    ntypes = [t.name for t in getattr(info, "ntypes", [])]
    if model_name in HETERO_MODEL_NAMES or ntypes:
        where = (f"partition set {info.dataset} is typed (node types {ntypes})" if ntypes
                 else f"{what} is a typed model ({model_name})")
        raise ConfigError(f"layer-wise inference (--eval full, mfgserve-infer) does not run "
                          f"typed graphs or models yet: {where}; evaluate with --eval sampled "
                          "(sampled mini-batches of the valid/test seeds)")


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


# ---------------------------------------------------------------------------- batches
def node_batches(node_offsets: list[int], batch_size: int, rank: int, world_size: int,
                 nodes: Tensor | None = None) -> list[tuple[int, Tensor]]:
    """This rank's (part, seeds) batches: of every part, a near-equal share of its owned
    nodes (or of those among ``nodes``, sorted unique global ids), cut into batches of at most
    ``batch_size``; the parts' batches interleaved so that every server has work at once."""
    offsets = torch.tensor(node_offsets, dtype=torch.int64)
    per_part = []
    for p in range(offsets.numel() - 1):
        lo, hi = int(offsets[p]), int(offsets[p + 1])
        own = (torch.arange(lo, hi) if nodes is None
               else nodes[(nodes >= lo) & (nodes < hi)])
        share = torch.tensor_split(own, world_size)[rank]
        per_part.append([(p, b) for b in torch.split(share, batch_size) if b.numel()])
    out = []
    for i in range(max((len(b) for b in per_part), default=0)):
        out += [batches[i] for batches in per_part if i < len(batches)]
    return out


def stream_blocks(pool, batches: list[tuple[int, Tensor]], *, with_label: bool,
                  max_inflight: int) -> Iterator[MFG]:
    """One-layer full-neighbour MFGs of ``batches`` (structure, and the seeds' labels when
    asked; no features), in order, ``max_inflight`` requested ahead; requests still in flight
    when iteration stops are cancelled."""
    todo = deque(batches)
    inflight: deque = deque()
    try:
        while todo or inflight:
            while todo and len(inflight) < max_inflight:
                part, seeds = todo.popleft()
                inflight.append(pool.submit(part, SampleRequest(
                    seeds=seeds, fanouts=[-1], with_feat=False, with_label=with_label)))
            handle = inflight[0]
            reply = expect(pool.wait(handle), MFGReply, handle.channel.endpoint)
            inflight.popleft()
            yield MFG.of(reply.mfg)
    finally:
        for handle in inflight:
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


# ---------------------------------------------------------------------------- collectives
def _distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def _all_sum(values: list[int], world_size: int, device: torch.device) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=device)
    if _distributed(world_size):
        dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


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
    """Accuracies over the valid/test nodes (identical on every rank), seconds per layer,
    and, when the outputs were kept, the node tensors holding them on the servers
    (``logits``, and ``emb``: the last hidden layer's output, when the model has one)."""

    valid_acc: float
    test_acc: float
    layer_s: list[float]
    num_nodes: int
    kept: dict[str, DistNodeTensor] = field(default_factory=dict)


def _probe_block() -> Block:
    """One node with a self-loop: enough for ``forward_layer`` to show its output width."""
    return Block(torch.tensor([0, 1]), torch.tensor([0]), 1, 1)


class LayerwiseInference:
    """Layer-wise inference of ``model`` (with ``num_layers`` and ``forward_layer``) over the
    graph the ``pool``'s servers serve; ``info`` is their Pong. Every rank of a DDP job
    constructs it and calls :meth:`run` together, with the same arguments."""

    def __init__(self, model: nn.Module, pool, info, *, batch_size: int,
                 device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1,
                 max_inflight: int = 4, max_message_bytes: int = 512 << 20,
                 progress: bool = False):
        self.model = getattr(model, "module", model)  # a DDP wrapper's module
        self.pool, self.info = pool, info
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

    def out_dims(self) -> list[int]:
        """Each layer's output width, from one probe node (the model is in eval mode)."""
        dims, h = [], torch.zeros((1, self.info.feat_dim), device=self.device)
        try:
            for layer in range(int(self.model.num_layers)):
                h = self.model.forward_layer(layer, _probe_block().to(self.device), h)
                dims.append(int(h.shape[1]))
        except RuntimeError as e:  # a shape mismatch, before any request
            raise ConfigError(
                f"the model does not take the servers' {self.info.feat_dim} input features "
                f"({str(e).splitlines()[0]}); full-graph inference feeds the served features "
                "only (a model trained with --node-emb-dim also needs its node embeddings, "
                "which it does not read)") from e
        return dims

    # ------------------------------------------------------------------ layers
    @torch.no_grad()
    def run(self, splits: dict[str, Tensor], keep_outputs: bool) -> InferenceResult:
        """Every layer; accuracy over ``splits['valid']`` and ``['test']`` (global ids).

        With ``keep_outputs`` the last layer covers every node and the logits and embeddings
        stay on the servers (``result.kept``; free them with :meth:`drop`); without, the
        last layer covers only the valid and test nodes and every tensor is freed.

        Multi-label sets (binary tasks, ROC-AUC) are refused before any work: this measures
        accuracy."""
        refuse_multilabel(self.pool, self.info)
        was_training = self.model.training
        self.model.eval()
        counts = [0, 0, 0, 0]  # valid correct, valid total, test correct, test total
        layer_s = []
        try:
            dims = self.out_dims()
            for layer in range(len(dims)):
                t0 = time.perf_counter()
                self._run_layer(layer, dims, splits, keep_outputs, counts)
                layer_s.append(time.perf_counter() - t0)
        except BaseException:
            self._abandon()
            raise
        finally:
            self.model.train(was_training)
        c = _all_sum(counts, self.world_size, self.device)
        result = InferenceResult(valid_acc=c[0] / max(c[1], 1), test_acc=c[2] / max(c[3], 1),
                                 layer_s=layer_s, num_nodes=int(self.info.num_nodes))
        if keep_outputs:
            result.kept = {("logits" if k == "logits" else "emb"): t
                           for k, t in self.tensors.items()}
        else:
            self.drop()
        return result

    def _run_layer(self, layer: int, dims: list[int], splits: dict[str, Tensor],
                   keep_outputs: bool, counts: list[int]) -> None:
        last = layer == len(dims) - 1
        src = self.tensors[f"h{layer - 1}"] if layer else self.features
        dst = None
        if not last:
            dst = self._tensor(f"h{layer}", dims[layer])
        elif keep_outputs:
            dst = self._tensor("logits", dims[layer])
        nodes = None if keep_outputs or not last else _eval_nodes(splits)
        batches = node_batches(self.info.node_offsets, self.batch_size, self.rank,
                               self.world_size, nodes)
        blocks = stream_blocks(self.pool, batches, with_label=last,
                               max_inflight=self.max_inflight)
        for mfg in self._bar(blocks, len(batches), layer):
            out = self._forward(layer, mfg, src)
            if last:
                _count(mfg, out, splits, counts)
            if dst is not None:
                dst.write(mfg.output_nodes, out.float().cpu())
        _barrier(self.world_size)  # layer + 1 reads what every rank wrote
        if layer and not (keep_outputs and last):
            self._release(f"h{layer - 1}")  # the embeddings stay when the outputs are kept

    def _forward(self, layer: int, mfg: MFG, src: DistNodeTensor | ServedFeatures) -> Tensor:
        h = src.read(mfg.input_nodes).to(self.device)
        return self.model.forward_layer(layer, mfg[0].to(self.device), h)

    def _bar(self, blocks: Iterator[MFG], total: int, layer: int) -> Iterator[MFG]:
        if not self.progress:
            return blocks
        from tqdm import tqdm

        return tqdm(blocks, total=total, leave=False, dynamic_ncols=True,
                    desc=f"inference layer {layer}")


def _eval_nodes(splits: dict[str, Tensor]) -> Tensor:
    empty = torch.empty(0, dtype=torch.int64)
    return torch.unique(torch.cat([splits.get("valid", empty), splits.get("test", empty)]))


def _count(mfg: MFG, out: Tensor, splits: dict[str, Tensor], counts: list[int]) -> None:
    """Add the batch's correct/total predictions of valid and test nodes to ``counts``."""
    seeds = mfg.output_nodes
    pred = out.argmax(1).cpu()
    labels = mfg[-1].dstdata["label"].cpu()
    for i, split in enumerate(("valid", "test")):
        ids = splits.get(split)
        if ids is None or not ids.numel():
            continue
        mask = torch.isin(seeds, ids)
        counts[2 * i] += int((pred[mask] == labels[mask]).sum())
        counts[2 * i + 1] += int(mask.sum())


def full_graph_eval(model: nn.Module, pool, info, splits: dict[str, Tensor], *,
                    batch_size: int, device, rank: int, world_size: int, progress: bool,
                    max_message_bytes: int = 512 << 20) -> dict[str, float]:
    """``--eval full``: validation and test accuracy of ``model``'s full-graph output
    (layer-wise inference, the last layer over the valid and test nodes only). Every rank
    calls it; the result is the same on all. The model's train/eval mode is kept. Typed
    sets and models are refused (:func:`refuse_typed`)."""
    from trainer_client.hetero_model import TypedGNN

    refuse_typed(model.name if isinstance(model, TypedGNN) else "", info)
    job = LayerwiseInference(model, pool, info, batch_size=batch_size, device=device,
                             rank=rank, world_size=world_size, progress=progress,
                             max_message_bytes=max_message_bytes)
    result = job.run(splits, keep_outputs=False)
    return {"valid_acc": result.valid_acc, "test_acc": result.test_acc}


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
