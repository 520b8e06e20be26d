"""Synthetic graphs (:func:`partition.synthetic.generate`) as cached 1-part partition sets,
shared by ``benchmarks.run`` and ``benchmarks.scale``."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np


def set_dir(args: argparse.Namespace, n: int) -> Path:
    """Where the 1-part partition set of the ``n``-node graph shaped by ``args`` is cached
    (under ``args.cache_dir``, named by every setting that changes the graph)."""
    tag = (f"synthetic-{n}n-d{args.avg_degree:g}-f{args.feat_dim}-c{args.num_classes}"
           f"-tr{args.train_frac:g}-ev{args.eval_frac:g}-s{args.seed}-1part")
    return Path(args.cache_dir) / tag


def synthetic_data(n: int, args: argparse.Namespace):
    """A synthetic graph of ``n`` nodes shaped by ``args`` (avg_degree, feat_dim,
    num_classes, seed) with random train / valid / test splits (train_frac, eval_frac)."""
    from partition.synthetic import generate

    if not (0 < args.train_frac and 0 <= args.eval_frac
            and args.train_frac + 2 * args.eval_frac <= 1):
        raise ValueError("need 0 < --train-frac and train-frac + 2 * eval-frac <= 1")
    data = generate(n, avg_degree=args.avg_degree, feat_dim=args.feat_dim,
                    num_classes=args.num_classes, seed=args.seed, progress=True)
    perm = np.random.default_rng(args.seed + 1).permutation(n)
    n_train, n_eval = max(1, round(args.train_frac * n)), round(args.eval_frac * n)
    data.train = np.sort(perm[:n_train]).astype(np.int64)
    data.valid = np.sort(perm[n_train:n_train + n_eval]).astype(np.int64)
    data.test = np.sort(perm[n_train + n_eval:n_train + 2 * n_eval]).astype(np.int64)
    return data


def write_one_part(data, out: Path, seed: int) -> None:
    """Write ``data`` as a 1-part partition set at ``out``, moved into place when complete."""
    from partition.partitioner import partition_graph

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        partition_graph(data, 1, tmp / "set", seed=seed, progress=True)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "set", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def graph_bytes(parts: Path) -> dict:
    """Bytes of the partition set's ``.npy`` files: the parts' own, and all of them."""
    part = sum(f.stat().st_size for f in parts.glob("part-*/*.npy"))
    total = sum(f.stat().st_size for f in parts.rglob("*.npy"))
    return {"graph_bytes": part, "set_bytes": total}
