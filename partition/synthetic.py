"""Synthetic node-classification graphs of any size, and a writer for OGB's raw layout.

:func:`generate` builds an undirected graph in the Chung-Lu style: node i gets an expected
degree ``w_i`` drawn from a Pareto (power-law) distribution, capped at ``sqrt(sum w)`` so
that edge probabilities stay below one, and every edge picks its first endpoint ``u`` with
probability proportional to ``w``. With probability ``homophily`` the second endpoint is
drawn (again proportional to ``w``) from ``u``'s class, otherwise from the other classes, so
the fraction of same-class edges is ``homophily`` in expectation. Draws proportional to ``w``
are O(1) lookups in a "stub" array that lists node i about ``16 * w_i / mean(w)`` times
(randomly rounded, so expectations are exact). Self loops and duplicate
edges are dropped and topped up, so the graph has ``round(num_nodes * avg_degree / 2)``
undirected edges unless it is too small or dense to hold them.

Labels are learnable from features and structure: class ``c`` has a centroid ``mu_c`` in a
random direction with norm ``sqrt(D)`` and node features are ``(mu_y + feat_noise * eps) /
sqrt(1 + feat_noise^2)`` with ``eps ~ N(0, I_D)`` (unit variance per entry, and the
difficulty hardly depends on D). With the default noise (4.5) and 47 classes a
nearest-centroid classifier on a node's own features gets about half the labels right
(~0.5 at D=100), one on the mean of its neighbours' features over 0.95 (homophily 0.8,
degree 20). Class sizes are mildly skewed (class c has weight ``(c + 1) ** -0.5``).

Everything is vectorised numpy, generated in fixed-size chunks from one seeded generator
(the output depends only on the arguments), and memory stays near the output size: the
edge keys (8 bytes per undirected edge) plus ``src`` / ``dst`` / ``feat``.

:func:`write_ogb_raw` writes a :class:`GraphData` in OGB's raw layout (like
``../shared/datasets/cora``) so that :func:`partition.ogbn.load_ogb` reads it back.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from partition.graph_data import DatasetError, GraphData

__all__ = ["generate", "write_ogb_raw", "DEFAULT_FEAT_NOISE", "DEFAULT_DEGREE_EXPONENT"]

DEFAULT_FEAT_NOISE = 4.5
DEFAULT_DEGREE_EXPONENT = 2.5
_CHUNK = 1 << 21  # edges per vectorised step (features: 8 * _CHUNK values)
_CLASS_SKEW = 0.5
_STUBS_PER_NODE = 16


def _check_args(
    num_nodes,
    avg_degree,
    feat_dim,
    num_classes,
    homophily,
    train_frac,
    valid_frac,
    feat_noise,
    degree_exponent,
) -> None:
    problems = []
    if int(num_nodes) < 2:
        problems.append(f"num_nodes={num_nodes} must be >= 2")
    if not avg_degree >= 0:
        problems.append(f"avg_degree={avg_degree} must be >= 0")
    if int(feat_dim) < 1:
        problems.append(f"feat_dim={feat_dim} must be >= 1")
    if int(num_classes) < 1:
        problems.append(f"num_classes={num_classes} must be >= 1")
    if not 0.0 <= homophily <= 1.0:
        problems.append(f"homophily={homophily} must be in [0, 1]")
    if not (0.0 <= train_frac and 0.0 <= valid_frac and train_frac + valid_frac <= 1.0):
        problems.append(
            f"train_frac={train_frac}, valid_frac={valid_frac} must be >= 0 with sum <= 1"
        )
    if not feat_noise >= 0:
        problems.append(f"feat_noise={feat_noise} must be >= 0")
    if not degree_exponent > 2.0:
        problems.append(f"degree_exponent={degree_exponent} must be > 2 (finite mean degree)")
    if problems:
        raise DatasetError("synthetic graph: " + "; ".join(problems))


def _sample_edges(
    rng, count, stubs, lab_pos, stub_lo, stub_hi, homophily, num_classes, n, pbar
) -> np.ndarray:
    """``count`` edge keys ``min(pu, pv) * n + max(pu, pv)`` over class-sorted positions.

    ``stubs`` lists every position once per unit of its weight (class-sorted, so class c
    owns ``stubs[stub_lo[c]:stub_hi[c]]``): a uniform index into it is a draw proportional to
    the weight, in O(1).
    """
    keys = np.empty(count, dtype=np.int64)
    total = stubs.shape[0]
    filled = 0
    for start in range(0, count, _CHUNK):
        b = min(_CHUNK, count - start)
        pu = stubs[rng.integers(0, total, b)].astype(np.int64)
        cu = lab_pos[pu]
        same = rng.random(b) < homophily if num_classes > 1 else np.ones(b, dtype=bool)
        pv = np.empty(b, dtype=np.int64)
        # same class: proportional to the weight within u's class
        cs = cu[same]
        lo = stub_lo[cs]
        pv[same] = stubs[lo + (rng.random(cs.shape[0]) * (stub_hi[cs] - lo)).astype(np.int64)]
        # other classes: proportional to the weight over the graph, redrawn while the class matches
        diff = np.flatnonzero(~same)
        cand = stubs[rng.integers(0, total, diff.shape[0])].astype(np.int64)
        for _ in range(64):
            bad = np.flatnonzero(lab_pos[cand] == cu[diff])
            if not bad.size:
                break
            cand[bad] = stubs[rng.integers(0, total, bad.shape[0])]
        pv[diff] = cand
        ok = pu != pv
        a = np.minimum(pu[ok], pv[ok])
        k = int(a.shape[0])
        np.multiply(a, n, out=keys[filled : filled + k])
        keys[filled : filled + k] += np.maximum(pu[ok], pv[ok])
        filled += k
        if pbar is not None:
            pbar.update(b)
    return keys[:filled]


def _dedupe_sorted(keys: np.ndarray) -> np.ndarray:
    if keys.size < 2:
        return keys
    keep = np.empty(keys.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(keys[1:], keys[:-1], out=keep[1:])
    return keys[keep]


def _merge_unique(keys: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """The sorted unique union of sorted unique ``keys`` and an unsorted batch ``extra``
    (two sorted runs: the stable sort (timsort) merges them in linear time)."""
    extra.sort()
    extra = _dedupe_sorted(extra)
    if not keys.shape[0]:
        return extra
    keys = np.concatenate([keys, extra])
    del extra
    keys.sort(kind="stable")
    return _dedupe_sorted(keys)


def _class_and_weights(
    rng, n: int, c: int, avg_degree: float, degree_exponent: float
) -> tuple[np.ndarray, np.ndarray]:
    """Labels (mildly skewed class sizes) and power-law expected degrees ``w``."""
    cls_p = (np.arange(c) + 1.0) ** -_CLASS_SKEW
    cls_p /= cls_p.sum()
    label = rng.choice(c, size=n, p=cls_p).astype(np.int64)
    w = rng.pareto(degree_exponent - 1.0, size=n) + 1.0
    w *= avg_degree / w.mean() if avg_degree > 0 else 0.0
    if avg_degree > 0:
        cap = math.sqrt(n * avg_degree)
        for _ in range(5):  # cap, then rescale to keep the mean
            np.minimum(w, cap, out=w)
            w *= avg_degree / w.mean()
        np.minimum(w, cap, out=w)
    return label, w


def _stub_table(rng, label: np.ndarray, w: np.ndarray, n: int, c: int, avg_degree: float):
    """(order, lab_pos, stubs, stub_lo, stub_hi, stub_count) over class-sorted positions.

    Nodes in class-sorted order; each position gets about STUBS_PER_NODE * w / mean(w)
    "stubs" (randomly rounded, so the expectation is exact): a uniform draw over the stub
    array picks a node proportionally to its weight in O(1).
    """
    order = np.argsort(label, kind="stable")
    lab_pos = label[order].astype(np.int16 if c < 2**15 else np.int64)  # small: cache-friendly
    wpos = w[order] * (_STUBS_PER_NODE / w.mean()) if avg_degree > 0 else np.zeros(n)
    reps = np.floor(wpos + rng.random(n)).astype(np.int64)
    stubs = np.repeat(np.arange(n, dtype=np.int32 if n < 2**31 else np.int64), reps)
    del wpos
    stub_count = np.bincount(lab_pos, weights=reps, minlength=c).astype(np.int64)
    stub_hi = np.cumsum(stub_count)
    stub_lo = stub_hi - stub_count
    del reps
    return order, lab_pos, stubs, stub_lo, stub_hi, stub_count


def _draw_edge_keys(
    rng, m_target, stubs, lab_pos, stub_lo, stub_hi, homophily, c, n, progress
) -> np.ndarray:
    """``m_target`` distinct sorted edge keys (fewer if the graph cannot hold them)."""
    pbar = tqdm(total=m_target, desc="synthetic edge draws", unit="edge", unit_scale=True,
                file=sys.stderr, disable=not progress)
    keys = np.empty(0, dtype=np.int64)
    if m_target > 0:
        want, keep_rate = m_target, 0.98
        for _ in range(8):  # self loops and duplicates are dropped, then topped up
            draw = int(want / max(keep_rate, 0.05) * 1.02) + 16
            pbar.total = pbar.n + draw
            before = keys.shape[0]
            # the draw is passed unbound, so it is freed when the merge returns
            keys = _merge_unique(keys, _sample_edges(
                rng, draw, stubs, lab_pos, stub_lo, stub_hi, homophily, c, n, pbar))
            keep_rate = (keys.shape[0] - before) / draw
            want = m_target - keys.shape[0]
            if want <= 0:
                break
        if keys.shape[0] > m_target:  # drop a random surplus
            drop = rng.choice(keys.shape[0], keys.shape[0] - m_target, replace=False)
            keep = np.ones(keys.shape[0], dtype=bool)
            keep[drop] = False
            keys = keys[keep]
    pbar.close()
    return keys


def _keys_to_edges(keys: np.ndarray, order: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions -> node ids, as ``src`` / ``dst`` with interleaved (u -> v), (v -> u) pairs.

    The caller drops ``keys`` right after this returns (before anything else is allocated).
    """
    m = int(keys.shape[0])
    src = np.empty(2 * m, dtype=np.int64)
    dst = np.empty(2 * m, dtype=np.int64)
    for s in range(0, m, _CHUNK):
        k = keys[s : s + _CHUNK]
        src[2 * s : 2 * (s + k.shape[0]) : 2] = order[k // n]
        dst[2 * s : 2 * (s + k.shape[0]) : 2] = order[k % n]
    return src, dst


def _features(rng, label: np.ndarray, n: int, d: int, c: int, feat_noise: float,
              progress: bool) -> np.ndarray:
    """Class centroid + noise, unit variance per dimension, ``float32 [n, d]``."""
    centroids = rng.standard_normal((c, d), dtype=np.float32)
    centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-12)
    centroids *= np.float32(math.sqrt(d))  # unit-norm directions, unit variance per entry
    scale = np.float32(1.0 / math.sqrt(1.0 + feat_noise**2))
    feat = np.empty((n, d), dtype=np.float32)
    rows = max(1, _CHUNK // max(1, d) * 8)
    for s in tqdm(
        range(0, n, rows), desc="synthetic features", file=sys.stderr, disable=not progress
    ):
        e = min(n, s + rows)
        block = rng.standard_normal((e - s, d), dtype=np.float32)
        block *= np.float32(feat_noise)
        block += centroids[label[s:e]]
        block *= scale
        feat[s:e] = block
    return feat


def _random_splits(rng, n: int, train_frac: float, valid_frac: float):
    """(train, valid, test): a random ``train_frac`` / ``valid_frac`` / rest, each sorted."""
    perm = rng.permutation(n)
    n_train = int(round(train_frac * n))
    n_valid = min(n - n_train, int(round(valid_frac * n)))
    train = np.sort(perm[:n_train]).astype(np.int64)
    valid = np.sort(perm[n_train : n_train + n_valid]).astype(np.int64)
    test = np.sort(perm[n_train + n_valid :]).astype(np.int64)
    return train, valid, test


def generate(
    num_nodes: int,
    avg_degree: float = 20,
    feat_dim: int = 100,
    num_classes: int = 47,
    seed: int = 0,
    homophily: float = 0.8,
    train_frac: float = 0.6,
    valid_frac: float = 0.2,
    feat_noise: float = DEFAULT_FEAT_NOISE,
    progress: bool = True,
    *,
    degree_exponent: float = DEFAULT_DEGREE_EXPONENT,
    name: str | None = None,
) -> GraphData:
    """Generate a synthetic undirected node-classification graph (see the module docstring).

    ``avg_degree`` counts directed edges per node (both directions of an undirected edge),
    so the graph has ``num_nodes * avg_degree / 2`` undirected edges, stored as
    ``(u -> v), (v -> u)`` pairs. ``degree_exponent`` is the power-law exponent of the
    degree distribution (> 2). Splits are a random ``train_frac`` / ``valid_frac`` / rest.
    Deterministic for given arguments.
    """
    _check_args(num_nodes, avg_degree, feat_dim, num_classes, homophily, train_frac,
                valid_frac, feat_noise, degree_exponent)
    n, d, c = int(num_nodes), int(feat_dim), int(num_classes)
    rng = np.random.default_rng(seed)  # one generator: the draw order below is fixed
    m_target = int(round(n * avg_degree / 2))
    m_target = min(m_target, n * (n - 1) // 2)

    label, w = _class_and_weights(rng, n, c, avg_degree, degree_exponent)
    order, lab_pos, stubs, stub_lo, stub_hi, stub_count = _stub_table(
        rng, label, w, n, c, avg_degree
    )
    if c > 1 and np.count_nonzero(stub_count) < 2:
        homophily = 1.0  # a single populated class has no other class to link to
    keys = _draw_edge_keys(
        rng, m_target, stubs, lab_pos, stub_lo, stub_hi, homophily, c, n, progress
    )
    src, dst = _keys_to_edges(keys, order, n)
    del keys
    src[1::2] = dst[0::2]  # odd slots: the reverse of the even ones
    dst[1::2] = src[0::2]
    feat = _features(rng, label, n, d, c, feat_noise, progress)
    train, valid, test = _random_splits(rng, n, train_frac, valid_frac)

    return GraphData(name=name or f"synthetic-{n}", num_nodes=n, src=src, dst=dst, feat=feat,
                     label=label, train=train, valid=valid, test=test, num_classes=c)


# ---------------------------------------------------------------------------------------
# OGB raw layout writer


def _write_int_csv(path: Path, cols: list[np.ndarray], rows_per_chunk: int = 1 << 20) -> None:
    """Write integer columns as ``a,b`` lines into a gzip file, in chunks."""
    n = cols[0].shape[0]
    with gzip.open(path, "wb", compresslevel=3) as f:
        for s in range(0, n, rows_per_chunk):
            parts = [c[s : s + rows_per_chunk].astype(str) for c in cols]
            line = parts[0]
            for p in parts[1:]:
                line = np.char.add(np.char.add(line, ","), p)
            f.write(("\n".join(line.tolist()) + "\n").encode())


def _write_float_csv(path: Path, arr: np.ndarray, rows_per_chunk: int = 1 << 14) -> None:
    """float32 rows with 9 significant digits: parsing them back gives the same float32."""
    import pandas as pd

    with gzip.open(path, "wt", compresslevel=3, newline="") as f:
        for s in range(0, arr.shape[0], rows_per_chunk):
            pd.DataFrame(arr[s : s + rows_per_chunk]).to_csv(
                f, header=False, index=False, float_format="%.9g", lineterminator="\n"
            )


def write_ogb_raw(
    data: GraphData, out_dir: str | Path, *, split_name: str = "random", progress: bool = True
) -> Path:
    """Write ``data`` in OGB's raw layout under ``out_dir`` (created; existing files replaced).

    Produces ``raw/{edge,node-feat,node-label,num-node-list,num-edge-list}.csv.gz``,
    ``split/<split_name>/{train,valid,test}.csv.gz``, ``RELEASE_v1.txt`` and a ``meta.json``
    that ogb accepts as ``meta_dict`` (plus ``"name"``). When the edges are interleaved
    ``(u -> v), (v -> u)`` pairs (see :class:`GraphData`) each undirected edge is written
    once with ``add_inverse_edge`` "True"; otherwise every directed edge is written with
    ``add_inverse_edge`` "False". Either way :func:`partition.ogbn.load_ogb` returns the same
    edges in the same order, and the same features, labels and splits.
    """
    data.validate()
    out = Path(out_dir)
    raw = out / "raw"
    split = out / "split" / split_name
    for p in (raw, split):
        if p.exists():
            shutil.rmtree(p)
        p.mkdir(parents=True)
    undirected = data.is_interleaved_undirected()
    src, dst = (data.src[0::2], data.dst[0::2]) if undirected else (data.src, data.dst)
    steps = tqdm(total=4, desc=f"write OGB raw {out}", file=sys.stderr, disable=not progress)
    _write_int_csv(raw / "edge.csv.gz", [src, dst])
    steps.update()
    _write_float_csv(raw / "node-feat.csv.gz", data.feat)
    steps.update()
    _write_int_csv(raw / "node-label.csv.gz", [data.label])
    _write_int_csv(raw / "num-node-list.csv.gz", [np.array([data.num_nodes], dtype=np.int64)])
    _write_int_csv(raw / "num-edge-list.csv.gz", [np.array([src.shape[0]], dtype=np.int64)])
    steps.update()
    for s in ("train", "valid", "test"):
        _write_int_csv(split / f"{s}.csv.gz", [data.split(s)])
    steps.update()
    steps.close()
    (out / "RELEASE_v1.txt").write_text("v1")
    meta = {
        "name": data.name,
        "num tasks": 1,
        "num classes": data.num_classes,
        "eval metric": "acc",
        "task type": "multiclass classification",
        "download_name": data.name,
        "version": 1,
        "url": "",
        "add_inverse_edge": "True" if undirected else "False",
        "has_node_attr": "True",
        "has_edge_attr": "False",
        "split": split_name,
        "additional node files": "None",
        "additional edge files": "None",
        "is hetero": "False",
        "binary": "False",
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out
