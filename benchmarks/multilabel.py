"""benchmarks.run's multi-label step: mfgserve vs DGL's pipeline on an ogbn-proteins-shaped
graph (112 binary tasks per node, ROC-AUC), the seed model on both sides.

The graph: ``partition-ogbn --dataset synthetic-proteins --num-nodes N --avg-degree D``
(partition/proteins.py: power-law degrees, 8-dim edge features averaged onto the nodes as
their features, 112 tasks, a split by species with 65 % of the nodes for training),
partitioned into 1 part and cached under ``--cache-dir``.

Both sides train the seed tutorial's model (``SAGEConv`` mean, ReLU between layers, one logit
per task) with the run's ``--fanouts``, ``--batch-size``, ``--hidden``, the headline dropout
(0 when measured), Adam (3e-3, weight decay 5e-4), the same initial weights and binary
cross-entropy over the labelled entries (:func:`trainer_client.metrics.loss_fn`):

* DGL: :func:`benchmarks.dgl_proteins.train_dgl_multilabel` (``DataLoader`` +
  ``NeighborSampler``, ``DGLGraphSAGE``), once per ``--dgl-workers`` value; the ratio is
  against the best;
* mfgserve: ``deploy.worker_mode`` on the same set (:func:`benchmarks.run.run_worker_mode`:
  the main rows' flags, 1 trainer, the ring on), ``--multilabel-epochs`` epochs.

Both at the first ``--matmul-precision`` and on the CPU, whatever ``--device`` says.

``--rounds N`` measures the pair N times, alternating which side goes first (round 1 DGL);
the step's ``ratio`` is the median of the rounds' ratios. Seeds/s count training loops only
on both sides (evaluation excluded); DGL gets a short untimed warm-up run first, as in the
main rows, and worker mode's first batch is timed. Test ROC-AUC is
reported for each (at the epoch of best validation ROC-AUC) and their difference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.report import at_least, cached_parts, logger

log = logger("multilabel")


def proteins_parts(cache_dir: str, nodes: int, degree: float, seed: int) -> Path:
    """The cached 1-part proteins-shaped set (made on first use)."""
    root = Path(cache_dir) / f"proteins-{nodes}n-d{degree:g}-s{seed}"
    raw, parts = root / "raw", root / "parts1"
    return cached_parts(parts, [
        ["--dataset", "synthetic-proteins", "--num-nodes", str(nodes), "--avg-degree",
         f"{degree:g}", "--raw-out", str(raw), "--force"],
        ["--dataset-dir", str(raw), "--num-parts", "1", "--out", str(parts), "--force"]],
        log, seed)


def _dgl_warmup(parts: Path, args: argparse.Namespace, dropout: float) -> None:
    """A short untimed DGL run first, as the main rows have (benchmarks.run._dgl_warmup):
    this process's one-time costs then stay out of round 1's DGL figure (worker mode is a
    fresh process every time, its first batch timed: this can only favour DGL)."""
    from benchmarks.dgl_proteins import train_dgl_multilabel
    from benchmarks.run import DGL_WARMUP_BATCHES

    t0 = time.perf_counter()
    train_dgl_multilabel(parts, list(args.fanouts), args.batch_size, 1, hidden=args.hidden,
                         dropout=dropout, seed=args.seed, eval_batch_size=args.batch_size,
                         num_threads=args.num_threads, max_batches=DGL_WARMUP_BATCHES)
    log(f"DGL warm-up ({DGL_WARMUP_BATCHES} batches, untimed) took "
        f"{time.perf_counter() - t0:.1f}s")


def _dgl_side(parts: Path, args: argparse.Namespace, dropout: float) -> dict[int, dict]:
    from benchmarks.dgl_proteins import train_dgl_multilabel

    out = {}
    for w in args.dgl_workers:
        log(f"DGL, num_workers {w}, {args.multilabel_epochs} epochs")
        res = train_dgl_multilabel(parts, list(args.fanouts), args.batch_size,
                                   args.multilabel_epochs, hidden=args.hidden, dropout=dropout,
                                   seed=args.seed, eval_batch_size=args.batch_size,
                                   num_threads=args.num_threads, num_workers=w)
        res.pop("history", None)
        out[w] = res
    return out


def measure_multilabel(args: argparse.Namespace) -> dict:
    """``--rounds`` pairs of (DGL's best over ``--dgl-workers``, worker mode) on the cached
    proteins-shaped set; figures, the median ratio and the ROC-AUC difference."""
    from benchmarks.run import headline_dropout, run_worker_mode
    from partition.layout import PartitionSetMeta

    parts = proteins_parts(args.cache_dir, args.multilabel_nodes, args.multilabel_degree,
                           args.seed)
    meta = PartitionSetMeta.load(parts)
    p = headline_dropout(args.dropout)
    # both sides on the CPU (DGL's wheels have no CUDA kernels), whatever --device says
    wargs = argparse.Namespace(**{**vars(args), "epochs": args.multilabel_epochs,
                                  "device": "cpu"})
    _dgl_warmup(parts, args, p)
    rounds = []
    for r in range(1, args.rounds + 1):
        got: dict = {}
        for side in (("dgl", "mfgserve") if r % 2 else ("mfgserve", "dgl")):
            if side == "dgl":
                got["dgl"] = _dgl_side(parts, args, p)
            else:
                got["mfgserve"] = run_worker_mode(parts, wargs, p)
        best_w = max(got["dgl"], key=lambda w: got["dgl"][w]["seeds_per_s"])
        dgl, mfg = got["dgl"][best_w], got["mfgserve"]
        rounds.append({"round": r, "first": "DGL" if r % 2 else "mfgserve",
                       "dgl": got["dgl"], "dgl_best_workers": best_w, "mfgserve": mfg,
                       "ratio": round(mfg["seeds_per_s"] / dgl["seeds_per_s"], 3),
                       "test_rocauc_diff": round(mfg["test_rocauc"] - dgl["test_rocauc"], 4)})
        log(f"round {r}: DGL {dgl['seeds_per_s']:,.0f} seeds/s (num_workers {best_w}), "
            f"mfgserve {mfg['seeds_per_s']:,.0f}: ratio {rounds[-1]['ratio']}")
    return {"graph": {"parts_dir": str(parts), "dataset": meta.dataset,
                      "nodes": meta.num_nodes, "edges": meta.num_edges,
                      "feat_dim": meta.feat_dim, "num_tasks": meta.num_tasks,
                      "num_train": sum(q.num_train for q in meta.parts)},
            "fanouts": list(args.fanouts), "epochs": args.multilabel_epochs, "dropout": p,
            "rounds": rounds,
            "dgl_seeds_per_s": round(statistics.median(
                x["dgl"][x["dgl_best_workers"]]["seeds_per_s"] for x in rounds), 1),
            "mfgserve_seeds_per_s": round(statistics.median(
                x["mfgserve"]["seeds_per_s"] for x in rounds), 1),
            "ratio": round(statistics.median(x["ratio"] for x in rounds), 3),
            "round_ratios": [x["ratio"] for x in rounds],
            "test_rocauc_diff": round(statistics.median(x["test_rocauc_diff"] for x in rounds), 4)}


def add_args(p: argparse.ArgumentParser) -> None:
    """benchmarks.run's options for this step."""
    p.add_argument("--multilabel-nodes", type=at_least(8), default=100000,
                   help="multilabel step: nodes of the generated proteins-shaped graph "
                        "(default 100000)")
    p.add_argument("--multilabel-degree", type=at_least(0, float), default=50.0,
                   help="multilabel step: its average undirected degree (default 50: 5M "
                        "directed edges at 100000 nodes)")
    p.add_argument("--multilabel-epochs", type=at_least(1), default=2,
                   help="multilabel step: training epochs of both sides (default 2)")
