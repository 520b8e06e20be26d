"""The seed tutorial's DGL pipeline, as the baseline every mfgserve figure is divided by.

The pipeline is DGL's stock mini-batch recipe on one in-memory graph::

    DataLoader(g, train_ids, NeighborSampler(fanouts), batch_size, shuffle=True,
               drop_last=False, num_workers=W)  ->  GraphSAGE of dgl.nn.SAGEConv("mean")

:func:`load_full_graph` rebuilds that graph from an mfgserve partition set (all parts, global
ids), so both systems see exactly the same nodes, edges, features, labels and splits. The
model (:class:`DGLGraphSAGE`) is the seed tutorial's at dropout 0, with mfgserve's initial
weights and dropout module; Adam lr 3e-3, weight decay 5e-4, as mfgserve's trainer.

* :func:`train_dgl`: one process (the baseline of the end-to-end ratio);
* :func:`train_dgl_ddp`: DGL's multi-process recipe on one node (``use_ddp=True`` loaders,
  DistributedDataParallel over gloo), each process a subprocess running this module;
* :func:`sample_only_dgl`: the DataLoader without a model (sample + gather).

Throughput definitions (the same as the mfgserve trainer's summary):

* ``seeds_per_s`` = training seeds / ``train_s``; ``train_s`` sums the training loops of all
  epochs (sampling + feature gather + forward/backward/step), evaluation excluded.
* ``batches_per_s`` = training batches / ``train_s``.
* ``test_acc`` is the test accuracy at the epoch of best validation accuracy; valid and test
  are sampled with the same fanouts as training.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.alloc import DEFAULT_RETAIN_MB, retain_freed_memory
from common.dgl_compat import import_dgl
from partition.layout import PartitionSetMeta, load_partition

_REPO = Path(__file__).resolve().parents[1]


@dataclass
class FullGraph:
    """The whole graph of a partition set, in global ids, ready for DGL."""

    g: object  # dgl.DGLGraph with ndata "feat" (float32 [N, D]) and "label" (int64 [N])
    train: Tensor
    valid: Tensor
    test: Tensor
    num_classes: int
    feat_dim: int
    dataset: str
    load_s: float


def _feat_as_float32(arr: np.ndarray, feat_dtype: str) -> Tensor:
    t = torch.from_numpy(np.array(arr))  # a writable in-memory copy of the mmap
    if feat_dtype == "bfloat16":  # stored as uint16 bit patterns
        t = t.view(torch.int16).view(torch.bfloat16)
    return t.float()


def load_full_graph(parts_dir: str | Path) -> FullGraph:
    """Concatenate every part's CSC (in-edges of owned nodes) into one DGLGraph.

    Parts own contiguous global id ranges in order, so the global CSC is the parts' indptr
    arrays shifted and joined, and ``indices`` (already global source ids) concatenated.
    Edge ``src = indices``, ``dst = owned node``; features and labels are indexed by global id.
    """
    t0 = time.perf_counter()
    dgl = import_dgl()
    meta = PartitionSetMeta.load(parts_dir)
    # multiclass: int64 classes; binary (multi-label): float32 [n, num_tasks], NaN unknown
    label_dtype = np.int64 if meta.task_type == "multiclass" else np.float32
    indptrs, indices, feats, labels = [], [], [], []
    splits: dict[str, list[np.ndarray]] = {"train": [], "valid": [], "test": []}
    edge_base = 0
    for p in range(meta.num_parts):
        part = load_partition(parts_dir, p, mmap=True)
        ip = np.asarray(part.indptr, dtype=np.int64)
        indptrs.append(ip[:-1] + edge_base if p < meta.num_parts - 1 else ip + edge_base)
        edge_base += int(ip[-1])
        indices.append(np.asarray(part.indices, dtype=np.int64))
        feats.append(_feat_as_float32(part.feat, meta.feat_dtype))
        labels.append(torch.from_numpy(np.array(part.label, dtype=label_dtype)))
        for s in splits:
            splits[s].append(np.asarray(getattr(part, s), dtype=np.int64))
    indptr = torch.from_numpy(np.concatenate(indptrs))
    idx = torch.from_numpy(np.concatenate(indices))
    eids = torch.arange(idx.numel(), dtype=torch.int64)
    g = dgl.graph(("csc", (indptr, idx, eids)), num_nodes=meta.num_nodes, idtype=torch.int64)
    g.ndata["feat"] = torch.cat(feats) if len(feats) > 1 else feats[0]
    g.ndata["label"] = torch.cat(labels) if len(labels) > 1 else labels[0]
    split_t = {s: torch.from_numpy(np.concatenate(v)) for s, v in splits.items()}
    return FullGraph(g=g, train=split_t["train"], valid=split_t["valid"], test=split_t["test"],
                     num_classes=meta.num_classes, feat_dim=meta.feat_dim, dataset=meta.dataset,
                     load_s=time.perf_counter() - t0)


class DGLGraphSAGE(nn.Module):
    """The seed tutorial's model on DGL: ``dgl.nn.SAGEConv(.., "mean")`` layers, ReLU between
    them and nothing after the last; with ``dropout`` > 0, dropout after each ReLU.

    It is the same model as mfgserve's :class:`trainer_client.model.GraphSAGE`, so that a
    ratio measures the pipelines, not the models:

    * initialisation: DGL's own scheme (``SAGEConv.reset_parameters``: xavier-uniform with
      ReLU gain on both weights, ``nn.Linear``'s default uniform on the bias) is mfgserve's
      too, but the two constructors draw their parameters in a different order. The weights
      are therefore those of a ``GraphSAGE`` built from the RNG state this constructor starts
      from (same seed, same values), and the RNG ends where that constructor leaves it;
    * dropout: :class:`trainer_client.model.Dropout`, the module mfgserve uses (the same mask
      code, so neither side's dropout kernel decides the ratio). At ``dropout=0`` it is the
      identity on both sides: ``nn.Dropout(0)`` returns its input tensor (no copy, no
      autograd node), and so does DGL's internal ``feat_drop`` (p=0).
    """

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int,
                 dropout: float = 0.0):
        super().__init__()
        from trainer_client.model import Dropout, GraphSAGE, layer_dims

        rng = torch.get_rng_state()
        dglnn = import_dgl().nn
        dims = layer_dims(in_feats, hidden, num_classes, num_layers)
        self.layers = nn.ModuleList(dglnn.SAGEConv(a, b, "mean")
                                    for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.dropout = Dropout(dropout)
        torch.set_rng_state(rng)
        ref = GraphSAGE(in_feats, hidden, num_classes, num_layers, dropout)
        self.load_state_dict(ref.state_dict(), strict=True)

    def forward(self, blocks, x: Tensor) -> Tensor:
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks, strict=True)):
            h = layer(block, h)
            if i != len(self.layers) - 1:
                h = self.dropout(F.relu(h))
        return h


@contextmanager
def torch_and_dgl_threads(num_threads: int | None):
    """``num_threads`` torch and DGL (OpenMP) threads inside the block, the previous counts
    after it; None or 0 leaves both at their defaults."""
    if not num_threads:
        yield
        return
    dgl = import_dgl()
    before = torch.get_num_threads(), dgl.utils.get_num_threads()
    torch.set_num_threads(num_threads)
    dgl.utils.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        dgl.utils.set_num_threads(before[1])


def _as_graph(graph: str | Path | FullGraph) -> FullGraph:
    return graph if isinstance(graph, FullGraph) else load_full_graph(graph)


def _loader(fg: FullGraph, seeds: Tensor, fanouts: list[int], batch_size: int, shuffle: bool,
            num_workers: int, use_ddp: bool = False, ddp_seed: int = 0):
    dgl = import_dgl()
    sampler = dgl.dataloading.NeighborSampler(
        list(fanouts), prefetch_node_feats=["feat"], prefetch_labels=["label"])
    return dgl.dataloading.DataLoader(
        fg.g, seeds, sampler, batch_size=batch_size, shuffle=shuffle, drop_last=False,
        num_workers=num_workers, persistent_workers=num_workers > 0, use_ddp=use_ddp,
        ddp_seed=ddp_seed)


@torch.no_grad()
def _evaluate(model: nn.Module, loader, max_batches: int | None) -> float:
    model.eval()
    correct = total = 0
    for i, (_, _, blocks) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        logits = model(blocks, blocks[0].srcdata["feat"])
        labels = blocks[-1].dstdata["label"]
        correct += int((logits.argmax(1) == labels).sum())
        total += labels.numel()
    return correct / max(total, 1)


def _train_epoch(model: nn.Module, opt, loader, max_batches: int | None) -> dict:
    """One training pass: {"seeds", "batches", "train_s", "loss"} (mean loss)."""
    model.train()
    loss_sum, n, seeds = 0.0, 0, 0
    t0 = time.perf_counter()
    for i, (_, output_nodes, blocks) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        logits = model(blocks, blocks[0].srcdata["feat"])
        loss = F.cross_entropy(logits, blocks[-1].dstdata["label"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += float(loss.detach())
        n += 1
        seeds += output_nodes.numel()
    return {"seeds": seeds, "batches": n, "train_s": time.perf_counter() - t0,
            "loss": loss_sum / max(n, 1)}


def train_dgl(parts_dir: str | Path | FullGraph, fanouts: list[int], batch_size: int,
              epochs: int, hidden: int = 256, num_workers: int = 0,
              max_batches: int | None = None, seed: int = 0, dropout: float = 0.0,
              lr: float = 3e-3, weight_decay: float = 5e-4,
              num_threads: int | None = None, device: str = "cpu") -> dict:
    """Train the tutorial GraphSAGE with DGL's DataLoader; returns throughput and accuracy.

    ``device="cuda"``: the GPU form of the recipe (:func:`_train_epoch_device`); DGL samples
    and gathers on the CPU as before, the model computes on the GPU.

    ``dropout`` 0 is the seed tutorial's model (see :class:`DGLGraphSAGE`); Adam with ``lr``
    and ``weight_decay`` (mfgserve's trainer defaults). ``num_threads`` sets torch's and DGL's
    thread counts for the run (None: their defaults). ``max_batches`` caps the batches of
    every training epoch and of every evaluation pass (accuracy is then measured on that
    many batches of valid / test).
    """
    dgl = import_dgl()
    fg = _as_graph(parts_dir)
    dev = torch.device(device)
    with torch_and_dgl_threads(num_threads):
        torch.manual_seed(seed)
        dgl.seed(seed)
        if dev.type == "cpu":
            model = DGLGraphSAGE(fg.feat_dim, hidden, fg.num_classes, len(fanouts), dropout)
            opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
        else:
            model, opt = _device_model(fg, hidden, len(fanouts), dropout, lr, weight_decay, dev)
        train_loader = _loader(fg, fg.train, fanouts, batch_size, True, num_workers)
        eval_loaders = {s: _loader(fg, getattr(fg, s), fanouts, batch_size, False, num_workers)
                        for s in ("valid", "test") if getattr(fg, s).numel() > 0}
        threads = torch.get_num_threads()
        train_s = 0.0
        seeds = batches = 0
        best = {"valid_acc": -1.0, "test_acc": 0.0, "epoch": -1}
        loss_mean = None
        for epoch in range(epochs):
            if dev.type == "cpu":
                ep = _train_epoch(model, opt, train_loader, max_batches)
            else:
                ep = _train_epoch_device(model, opt, train_loader, max_batches, dev)
            train_s += ep["train_s"]
            seeds += ep["seeds"]
            batches += ep["batches"]
            loss_mean = ep["loss"]
            accs = {s: (_evaluate(model, ld, max_batches) if dev.type == "cpu"
                        else _evaluate_device(model, ld, max_batches, dev))
                    for s, ld in eval_loaders.items()}
            if accs.get("valid", 0.0) > best["valid_acc"]:
                best = {"valid_acc": accs.get("valid", 0.0), "test_acc": accs.get("test", 0.0),
                        "epoch": epoch}
    return {
        "num_workers": num_workers,
        "dropout": dropout,
        "device": str(dev),
        "num_threads": threads,
        "epochs": epochs,
        "batches": batches,
        "seeds": seeds,
        "train_s": round(train_s, 3),
        "seeds_per_s": round(seeds / max(train_s, 1e-9), 1),
        "batches_per_s": round(batches / max(train_s, 1e-9), 3),
        "valid_acc": round(best["valid_acc"], 4),
        "test_acc": round(best["test_acc"], 4),
        "best_epoch": best["epoch"],
        "final_loss": round(loss_mean, 4) if loss_mean is not None else None,
        "max_batches": max_batches,
    }


# ------------------------------------------------------------------------------ GPU


def _device_model(fg: FullGraph, hidden: int, num_layers: int, dropout: float, lr: float,
                  weight_decay: float, device: torch.device):
    """The model and optimizer of the GPU recipe.

    DGL's PyPI wheels are CPU builds (no CUDA kernels: ``dgl.nn.SAGEConv`` cannot take a CUDA
    block), so on a GPU the DGL side computes with mfgserve's plain-torch
    :class:`trainer_client.model.GraphSAGE`: the same layers, initial weights (the same RNG
    state, as :class:`DGLGraphSAGE` copies them) and dropout, and the trainer's optimizer
    (``build_optimizer``: fused Adam). Both sides then run identical model code on the GPU,
    and a ratio measures the pipelines feeding it."""
    from trainer_client.model import GraphSAGE
    from trainer_client.models import build_optimizer

    model = GraphSAGE(fg.feat_dim, hidden, fg.num_classes, num_layers, dropout).to(device)
    return model, build_optimizer(model.parameters(), lr, weight_decay)


def _blocks_to_device(blocks, device: torch.device, stream) -> tuple:
    """One DGL batch on ``device``: its blocks as :class:`common.mfg.Block` s (DGL's CSC of
    each block, which its own GPU kernels would build too), the input features and the
    labels, copied from pinned memory on ``stream`` (None: the current stream); returns
    ``(blocks, x, y, event)`` with ``event`` marking the end of the copies."""
    from common.mfg import Block

    mine = []
    for blk in blocks:
        indptr, indices, _ = blk.adj_tensors("csc")
        mine.append(Block(indptr, indices, blk.num_src_nodes(), blk.num_dst_nodes()))
    x, y = blocks[0].srcdata["feat"], blocks[-1].dstdata["label"]
    with torch.cuda.stream(stream):
        out = ([b.pin_memory().to(device, non_blocking=True) for b in mine],
               x.pin_memory().to(device, non_blocking=True),
               y.pin_memory().to(device, non_blocking=True))
    event = torch.cuda.Event()
    event.record(stream)
    return (*out, event)


def _use_on_current(batch: tuple, device: torch.device) -> tuple:
    """Make the current stream wait for ``batch``'s copies and tell the caching allocator
    that its tensors (made on the copy stream) are used on the current one."""
    blocks, x, y, event = batch
    current = torch.cuda.current_stream(device)
    current.wait_event(event)
    for t in [x, y] + [t for b in blocks for t in (b.indptr, b.indices)]:
        t.record_stream(current)
    return blocks, x, y


def _train_epoch_device(model: nn.Module, opt, loader, max_batches: int | None,
                        device: torch.device) -> dict:
    """:func:`_train_epoch` with the model on a GPU, pipelined as DGL's GPU DataLoader does
    (``use_alternate_streams``): batch i's compute is queued on the GPU, then batch i+1 is
    sampled on the CPU and copied on a side stream while the GPU computes, then the loss of
    batch i is read (one synchronisation per step, as the CPU loop and mfgserve's trainer)."""
    model.train()
    stream = torch.cuda.Stream(device)
    it = iter(loader)

    def fetch(i: int):
        if max_batches is not None and i >= max_batches:
            return None
        try:
            _, output_nodes, blocks = next(it)
        except StopIteration:
            return None
        return _blocks_to_device(blocks, device, stream), output_nodes.numel()

    loss_sum, n, seeds = 0.0, 0, 0
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    cur = fetch(0)
    while cur is not None:
        batch, num_seeds = cur
        blocks, x, y = _use_on_current(batch, device)
        logits = model(blocks, x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        n += 1
        cur = fetch(n)  # sampled on the CPU while the GPU computes batch n-1
        loss_sum += float(loss.detach())
        seeds += num_seeds
    torch.cuda.synchronize(device)
    return {"seeds": seeds, "batches": n, "train_s": time.perf_counter() - t0,
            "loss": loss_sum / max(n, 1)}


@torch.no_grad()
def _evaluate_device(model: nn.Module, loader, max_batches: int | None,
                     device: torch.device) -> float:
    model.eval()
    correct = total = 0
    for i, (_, _, blocks) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        mine, x, y = _use_on_current(_blocks_to_device(blocks, device, None), device)
        correct += int((model(mine, x).argmax(1) == y).sum())
        total += y.numel()
    return correct / max(total, 1)


# ------------------------------------------------------------------------------ DDP


def _ddp_child(cfg: dict) -> int:
    """One rank of :func:`train_dgl_ddp` (run as ``python -m benchmarks.dgl_pipeline
    --ddp-child JSON``): DGL's multi-process recipe (DataLoader ``use_ddp=True``: this rank
    takes its share of the training seeds; DistributedDataParallel over gloo). Writes its
    figures as JSON to ``cfg["out"]``."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dgl = import_dgl()
    retain_freed_memory(cfg["malloc_retain_mb"], f"DGL DDP rank {cfg['rank']}")
    torch.set_num_threads(cfg["num_threads"])
    dgl.utils.set_num_threads(cfg["num_threads"])
    torch.set_float32_matmul_precision(cfg.get("matmul_precision", "highest"))
    t0 = time.perf_counter()
    fg = load_full_graph(cfg["parts"])
    load_s = time.perf_counter() - t0
    dist.init_process_group("gloo", init_method=f"file://{cfg['init_file']}",
                            rank=cfg["rank"], world_size=cfg["world_size"],
                            timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
    try:
        torch.manual_seed(cfg["seed"])
        dgl.seed(cfg["seed"])
        model = DGLGraphSAGE(fg.feat_dim, cfg["hidden"], fg.num_classes, len(cfg["fanouts"]),
                             cfg["dropout"])
        net = DDP(model)
        opt = torch.optim.Adam(net.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
        loader = _loader(fg, fg.train, cfg["fanouts"], cfg["batch_size"], True,
                         cfg["num_workers"], use_ddp=True, ddp_seed=cfg["seed"])
        totals = {"seeds": 0, "batches": 0, "train_s": 0.0, "loss": None}
        for epoch in range(cfg["epochs"]):
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            dist.barrier()  # every rank starts its timed loop together
            ep = _train_epoch(net, opt, loader, cfg["max_batches"])
            for k in ("seeds", "batches", "train_s"):
                totals[k] += ep[k]
            totals["loss"] = ep["loss"]
        dist.barrier()
        res = {"rank": cfg["rank"], "load_s": round(load_s, 3),
               "num_threads": torch.get_num_threads(), **totals}
        Path(cfg["out"]).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()
    return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    for pr in procs:
        if pr.poll() is None:
            pr.terminate()
    deadline = time.monotonic() + 10
    for pr in procs:
        try:
            pr.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pr.kill()
            pr.wait()


def train_dgl_ddp(parts_dir: str | Path, fanouts: list[int], batch_size: int, epochs: int,
                  hidden: int = 256, nprocs: int = 2, num_workers: int = 0,
                  max_batches: int | None = None, seed: int = 0, dropout: float = 0.0,
                  lr: float = 3e-3, weight_decay: float = 5e-4,
                  num_threads: int | None = None, timeout_s: float = 1800.0,
                  malloc_retain_mb: int = DEFAULT_RETAIN_MB,
                  matmul_precision: str = "highest") -> dict:
    """DGL's multi-process training on one node: ``nprocs`` processes (subprocesses of this
    one, each loading the graph itself), DistributedDataParallel over gloo, each with
    DataLoader ``use_ddp=True`` (its 1/nprocs of the training seeds) and a batch of
    ``batch_size / nprocs`` seeds, so the total batch per step is ``batch_size``.

    ``num_threads`` per process (default: cores / nprocs, as worker-mode gives each of its
    trainers); ``matmul_precision``: each process's ``torch.set_float32_matmul_precision``.
    Figures as worker-mode's trainer reports them: ``seeds_per_s`` = training seeds over all
    processes / the processes' mean training time (graph loading excluded).
    Raises RuntimeError naming the process when one exits non-zero or the whole run takes
    longer than ``timeout_s``.
    """
    if nprocs < 1 or batch_size % nprocs:
        raise ValueError(f"batch size {batch_size} does not split evenly over {nprocs} "
                         "processes: choose --batch-size divisible by the process count")
    threads = num_threads or max(1, (os.cpu_count() or 1) // nprocs)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="dgl-ddp-") as tmp:
        outs = [Path(tmp, f"rank{r}.json") for r in range(nprocs)]
        errs = [Path(tmp, f"rank{r}.stderr") for r in range(nprocs)]
        t0 = time.perf_counter()
        try:
            for r in range(nprocs):
                cfg = {"parts": str(parts_dir), "rank": r, "world_size": nprocs,
                       "init_file": str(Path(tmp, "store")), "out": str(outs[r]),
                       "fanouts": list(fanouts), "batch_size": batch_size // nprocs,
                       "epochs": epochs, "hidden": hidden, "num_workers": num_workers,
                       "max_batches": max_batches, "seed": seed, "dropout": dropout,
                       "lr": lr, "weight_decay": weight_decay, "num_threads": threads,
                       "timeout_s": timeout_s, "malloc_retain_mb": malloc_retain_mb,
                       "matmul_precision": matmul_precision}
                with open(errs[r], "w") as err:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.dgl_pipeline", "--ddp-child",
                         json.dumps(cfg)], stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL, stderr=err, cwd=_REPO))
            deadline = time.monotonic() + timeout_s
            while any(pr.poll() is None for pr in procs):
                failed = [r for r, pr in enumerate(procs) if pr.poll() not in (None, 0)]
                if failed:
                    break  # the others would wait for it in a collective
                if time.monotonic() > deadline:
                    raise RuntimeError(f"DGL DDP ({nprocs} processes) did not finish within "
                                       f"{timeout_s:.0f}s (raise --worker-timeout-s)")
                time.sleep(0.1)
        finally:
            _stop(procs)
        wall = time.perf_counter() - t0
        codes = [pr.returncode for pr in procs]
        for r, code in enumerate(codes):
            if code != 0:
                tail = "\n".join(errs[r].read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"DGL DDP rank {r} exited with code {code} (exit codes "
                                   f"{codes}); its last stderr lines:\n{tail}")
        ranks = [json.loads(o.read_text()) for o in outs]
    seeds = sum(x["seeds"] for x in ranks)
    batches = sum(x["batches"] for x in ranks)
    mean_s = sum(x["train_s"] for x in ranks) / nprocs
    return {
        "num_procs": nprocs,
        "backend": "gloo",
        "per_process_batch_size": batch_size // nprocs,
        "total_batch_size": batch_size,
        "num_workers": num_workers,
        "num_threads_per_proc": threads,
        "dropout": dropout,
        "epochs": epochs,
        "seeds": seeds,
        "batches": batches,
        "train_s": round(mean_s, 3),
        "train_s_max": round(max(x["train_s"] for x in ranks), 3),
        "seeds_per_s": round(seeds / max(mean_s, 1e-9), 1),
        "batches_per_s": round(batches / nprocs / max(mean_s, 1e-9), 3),
        "final_loss": round(sum(x["loss"] for x in ranks) / nprocs, 4)
        if all(x["loss"] is not None for x in ranks) else None,
        "max_batches": max_batches,
        "ranks": ranks,
        "exit_codes": codes,
        "subprocess_wall_s": round(wall, 3),
    }


def sample_only_dgl(parts_dir: str | Path | FullGraph, fanouts: list[int], batch_size: int,
                    num_batches: int, num_workers: int = 0, warmup: int = 2,
                    seed: int = 0, num_threads: int | None = None) -> dict:
    """Iterate DGL's DataLoader over shuffled training seeds: sample + gather, no model.

    Each batch's input features and seed labels are materialised (``blocks[0].srcdata
    ["feat"]`` / ``blocks[-1].dstdata["label"]``, i.e. ``g.ndata[...][ids]``). The first
    ``warmup`` batches (worker start-up, first touches) are not timed. Epochs restart as
    needed to reach ``num_batches``. ``num_threads``: torch's and DGL's threads (None: their
    defaults).
    """
    with torch_and_dgl_threads(num_threads):
        return _sample_only(_as_graph(parts_dir), fanouts, batch_size, num_batches,
                            num_workers, warmup, seed)


def _sample_only(fg: FullGraph, fanouts: list[int], batch_size: int, num_batches: int,
                 num_workers: int, warmup: int, seed: int) -> dict:
    dgl = import_dgl()
    torch.manual_seed(seed)
    dgl.seed(seed)
    loader = _loader(fg, fg.train, fanouts, batch_size, True, num_workers)
    done = seeds = input_nodes_total = feat_bytes = 0
    seen = 0
    t0 = time.perf_counter()
    while done < num_batches:
        for input_nodes, output_nodes, blocks in loader:
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            seen += 1
            if seen <= warmup:
                t0 = time.perf_counter()  # timing starts after the warm-up batches
                continue
            done += 1
            seeds += output_nodes.numel()
            input_nodes_total += input_nodes.numel()
            feat_bytes += x.numel() * x.element_size() + y.numel() * y.element_size()
            if done >= num_batches:
                break
    elapsed = time.perf_counter() - t0
    return {
        "num_workers": num_workers,
        "batches": done,
        "seeds": seeds,
        "elapsed_s": round(elapsed, 3),
        "batches_per_s": round(done / max(elapsed, 1e-9), 3),
        "seeds_per_s": round(seeds / max(elapsed, 1e-9), 1),
        "input_nodes_per_batch": round(input_nodes_total / max(done, 1), 1),
        "feat_mb_per_s": round(feat_bytes / max(elapsed, 1e-9) / 1e6, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dgl_pipeline",
        description="Internal: one rank of train_dgl_ddp (benchmarks.run's ddp step starts "
                    "these; run benchmarks.run, not this).")
    p.add_argument("--ddp-child", required=True, metavar="JSON",
                   help="the rank's settings as a JSON object (written by train_dgl_ddp)")
    args = p.parse_args(argv)
    return _ddp_child(json.loads(args.ddp_child))


if __name__ == "__main__":
    sys.exit(main())
