"""RMAT (recursive matrix / stochastic Kronecker) node-classification graphs, written in
OGB's *binary* raw layout.

A graph family the products-shaped generator (:mod:`partition.synthetic`) does not make:
:func:`generate_rmat` draws every edge by descending ``scale = ceil(log2(num_nodes))``
levels of the adjacency matrix, at each level picking one quadrant with probabilities
``(a, b, c, d)`` (Graph500: 0.57, 0.19, 0.19, 0.05): the first endpoint takes the row bit,
the second the column bit. Every level gets its own noise, as in the "noisy SKG" of
Seshadhri, Pinar and Kolda (2013): ``mu ~ U(-noise, noise)`` shifts ``b, c`` by ``+mu`` and
``a, d`` by ``-2 mu a / (a + d)``, ``-2 mu d / (a + d)``, which smooths the oscillating
degree distribution of plain RMAT while keeping its heavy tail. Ids at or above
``num_nodes`` (when it is not a power of two) and self loops are rejected and redrawn.

The graph is undirected: each drawn pair ``{u, v}`` is stored as ``(u -> v), (v -> u)``
(interleaved, see :class:`~partition.graph_data.GraphData`), so in-degree equals
out-degree. **Duplicate edges are removed** (and topped up by more draws, at most
``_MAX_ROUNDS`` rounds), so the graph has ``round(num_nodes * avg_degree / 2)`` distinct
undirected edges unless it is too small or dense to hold them. Finally node ids are
permuted at random, so that degree is not correlated with id (plain RMAT gives node 0 the
largest degree). RMAT leaves many nodes isolated; they keep their features and labels but
are placed in the splits last (train / valid are drawn from nodes with neighbours first).

Features are i.i.d. ``N(0, 1)`` float32. Labels are learnable only with the graph: with a
random linear map ``W`` (``feat_dim x num_classes``), node i's scores are ``x_i W +
_NEIGHBOUR_WEIGHT * mean_{j in N(i)} x_j W`` and its label the arg max. One GraphSAGE layer
(a linear map of a node's own features and of its neighbours' mean) represents that rule
exactly; a model of a node's own features alone cannot.

Everything is vectorised numpy in chunks of ``_CHUNK`` edges (one level costs a few numpy
passes over a chunk: 16-bit random draws compared with quantised thresholds), and the
output depends only on the arguments. Memory stays near the output size: 8 bytes per
undirected edge key while drawing, then ``edge_index`` (16 bytes per directed edge) and
``feat``.

:func:`write_ogb_binary` writes a :class:`GraphData` in OGB's binary raw layout (what
ogbn-papers100M uses; ogb's ``read_binary_graph_raw`` reads it): ``raw/data.npz`` with
``edge_index`` ``[2, E]`` int64, ``node_feat`` ``[N, F]`` float32, ``num_nodes_list``
``[N]`` and ``num_edges_list`` ``[E]``; ``raw/node-label.npz`` with ``node_label`` ``[N,
1]``; ``split/<name>/{train,valid,test}.csv.gz``; ``RELEASE_v1.txt`` and ``meta.json``
(``binary`` "True"). ``partition-ogbn --dataset-dir DIR`` reads it through ogb.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from partition.graph_data import DatasetError, GraphData
from partition.synthetic import _merge_unique, _write_int_csv

__all__ = ["generate_rmat", "GENERATOR_VERSION", "write_ogb_binary", "DEFAULT_PROBS", "DEFAULT_NOISE",
           "DEFAULT_TRAIN_FRAC", "DEFAULT_VALID_FRAC", "level_probs"]

GENERATOR_VERSION = 1  # bump when the same arguments give another graph (cache names use it)
DEFAULT_PROBS = (0.57, 0.19, 0.19)  # a, b, c; d = 1 - a - b - c (Graph500)
DEFAULT_NOISE = 0.1
DEFAULT_TRAIN_FRAC = 0.1   # ~ ogbn-products: 196k train seeds of 2.45M nodes
DEFAULT_VALID_FRAC = 0.05
_NEIGHBOUR_WEIGHT = 2.0
_CHUNK = 1 << 20  # edges drawn per vectorised step
_MAX_ROUNDS = 12  # draw rounds (duplicates topped up) before settling for fewer edges
_Q = 1 << 16      # quadrant thresholds are quantised to 16 bits


def _check_args(num_nodes, avg_degree, feat_dim, num_classes, a, b, c, noise, train_frac,
                valid_frac, test_frac) -> None:
    problems = []
    if int(num_nodes) < 2:
        problems.append(f"num_nodes={num_nodes} must be >= 2")
    if not avg_degree >= 0:
        problems.append(f"avg_degree={avg_degree} must be >= 0")
    if int(feat_dim) < 1:
        problems.append(f"feat_dim={feat_dim} must be >= 1")
    if int(num_classes) < 1:
        problems.append(f"num_classes={num_classes} must be >= 1")
    d = 1.0 - a - b - c
    if not (a > 0 and b >= 0 and c >= 0 and d >= -1e-9):
        problems.append(f"RMAT probabilities a={a:g}, b={b:g}, c={c:g} must be >= 0 (a > 0) "
                        f"with a + b + c <= 1 (d = 1 - a - b - c = {d:g})")
    elif not 0 <= noise <= min(b, c, (a + max(d, 0.0)) / 2):
        problems.append(f"noise={noise:g} must be within [0, min(b, c, (a + d) / 2)] = "
                        f"[0, {min(b, c, (a + max(d, 0.0)) / 2):g}] (else a level's "
                        "probabilities go negative)")
    fracs = [train_frac, valid_frac] + ([] if test_frac is None else [test_frac])
    if not (all(f >= 0 for f in fracs) and sum(fracs) <= 1.0 + 1e-9):
        problems.append(f"train_frac={train_frac}, valid_frac={valid_frac}, test_frac="
                        f"{test_frac} must be >= 0 with sum <= 1")
    if problems:
        raise DatasetError("RMAT graph: " + "; ".join(problems))


def level_probs(rng, scale: int, a: float, b: float, c: float, noise: float) -> np.ndarray:
    """``[scale, 4]`` quadrant probabilities (a, b, c, d) per level, noisy (see the module
    docstring); each row sums to one."""
    d = max(0.0, 1.0 - a - b - c)
    mu = rng.uniform(-noise, noise, size=scale) if noise > 0 else np.zeros(scale)
    ad = a + d
    p = np.stack([a - 2 * mu * a / ad, b + mu, c + mu, d - 2 * mu * d / ad], axis=1)
    p = np.maximum(p, 0.0)
    return p / p.sum(axis=1, keepdims=True)


def _thresholds(p: np.ndarray) -> np.ndarray:
    """Cumulative 16-bit thresholds ``[scale, 3]`` (a, a + b, a + b + c) per level."""
    cum = np.cumsum(p[:, :3], axis=1)
    return np.clip(np.round(cum * _Q), 0, _Q).astype(np.int64)


def _ge(r: np.ndarray, t: int, out: np.ndarray) -> np.ndarray:
    """``r >= t`` into ``out`` for 16-bit ``r`` (``t`` up to ``2 ** 16``)."""
    if t >= _Q:
        out[:] = False
        return out
    return np.greater_equal(r, np.uint16(t), out=out)


def _draw_pairs(rng, count: int, thr: np.ndarray, id_dtype) -> tuple[np.ndarray, np.ndarray]:
    """``count`` RMAT draws ``(u, v)`` over ``2 ** scale`` ids (not yet range-checked)."""
    u = np.zeros(count, dtype=id_dtype)
    v = np.zeros(count, dtype=id_dtype)
    lo = np.empty(count, dtype=bool)
    hi = np.empty(count, dtype=bool)
    dq = np.empty(count, dtype=bool)
    for t1, t2, t3 in thr.tolist():
        # 16 random bits per draw: raw 64-bit generator output, four draws per word
        r = rng.bit_generator.random_raw((count + 3) // 4).view(np.uint16)[:count]
        np.left_shift(u, 1, out=u)
        np.left_shift(v, 1, out=v)
        # quadrant: [0, t1) a: (0, 0); [t1, t2) b: (0, 1); [t2, t3) c: (1, 0); [t3, Q) d: (1, 1)
        _ge(r, t2, hi)                                        # row bit: c or d
        np.bitwise_or(u, hi, out=u)
        _ge(r, t1, lo)
        np.not_equal(lo, hi, out=lo)                          # b
        np.bitwise_or(lo, _ge(r, t3, dq), out=lo)             # or d: column bit
        np.bitwise_or(v, lo, out=v)
    return u, v


def _draw_keys(rng, draws: int, n: int, thr: np.ndarray, pbar) -> np.ndarray:
    """``draws`` RMAT draws as undirected keys ``min * n + max``, those with ids in range
    and no self loop (so fewer than drawn; the caller tops up)."""
    id_dtype = np.uint32 if n <= 2**32 else np.uint64
    out = []
    for s in range(0, draws, _CHUNK):
        b = min(_CHUNK, draws - s)
        u, v = _draw_pairs(rng, b, thr, id_dtype)
        ok = (u < n) & (v < n) & (u != v)
        u, v = u[ok].astype(np.int64), v[ok].astype(np.int64)
        key = np.minimum(u, v)
        key *= n
        key += np.maximum(u, v)
        out.append(key)
        if pbar is not None:
            pbar.update(b)
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def _edge_keys(rng, m_target: int, n: int, thr: np.ndarray, progress: bool) -> np.ndarray:
    """``m_target`` distinct sorted undirected keys (fewer if the rounds run out)."""
    pbar = tqdm(total=0, desc="rmat edge draws", unit="edge", unit_scale=True,
                file=sys.stderr, disable=not progress)
    keys = np.empty(0, dtype=np.int64)
    accept = 0.5  # distinct, in-range, non-loop draws per draw: measured after each round
    for _ in range(_MAX_ROUNDS):
        want = m_target - keys.shape[0]
        if want <= 0:
            break
        draws = int(want * 1.02 / accept) + 16
        pbar.total += draws
        before = keys.shape[0]
        keys = _merge_unique(keys, _draw_keys(rng, draws, n, thr, pbar))
        accept = max((keys.shape[0] - before) / draws, 0.02)
    pbar.close()
    if keys.shape[0] > m_target:  # drop a random surplus
        drop = rng.choice(keys.shape[0], keys.shape[0] - m_target, replace=False)
        keep = np.ones(keys.shape[0], dtype=bool)
        keep[drop] = False
        keys = keys[keep]
    return keys


def _edge_index(keys: np.ndarray, perm: np.ndarray, n: int) -> np.ndarray:
    """``[2, 2 m]`` int64: each key as ``(u -> v), (v -> u)`` at ``2k, 2k + 1``, ids permuted.
    The caller drops ``keys`` right after."""
    m = int(keys.shape[0])
    ei = np.empty((2, 2 * m), dtype=np.int64)
    for s in range(0, m, _CHUNK):
        k = keys[s: s + _CHUNK]
        e = s + k.shape[0]
        u, v = perm[k // n], perm[k % n]
        ei[0, 2 * s: 2 * e: 2] = u
        ei[1, 2 * s: 2 * e: 2] = v
        ei[0, 2 * s + 1: 2 * e: 2] = v
        ei[1, 2 * s + 1: 2 * e: 2] = u
    return ei


def _features(rng, n: int, d: int, progress: bool) -> np.ndarray:
    feat = np.empty((n, d), dtype=np.float32)
    rows = max(1, (8 * _CHUNK) // d)
    for s in tqdm(range(0, n, rows), desc="rmat features", file=sys.stderr,
                  disable=not progress):
        e = min(n, s + rows)
        feat[s:e] = rng.standard_normal((e - s, d), dtype=np.float32)
    return feat


def neighbour_mean(src: np.ndarray, dst: np.ndarray, x: np.ndarray, n: int) -> np.ndarray:
    """``[n, k]``: row i is the mean of ``x[j]`` over edges ``j -> i`` (0 with none)."""
    import scipy.sparse as sp

    idx_dtype = np.int32 if max(n, src.shape[0]) < 2**31 else np.int64
    a = sp.csr_matrix((np.ones(src.shape[0], dtype=np.float32),
                       (dst.astype(idx_dtype), src.astype(idx_dtype))), shape=(n, n))
    deg = np.diff(a.indptr).astype(np.float32)
    out = np.asarray(a @ x, dtype=np.float32)
    out /= np.maximum(deg, 1.0)[:, None]
    return out


def _labels(rng, feat: np.ndarray, ei: np.ndarray, n: int, c: int) -> np.ndarray:
    """Arg max of ``x_i W + w * mean_{j in N(i)} x_j W`` (see the module docstring)."""
    if c == 1:
        return np.zeros(n, dtype=np.int64)
    w = rng.standard_normal((feat.shape[1], c)).astype(np.float32)
    w /= np.float32(math.sqrt(feat.shape[1]))
    proj = np.empty((n, c), dtype=np.float32)
    rows = max(1, (8 * _CHUNK) // max(feat.shape[1], c))
    for s in range(0, n, rows):
        np.matmul(feat[s: s + rows], w, out=proj[s: s + rows])
    score = neighbour_mean(ei[0], ei[1], proj, n)
    score *= np.float32(_NEIGHBOUR_WEIGHT)
    score += proj
    return np.argmax(score, axis=1).astype(np.int64)


def _splits(rng, deg: np.ndarray, n: int, train_frac: float, valid_frac: float,
            test_frac: float | None):
    """Random train / valid / test, drawn from nodes with neighbours first; each sorted."""
    order = rng.permutation(n)
    order = order[np.argsort(deg[order] == 0, kind="stable")]  # isolated nodes last
    n_train = int(round(train_frac * n))
    n_valid = min(n - n_train, int(round(valid_frac * n)))
    rest = n - n_train - n_valid
    n_test = rest if test_frac is None else min(rest, int(round(test_frac * n)))
    cuts = np.cumsum([n_train, n_valid, n_test])
    train, valid, test = order[:cuts[0]], order[cuts[0]:cuts[1]], order[cuts[1]:cuts[2]]
    return (np.sort(train).astype(np.int64), np.sort(valid).astype(np.int64),
            np.sort(test).astype(np.int64))


def generate_rmat(
    num_nodes: int,
    avg_degree: float = 20,
    feat_dim: int = 100,
    num_classes: int = 47,
    seed: int = 0,
    *,
    a: float = DEFAULT_PROBS[0],
    b: float = DEFAULT_PROBS[1],
    c: float = DEFAULT_PROBS[2],
    noise: float = DEFAULT_NOISE,
    train_frac: float = DEFAULT_TRAIN_FRAC,
    valid_frac: float = DEFAULT_VALID_FRAC,
    test_frac: float | None = None,
    progress: bool = True,
    name: str | None = None,
) -> GraphData:
    """Generate an undirected RMAT node-classification graph (see the module docstring).

    ``avg_degree`` counts directed edges per node (both directions of an undirected edge),
    as in :func:`partition.synthetic.generate`. ``a``, ``b``, ``c`` are the quadrant
    probabilities (``d = 1 - a - b - c``), ``noise`` the per-level noise amplitude. Splits:
    ``train_frac`` / ``valid_frac`` / ``test_frac`` of the nodes (``None``: all the rest).
    Deterministic for given arguments.
    """
    _check_args(num_nodes, avg_degree, feat_dim, num_classes, a, b, c, noise, train_frac,
                valid_frac, test_frac)
    n, fd, nc = int(num_nodes), int(feat_dim), int(num_classes)
    rng = np.random.default_rng(seed)  # one generator: the draw order below is fixed
    scale = max(1, math.ceil(math.log2(n)))
    thr = _thresholds(level_probs(rng, scale, a, b, c, noise))
    m_target = min(int(round(n * avg_degree / 2)), n * (n - 1) // 2)
    keys = _edge_keys(rng, m_target, n, thr, progress) if m_target > 0 else \
        np.empty(0, dtype=np.int64)
    perm = rng.permutation(n)
    ei = _edge_index(keys, perm, n)
    del keys, perm
    feat = _features(rng, n, fd, progress)
    label = _labels(rng, feat, ei, n, nc)
    deg = np.bincount(ei[1], minlength=n)
    train, valid, test = _splits(rng, deg, n, train_frac, valid_frac, test_frac)
    return GraphData(name=name or f"rmat-{n}", num_nodes=n, src=ei[0], dst=ei[1], feat=feat,
                     label=label, train=train, valid=valid, test=test, num_classes=nc)


# ---------------------------------------------------------------------------------------
# OGB binary raw layout writer


def ogb_meta(name: str, num_classes: int, split_name: str, *, binary: bool,
             add_inverse_edge: bool) -> dict:
    """The ``meta.json`` that ogb accepts as ``meta_dict`` (plus ``"name"``)."""
    return {
        "name": name,
        "num tasks": 1,
        "num classes": num_classes,
        "eval metric": "acc",
        "task type": "multiclass classification",
        "download_name": name,
        "version": 1,
        "url": "",
        "add_inverse_edge": "True" if add_inverse_edge else "False",
        "has_node_attr": "True",
        "has_edge_attr": "False",
        "split": split_name,
        "additional node files": "None",
        "additional edge files": "None",
        "is hetero": "False",
        "binary": "True" if binary else "False",
    }


def fresh_raw_dirs(out: Path, split_name: str) -> tuple[Path, Path]:
    """``out/raw`` and ``out/split/<split_name>``, created empty (replaced if they exist)."""
    raw, split = out / "raw", out / "split" / split_name
    for p in (raw, split):
        if p.exists():
            shutil.rmtree(p)
        p.mkdir(parents=True)
    return raw, split


def write_ogb_binary(data: GraphData, out_dir: str | Path, *, split_name: str = "random",
                     progress: bool = True) -> Path:
    """Write ``data`` in OGB's binary raw layout under ``out_dir`` (created; its ``raw/``
    and ``split/<split_name>/`` replaced). Every directed edge is written (ogb's binary
    reader refuses ``add_inverse_edge``), in order, so :func:`partition.ogbn.load_ogb`
    returns the same edges, features, labels and splits. ``data.npz`` is uncompressed (no
    inflate step when loading)."""
    data.validate()
    out = Path(out_dir)
    raw, split = fresh_raw_dirs(out, split_name)
    steps = tqdm(total=3, desc=f"write OGB binary {out}", file=sys.stderr,
                 disable=not progress)
    e = data.num_edges
    if (data.src.base is not None and data.src.base is data.dst.base
            and data.src.base.shape == (2, e)):
        edge_index = data.src.base  # the [2, E] array generate_rmat made: no copy
    else:
        edge_index = np.stack([data.src, data.dst])
    np.savez(raw / "data.npz", edge_index=edge_index, node_feat=data.feat,
             num_nodes_list=np.array([data.num_nodes], dtype=np.int64),
             num_edges_list=np.array([e], dtype=np.int64))
    steps.update()
    np.savez(raw / "node-label.npz", node_label=data.label.reshape(-1, 1))
    steps.update()
    for s in ("train", "valid", "test"):
        _write_int_csv(split / f"{s}.csv.gz", [data.split(s)])
    steps.update()
    steps.close()
    (out / "RELEASE_v1.txt").write_text("v1")
    meta = ogb_meta(data.name, data.num_classes, split_name, binary=True,
                    add_inverse_edge=False)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out
