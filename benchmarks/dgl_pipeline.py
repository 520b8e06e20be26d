"""The seed tutorial's DGL pipeline, as the baseline every mfgserve figure is divided by.

The pipeline is DGL's stock mini-batch recipe on one in-memory graph::

    DataLoader(g, train_ids, NeighborSampler(fanouts), batch_size, shuffle=True,
               drop_last=False, num_workers=W)  ->  GraphSAGE of dgl.nn.SAGEConv("mean")

:func:`load_full_graph` rebuilds that graph from an mfgserve partition set (all parts, global
ids), so both systems see exactly the same nodes, edges, features, labels and splits.

Throughput definitions (the same as the mfgserve trainer's summary):

* ``seeds_per_s`` = training seeds / ``train_s``; ``train_s`` sums the training loops of all
  epochs (sampling + feature gather + forward/backward/step), evaluation excluded.
* ``batches_per_s`` = training batches / ``train_s``.
* ``test_acc`` is the test accuracy at the epoch of best validation accuracy; valid and test
  are sampled with the same fanouts as training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.dgl_compat import import_dgl
from partition.layout import PartitionSetMeta, load_partition


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
        labels.append(torch.from_numpy(np.array(part.label, dtype=np.int64)))
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
    """The tutorial model: mean-SAGEConv layers, ReLU + dropout between them."""

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int,
                 dropout: float = 0.5):
        super().__init__()
        dglnn = import_dgl().nn
        dims = [in_feats] + [hidden] * (num_layers - 1) + [num_classes]
        self.layers = nn.ModuleList(dglnn.SAGEConv(a, b, "mean")
                                    for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, x: Tensor) -> Tensor:
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks, strict=True)):
            h = layer(block, h)
            if i != len(self.layers) - 1:
                h = self.dropout(F.relu(h))
        return h


def _as_graph(graph: str | Path | FullGraph) -> FullGraph:
    return graph if isinstance(graph, FullGraph) else load_full_graph(graph)


def _loader(fg: FullGraph, seeds: Tensor, fanouts: list[int], batch_size: int, shuffle: bool,
            num_workers: int):
    dgl = import_dgl()
    sampler = dgl.dataloading.NeighborSampler(
        list(fanouts), prefetch_node_feats=["feat"], prefetch_labels=["label"])
    return dgl.dataloading.DataLoader(
        fg.g, seeds, sampler, batch_size=batch_size, shuffle=shuffle, drop_last=False,
        num_workers=num_workers, persistent_workers=num_workers > 0)


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


def train_dgl(parts_dir: str | Path | FullGraph, fanouts: list[int], batch_size: int,
              epochs: int, hidden: int = 256, num_workers: int = 0,
              max_batches: int | None = None, seed: int = 0, dropout: float = 0.5,
              lr: float = 3e-3, weight_decay: float = 5e-4) -> dict:
    """Train the tutorial GraphSAGE with DGL's DataLoader; returns throughput and accuracy.

    ``max_batches`` caps the batches of every training epoch and of every evaluation pass
    (accuracy is then measured on that many batches of valid / test).
    """
    dgl = import_dgl()
    fg = _as_graph(parts_dir)
    torch.manual_seed(seed)
    dgl.seed(seed)
    model = DGLGraphSAGE(fg.feat_dim, hidden, fg.num_classes, len(fanouts), dropout)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    train_loader = _loader(fg, fg.train, fanouts, batch_size, True, num_workers)
    eval_loaders = {s: _loader(fg, getattr(fg, s), fanouts, batch_size, False, num_workers)
                    for s in ("valid", "test") if getattr(fg, s).numel() > 0}
    train_s = 0.0
    seeds = batches = 0
    best = {"valid_acc": -1.0, "test_acc": 0.0, "epoch": -1}
    loss_mean = None
    for epoch in range(epochs):
        model.train()
        loss_sum, n = 0.0, 0
        t0 = time.perf_counter()
        for i, (_, output_nodes, blocks) in enumerate(train_loader):
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
        train_s += time.perf_counter() - t0
        batches += n
        loss_mean = loss_sum / max(n, 1)
        accs = {s: _evaluate(model, ld, max_batches) for s, ld in eval_loaders.items()}
        if accs.get("valid", 0.0) > best["valid_acc"]:
            best = {"valid_acc": accs.get("valid", 0.0), "test_acc": accs.get("test", 0.0),
                    "epoch": epoch}
    return {
        "num_workers": num_workers,
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


def sample_only_dgl(parts_dir: str | Path | FullGraph, fanouts: list[int], batch_size: int,
                    num_batches: int, num_workers: int = 0, warmup: int = 2,
                    seed: int = 0) -> dict:
    """Iterate DGL's DataLoader over shuffled training seeds: sample + gather, no model.

    Each batch's input features and seed labels are materialised (``blocks[0].srcdata
    ["feat"]`` / ``blocks[-1].dstdata["label"]``, i.e. ``g.ndata[...][ids]``). The first
    ``warmup`` batches (worker start-up, first touches) are not timed. Epochs restart as
    needed to reach ``num_batches``.
    """
    dgl = import_dgl()
    fg = _as_graph(parts_dir)
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
