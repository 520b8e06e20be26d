"""DGL reference for multi-label (ogbn-proteins-shaped) node classification, and the
comparison with mfgserve's worker mode on the same partition set.

The DGL side is DGL's own pipeline on the whole graph rebuilt from the partition set (every
part's CSC joined, global ids: the same nodes, edges, features, labels and splits mfgserve
serves)::

    DataLoader(g, train_ids, NeighborSampler(fanouts), batch_size, shuffle=True)
        -> GraphSAGE of dgl.nn.SAGEConv("mean") (benchmarks.dgl_pipeline.DGLGraphSAGE),
           one logit per task
    loss: binary cross-entropy with logits over the labelled (non-NaN) entries
    Adam (lr, weight decay), mfgserve's trainer defaults for every setting

and is evaluated as mfgserve's trainer evaluates: after every epoch, ROC-AUC over ALL the
valid / test predictions (sampled with the same fanouts) by
:func:`trainer_client.metrics.rocauc` (ogb's ``Evaluator('ogbn-proteins')`` for 112 tasks);
the reported test ROC-AUC is the one at the epoch of best validation ROC-AUC.

``python -m benchmarks.dgl_proteins --parts DIR`` prints one JSON line: the DGL run, and with
``--mfgserve`` also the worker-mode run (``deploy.worker_mode --parts DIR`` with the same
settings) and the difference of the two test ROC-AUCs.

Measured here (2 cores shared with other jobs; mfgserve defaults: fanouts 10,10, batch 1024,
hidden 256, dropout 0.5, Adam lr 3e-3 wd 5e-4, 10 epochs, seed 0; test ROC-AUC at the best
validation epoch)::

    partition-ogbn --dataset synthetic-proteins --num-nodes 30000 --raw-out /tmp/prot_a
    partition-ogbn --dataset-dir /tmp/prot_a --num-parts 1 --out /tmp/pp1
    python -m benchmarks.dgl_proteins --parts /tmp/pp1 --epochs 10 --mfgserve
        DGL 0.8731, mfgserve worker mode (1 part, 1 trainer) 0.8766: +0.0035
    partition-ogbn --dataset-dir /tmp/prot_a --num-parts 2 --out /tmp/pp2b
    worker-mode --parts /tmp/pp2b --num-trainers 2 --batch-size 512 --epochs 10
        mfgserve (2 parts, 2 trainers, 1024 seeds per step) 0.8770: +0.0039 vs DGL
    partition-ogbn --dataset synthetic-proteins --num-nodes 50000 --avg-degree 30 --seed 1
                   --raw-out /tmp/prot50 --num-parts 1 --out /tmp/pp50
    python -m benchmarks.dgl_proteins --parts /tmp/pp50 --epochs 10 --mfgserve
        DGL 0.8578, mfgserve 0.8584: +0.0006

The seconds and seeds/s it prints are not a speed comparison (the two runs are sequential on
a loaded machine, and evaluation is not timed alike); benchmarks/run.py measures speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.dgl_pipeline import DGLGraphSAGE, load_full_graph, torch_and_dgl_threads
from common.dgl_compat import import_dgl
from partition.layout import PartitionSetMeta
from trainer_client.metrics import Task, loss_fn, rocauc

_REPO = Path(__file__).resolve().parents[1]


def load_multilabel_graph(parts_dir: str | Path):
    """(DGLGraph with ndata feat / label, {split: seeds}, meta) of a binary-task partition
    set: :func:`benchmarks.dgl_pipeline.load_full_graph` (labels float32 [N, T])."""
    meta = PartitionSetMeta.load(parts_dir)
    if meta.task_type != "binary":
        raise SystemExit(f"{parts_dir} is a {meta.task_type} set; this reference is for "
                         "binary (multi-label) sets, e.g. partition-ogbn --dataset "
                         "synthetic-proteins")
    fg = load_full_graph(parts_dir)
    return fg.g, {"train": fg.train, "valid": fg.valid, "test": fg.test}, meta


def _loader(g, seeds: Tensor, fanouts: list[int], batch_size: int, shuffle: bool,
            num_workers: int = 0):
    dgl = import_dgl()
    sampler = dgl.dataloading.NeighborSampler(list(fanouts), prefetch_node_feats=["feat"],
                                              prefetch_labels=["label"])
    return dgl.dataloading.DataLoader(g, seeds, sampler, batch_size=batch_size,
                                      shuffle=shuffle, drop_last=False, num_workers=num_workers,
                                      persistent_workers=num_workers > 0)


@torch.no_grad()
def _split_rocauc(model: nn.Module, loader, max_batches: int | None = None) -> float:
    model.eval()
    preds, labels = [], []
    for i, (_, _, blocks) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        preds.append(model(blocks, blocks[0].srcdata["feat"]))
        labels.append(blocks[-1].dstdata["label"])
    return rocauc(torch.cat(labels).numpy(), torch.cat(preds).numpy())


def train_dgl_multilabel(parts_dir: str | Path, fanouts: list[int], batch_size: int,
                         epochs: int, hidden: int = 256, dropout: float = 0.5,
                         lr: float = 3e-3, weight_decay: float = 5e-4, seed: int = 0,
                         eval_batch_size: int = 1024,
                         num_threads: int | None = None, num_workers: int = 0,
                         max_batches: int | None = None) -> dict:
    """Train and evaluate the DGL reference (module docstring); returns its figures.
    ``num_workers``: the DataLoader's sampling processes (0: in this process), for training
    and evaluation alike; ``max_batches`` caps the batches of every epoch and evaluation
    pass (a warm-up's)."""
    dgl = import_dgl()
    t0 = time.perf_counter()
    g, splits, meta = load_multilabel_graph(parts_dir)
    load_s = time.perf_counter() - t0
    task = Task("binary", meta.num_tasks, meta.eval_metric)
    with torch_and_dgl_threads(num_threads):
        torch.manual_seed(seed)
        dgl.seed(seed)
        threads = torch.get_num_threads()
        model = DGLGraphSAGE(meta.feat_dim, hidden, meta.num_tasks, len(fanouts), dropout)
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
        train = _loader(g, splits["train"], fanouts, batch_size, True, num_workers)
        evals = {s: _loader(g, splits[s], fanouts, eval_batch_size, False, num_workers)
                 for s in ("valid", "test")}
        best = {"valid_rocauc": -1.0, "test_rocauc": 0.0, "epoch": -1}
        history, train_s, seeds = [], 0.0, 0
        for epoch in range(epochs):
            model.train()
            t = time.perf_counter()
            loss_sum, n = 0.0, 0
            for i, (_, out_nodes, blocks) in enumerate(train):
                if max_batches is not None and i >= max_batches:
                    break
                logits = model(blocks, blocks[0].srcdata["feat"])
                loss = loss_fn(task, logits, blocks[-1].dstdata["label"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += float(loss.detach())
                n += 1
                seeds += out_nodes.numel()
            train_s += time.perf_counter() - t
            scores = {s: _split_rocauc(model, ld, max_batches) for s, ld in evals.items()}
            history.append({"epoch": epoch, "loss": round(loss_sum / max(n, 1), 4),
                            **{f"{s}_rocauc": round(v, 4) for s, v in scores.items()}})
            print(f"dgl epoch {json.dumps(history[-1])}", file=sys.stderr, flush=True)
            if scores["valid"] > best["valid_rocauc"]:
                best = {"valid_rocauc": scores["valid"], "test_rocauc": scores["test"],
                        "epoch": epoch}
    return {"system": "dgl", "dataset": meta.dataset, "num_tasks": meta.num_tasks,
            "valid_rocauc": round(best["valid_rocauc"], 4),
            "test_rocauc": round(best["test_rocauc"], 4), "best_epoch": best["epoch"],
            "epochs": epochs, "num_workers": num_workers, "dropout": dropout,
            "num_threads": threads, "train_s": round(train_s, 3),
            "seeds_per_s": round(seeds / max(train_s, 1e-9), 1), "load_s": round(load_s, 3),
            "history": history}


def run_worker_mode(parts_dir: str | Path, args: argparse.Namespace, work_dir: str) -> dict:
    """mfgserve's worker mode on the same set and settings; its JSON summary."""
    cmd = [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts_dir),
           "--num-trainers", str(args.num_trainers), "--epochs", str(args.epochs),
           "--fanouts", ",".join(map(str, args.fanouts)), "--batch-size", str(args.batch_size),
           "--eval-batch-size", str(args.eval_batch_size), "--hidden", str(args.hidden),
           "--dropout", str(args.dropout), "--lr", str(args.lr), "--weight-decay",
           str(args.weight_decay), "--seed", str(args.seed), "--work-dir", work_dir,
           "--run-dir", str(Path(work_dir) / f"run-{int(time.time())}"), "--no-progress"]
    print("worker-mode: " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=_REPO, stdout=subprocess.PIPE, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"worker-mode exited with {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dgl_proteins",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", required=True, help="a binary-task partition set")
    p.add_argument("--fanouts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[10, 10])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--eval-batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--mfgserve", action="store_true",
                   help="also run deploy.worker_mode on the same set and settings")
    p.add_argument("--num-trainers", type=int, default=1)
    p.add_argument("--work-dir", default="runs/dgl_proteins")
    args = p.parse_args(argv)
    out: dict = {"settings": {k: v for k, v in vars(args).items() if k != "mfgserve"}}
    out["dgl"] = train_dgl_multilabel(
        args.parts, args.fanouts, args.batch_size, args.epochs, hidden=args.hidden,
        dropout=args.dropout, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
        eval_batch_size=args.eval_batch_size, num_threads=args.num_threads or None)
    if args.mfgserve:
        s = run_worker_mode(args.parts, args, args.work_dir)
        out["mfgserve"] = {k: s.get(k) for k in (
            "test_rocauc", "valid_rocauc", "best_epoch", "eval_metric", "num_tasks",
            "seeds_per_s", "train_s", "num_trainers", "num_parts", "run_dir")}
        out["test_rocauc_diff"] = round(s["test_rocauc"] - out["dgl"]["test_rocauc"], 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
