"""benchmarks.run's heterogeneous step: mfgserve vs DGL's heterogeneous pipeline on one typed
graph, same model family, fanouts, hidden size, epochs and optimizer.

The graph: ``partition-ogbn --dataset synthetic-mag --num-nodes P`` (ogbn-mag-shaped: paper,
author, institution, field_of_study; 4 relations, 128-dim features on papers), partitioned
into 1 part with ``--add-reverse-edges --derive-features mean`` (so every node type has
features and every type a relation leading in: both models then compute the same function
family, see trainer_client/hetero_model.py), cached under ``--cache-dir``.

* DGL: :func:`benchmarks.dgl_hetero.train_dgl_hetero` (DGL's ``DataLoader`` +
  ``NeighborSampler``, in process), twice: with mfgserve's model (``RelGraphSAGE``, the same
  model definition on both sides: the ratio's baseline) and with DGL's own
  ``HeteroGraphConv`` of ``SAGEConv`` mean, summed across relations (a second row);
* mfgserve: ``deploy.worker_mode --model rsage`` on the same set (1 trainer, the ring on).

Returns the runs' figures, ``ratio`` = mfgserve seeds/s / DGL seeds/s with the same model,
``ratio_vs_heteroconv`` against DGL's HeteroGraphConv, and the test accuracy of each
(``acc_diff`` = mfgserve - DGL, same model). No target beyond reporting it honestly: a
ratio below 1 is explained from the worker-mode run's stage timings (``stages_s``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import REPO, cached_parts, logger

log = logger("hetero")


def mag_parts(cache_dir: str, papers: int, seed: int) -> Path:
    """The cached 1-part typed set of ``papers`` papers (made on first use)."""
    root = Path(cache_dir) / f"mag-{papers}p-s{seed}"
    raw, parts = root / "raw", root / "parts1"
    return cached_parts(parts, [
        ["--dataset", "synthetic-mag", "--num-nodes", str(papers), "--raw-out", str(raw),
         "--force"],
        ["--dataset-dir", str(raw), "--add-reverse-edges", "--derive-features", "mean",
         "--num-parts", "1", "--out", str(parts), "--force"]], log, seed)


def worker_rsage(parts: Path, args: argparse.Namespace, fanouts: list[int]) -> dict:
    """``deploy.worker_mode --model rsage`` on ``parts``: its JSON summary (last line)."""
    argv = [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts),
            "--num-trainers", "1", "--epochs", str(args.hetero_epochs),
            "--fanouts", ",".join(map(str, fanouts)), "--batch-size", str(args.batch_size),
            "--hidden", str(args.hidden), "--seed", str(args.seed), "--model", "rsage",
            "--dropout", "0", "--lr", "0.003", "--weight-decay", "0.0005",
            "--server-num-workers", str(args.server_workers), "--no-progress",
            "--shm-ring" if args.shm_ring else "--no-shm-ring"]
    if args.num_threads:
        argv += ["--num-threads", str(args.num_threads)]
    log("worker-mode: " + " ".join(argv[1:]))
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=None, text=True,
                          stdin=subprocess.DEVNULL, timeout=args.worker_timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker-mode --model rsage exited {proc.returncode}; last stdout "
                           f"line: {lines[-1] if lines else '<none>'}")
    s = json.loads(lines[-1])
    keep = ("seeds_per_s", "train_s", "test_acc", "valid_acc", "best_epoch", "final_loss",
            "batches_per_epoch_per_trainer", "bytes_received", "stages_s", "startup_s",
            "model", "shm_ring", "server_to_server_bytes")
    out = {k: s[k] for k in keep if k in s}
    out["subprocess_wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def measure_hetero(args: argparse.Namespace) -> dict:
    """Both sides on the cached mag-shaped set; figures, ratio and accuracy difference."""
    from benchmarks.dgl_hetero import load_full_heterograph, train_dgl_hetero

    fanouts = list(args.hetero_fanouts)
    parts = mag_parts(args.cache_dir, args.hetero_papers, args.seed)
    hg = load_full_heterograph(parts)
    dgl_res, conv_res = (train_dgl_hetero(hg, fanouts, args.batch_size, args.hetero_epochs,
                                          hidden=args.hidden, featureless="zeros",
                                          seed=args.seed, model_name=m)
                         for m in ("rsage", "hetero-sage"))
    mfg_res = worker_rsage(parts, args, fanouts)

    def over(base: dict) -> float | None:
        return (round(mfg_res["seeds_per_s"] / base["seeds_per_s"], 3)
                if base.get("seeds_per_s") and mfg_res.get("seeds_per_s") else None)

    return {"graph": {"parts_dir": str(parts), "papers": args.hetero_papers,
                      "nodes": hg.g.num_nodes(), "edges": hg.g.num_edges(),
                      "ntypes": list(hg.g.ntypes),
                      "relations": [list(e) for e in hg.g.canonical_etypes]},
            "fanouts": fanouts, "epochs": args.hetero_epochs, "dgl": dgl_res,
            "dgl_heteroconv": conv_res, "mfgserve": mfg_res, "ratio": over(dgl_res),
            "ratio_vs_heteroconv": over(conv_res),
            "acc_diff": (round(mfg_res["test_acc"] - dgl_res["test_acc"], 4)
                         if "test_acc" in mfg_res else None)}


def add_args(p: argparse.ArgumentParser) -> None:
    """benchmarks.run's options for this step."""
    p.add_argument("--hetero-papers", type=int, default=20000,
                   help="hetero step: papers of the generated mag-shaped graph (default 20000)")
    p.add_argument("--hetero-epochs", type=int, default=3,
                   help="hetero step: training epochs of both sides (default 3)")
    p.add_argument("--hetero-fanouts", type=lambda t: [int(x) for x in t.split(",") if x],
                   default=[10, 10],
                   help="hetero step: fanouts for every relation, input layer first "
                        "(default 10,10)")
