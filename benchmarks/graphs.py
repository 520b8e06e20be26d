"""Generated graphs as cached 1-part partition sets, shared by ``benchmarks.run`` and
``benchmarks.scale``.

Two graph families (:func:`family_parts`):

* ``products``: the products-shaped generator (:func:`partition.synthetic.generate`:
  power-law degrees, homophilous classes), partitioned from memory;
* ``rmat``: an RMAT (Kronecker) graph with skewed degrees (:mod:`partition.rmat`), written in
  OGB's binary raw layout and read back through ogb, exactly as ``partition-ogbn
  --dataset-dir DIR`` reads it, then partitioned by the same library code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FAMILIES = ("products", "rmat")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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
    """Write ``data`` as a 1-part partition set at ``out``, moved into place when complete
    (partition-ogbn's defaults: nodes in the default order, ``NODE_ORDERS[0]``)."""
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


# ------------------------------------------------------------------------------ families


def _rmat_params(args: argparse.Namespace) -> dict:
    """The RMAT generator's quadrant probabilities and noise: ``args.rmat_a`` ... when the
    caller has them, the generator's defaults otherwise."""
    from partition.rmat import DEFAULT_NOISE, DEFAULT_PROBS

    given = {k: getattr(args, f"rmat_{k}", None) for k in ("a", "b", "c", "noise")}
    defaults = dict(zip(("a", "b", "c", "noise"), (*DEFAULT_PROBS, DEFAULT_NOISE)))
    return {k: defaults[k] if v is None else float(v) for k, v in given.items()}


def rmat_tag(args: argparse.Namespace, n: int) -> str:
    """The cache name of the ``n``-node RMAT graph shaped by ``args`` (every setting that
    changes the graph)."""
    from partition.rmat import GENERATOR_VERSION

    r = _rmat_params(args)
    return (f"rmat{GENERATOR_VERSION}-{n}n-d{args.avg_degree:g}-f{args.feat_dim}-c{args.num_classes}"
            f"-tr{args.train_frac:g}-ev{args.eval_frac:g}-a{r['a']:g}-b{r['b']:g}"
            f"-c{r['c']:g}-x{r['noise']:g}-s{args.seed}")


def rmat_raw_dir(args: argparse.Namespace, n: int) -> Path:
    """The ``n``-node RMAT graph in OGB's binary raw layout, generated once and cached under
    ``args.cache_dir`` (written beside, renamed into place when complete)."""
    from partition.rmat import generate_rmat, write_ogb_binary

    out = Path(args.cache_dir) / (rmat_tag(args, n) + "-ogb")
    if (out / "meta.json").is_file():
        _log(f"using cached RMAT raw directory {out}")
        return out
    if not (0 < args.train_frac and 0 <= args.eval_frac
            and args.train_frac + 2 * args.eval_frac <= 1):
        raise ValueError("need 0 < --train-frac and train-frac + 2 * eval-frac <= 1")
    r = _rmat_params(args)
    _log(f"generating an RMAT graph: {n:,} nodes, avg degree {args.avg_degree:g}, "
         f"{args.feat_dim}-dim features, {args.num_classes} classes, a/b/c {r['a']:g}/"
         f"{r['b']:g}/{r['c']:g}, noise {r['noise']:g}")
    t0 = time.perf_counter()
    data = generate_rmat(n, avg_degree=args.avg_degree, feat_dim=args.feat_dim,
                         num_classes=args.num_classes, seed=args.seed, train_frac=args.train_frac,
                         valid_frac=args.eval_frac, test_frac=args.eval_frac, **r)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        write_ogb_binary(data, tmp / "ogb")
        del data
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "ogb", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"wrote {out} in {time.perf_counter() - t0:.1f}s")
    return out


def _cached_one_part(out: Path) -> bool:
    """Whether ``out`` holds a 1-part set partitioned as :func:`write_one_part` does now (in
    partition-ogbn's default node order: a set written before the order existed, or in
    another, is written again)."""
    from partition.layout import PartitionFormatError, PartitionSetMeta
    from partition.partitioner import NODE_ORDERS

    try:
        meta = PartitionSetMeta.load(out)
    except PartitionFormatError:
        return False
    return meta.num_parts == 1 and meta.stats.get("node_order") == NODE_ORDERS[0]


def family_parts(family: str, args: argparse.Namespace) -> Path:
    """A cached 1-part partition set of graph family ``family`` shaped by ``args``
    (synthetic_nodes, avg_degree, feat_dim, num_classes, train_frac, eval_frac, seed,
    cache_dir; for rmat optionally rmat_a, rmat_b, rmat_c, rmat_noise).

    ``products``: :func:`synthetic_data` partitioned by :func:`write_one_part` (what
    ``benchmarks.run`` always did). ``rmat``: :func:`rmat_raw_dir` (OGB binary layout), read
    by :func:`partition.ogbn.load_ogb` as ``partition-ogbn --dataset-dir`` reads it, and
    partitioned by the same :func:`write_one_part`.
    """
    n = int(args.synthetic_nodes)
    if family == "products":
        out = set_dir(args, n)
        if _cached_one_part(out):
            _log(f"using cached products-shaped graph {out}")
            return out
        _log(f"generating a products-shaped graph: {n:,} nodes, avg degree "
             f"{args.avg_degree:g}, {args.feat_dim}-dim features, {args.num_classes} classes")
        t0 = time.perf_counter()
        write_one_part(synthetic_data(n, args), out, args.seed)
        _log(f"wrote {out} in {time.perf_counter() - t0:.1f}s")
        return out
    if family == "rmat":
        from partition.ogbn import load_ogb

        out = Path(args.cache_dir) / (rmat_tag(args, n) + "-1part")
        if _cached_one_part(out):
            _log(f"using cached RMAT graph {out}")
            return out
        raw = rmat_raw_dir(args, n)
        t0 = time.perf_counter()
        data = load_ogb(dataset_dir=str(raw), work_dir=str(args.cache_dir))
        _log(f"read {raw} through ogb in {time.perf_counter() - t0:.1f}s: "
             f"{data.num_nodes:,} nodes, {data.num_edges:,} directed edges")
        t0 = time.perf_counter()
        write_one_part(data, out, args.seed)
        _log(f"partitioned into {out} in {time.perf_counter() - t0:.1f}s")
        return out
    raise ValueError(f"unknown graph family {family!r}; expected one of {', '.join(FAMILIES)}")
