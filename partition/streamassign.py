"""Streaming node-to-part assignment (Fennel / LDG) in memory linear in nodes, not edges.

:func:`stream_assign` places every node in one of ``num_parts`` parts by streaming the nodes
and scoring each part by how many of the node's neighbours it already holds, penalised by
its size:

* **Fennel** (Tsourakakis et al., WSDM 2014): ``score_i = |N(v) ∩ P_i| - alpha * gamma *
  |P_i| ** (gamma - 1)`` with ``gamma = 1.5`` and ``alpha = sqrt(k) * m / n ** 1.5`` (``m``
  undirected edges, taken as half the directed edges streamed).
* **LDG** (Stanton & Kliot, KDD 2012): ``score_i = |N(v) ∩ P_i| * (1 - |P_i| / C)``, where
  ``|P_i|`` and ``C`` are the size and capacity of the part in the node's balance group
  (below).

**Balance** is a hard capacity on two groups of nodes, training seeds and the rest (the
same split :func:`partition.partitioner._random_assign` deals separately): part ``i`` may
hold at most ``ceil(T / k * (1 + epsilon))`` training seeds and ``ceil((n - T) / k * (1 +
epsilon))`` other nodes, so both groups are always placeable and

* ``train_balance`` (max/mean seeds per part) ``<= ceil(T / k * (1 + eps)) / (T / k)``,
  i.e. ``1 + eps`` up to one seed of rounding (``1.05`` with the default ``eps = 0.05``);
* ``node_balance`` ``<= 1 + eps + 2 k / n`` (the two groups' roundings).

A node never goes to a part that is full for its group; when every part holding its
neighbours is full it goes to the best-scoring part with room.

**Blocks**: nodes are streamed in blocks of ``block_nodes`` consecutive ids, vectorised with
numpy: per block, the current part of every neighbour is looked up, ``(node, part)``
neighbour counts come from one ``bincount``, every node gets the argmax of its scores over
the parts with room, and nodes that would overfill a part are moved, best scores first, to
their next choice (see :func:`_place_block`). Part sizes are updated between blocks, so the
nodes of one block do not see each other's placement; ``block_nodes=1`` is exact
one-node-at-a-time streaming (slow: a Python step per node). What matters is the block's
share of the stream: the default (:func:`auto_block_nodes`, ``n / 1024`` within [16, 4096])
cut about as many edges as ``block_nodes=1`` on products-shaped graphs of 50k and 200k nodes
(4 parts), while blocks of 0.5% of the nodes cost ~4 points of cut in pass 1 and 2% ~10.

**Passes** (re-streaming, Nishimura & Ugander, KDD 2013): pass 1 sees only the neighbours
already placed in it; pass 2 and later stream the nodes again with the part sizes starting
from zero, looking neighbours up in the latest assignment (this pass's where a neighbour was
already placed again, the previous pass's otherwise). Each pass typically cuts fewer edges.

**Stream order**: node id order by default (``order="natural"``), which is the order the
input gives and is good when ids carry locality (crawl or community order). When ids are
random with respect to structure, streaming quality is that of a random order (below METIS;
re-streaming passes recover much of the gap). ``order="random"`` streams the node-range
groups and the blocks within each in a seeded random order (a different one each pass).

**Memory**: adjacency is never held whole. One pass over ``edge_chunks()`` appends each
directed edge ``(src, dst)`` as the key ``src * n + dst`` to the node-range bucket of
``src`` (:class:`partition.buckets.BucketFiles`, plain files under ``tmp_dir``: 8 bytes per
directed edge on disk). Each pass then loads consecutive buckets whose edges fit the group
budget, sorts them (so a block's out-edges are one slice; pass 1 writes the sorted keys back
over the bucket files, so later passes only read) and streams that node range. In
memory at once: the part array (8 bytes per node), a boolean seed mask (1 byte per node),
one group of edge keys (sized from ``budget_bytes``) and bounded per-chunk/per-block
temporaries; :func:`assign_bytes` is the minimum. Only out-edges are bucketed: for an
undirected graph (both directions streamed) they are all the neighbours; a directed graph
should be streamed with both directions (``symmetrize=True`` adds the reverse of every
edge).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from partition.buckets import BucketFiles
from partition.outdir import PartitionError

__all__ = ["stream_assign", "assign_bytes", "auto_block_nodes", "STREAM_METHODS",
           "DEFAULT_EPSILON"]

STREAM_METHODS = ("fennel", "ldg")
DEFAULT_EPSILON = 0.05  # hard capacity: (1 + eps) x the mean, per group (seeds / others)
_BLOCK_FRACTION = 1024  # auto block: n / 1024 nodes, within [16, 4096]
_BLOCK_MIN, _BLOCK_MAX = 16, 4096
FENNEL_GAMMA = 1.5
_MAX_BUCKETS = 1024  # node-range buckets (files); loads group consecutive ones
_MIN_BUCKET_NODES = 1024
_NODE_BYTES = 8 + 1  # part (int64) + seed mask (bool) per node
_MIN_REST = 2 << 20  # the least budget beyond the node arrays (buffers, one small group)
_PER_CHUNK_EDGE = 48  # bytes per edge of a sub-chunk in flight (ids, keys, BucketFiles.add)
_BLOCK_EDGE = 64  # bytes per edge of one block's temporaries
_NEG = -np.inf


def assign_bytes(method: str, n: int, e: int, num_parts: int) -> int:
    """Minimum memory (bytes) :func:`stream_assign` needs for ``n`` nodes and ``e`` directed
    edges: its node arrays, one bucket of the finest split (``8 e / 1024`` bytes, or one
    bucket per 1024 nodes when that is coarser), the bucket files' write buffers and the
    per-chunk and per-block temporaries (a sum, though bucketing and the passes do not
    overlap: conservative). ``budget_bytes`` below this is refused. It does not include the
    interpreter and libraries (~100 MB with numpy and torch imported) nor the caller's edge
    chunks. ``method`` and ``num_parts`` change it by less than a block's temporaries (kept
    in the signature for :mod:`partition.memplan`)."""
    if method not in STREAM_METHODS:
        raise PartitionError(f"unknown streaming method {method!r}; choose one of "
                             f"{', '.join(STREAM_METHODS)}")
    n, e, k = int(n), int(e), max(1, int(num_parts))
    nb = _num_buckets(n, e, None)
    bucket_edges = -(-e // nb)
    return (_NODE_BYTES * n + 8 * bucket_edges + nb * 4096 * 8 + _MIN_REST
            + 4 * _BLOCK_MAX * k * 8)


def auto_block_nodes(n: int) -> int:
    """Default nodes per vectorised block: ``n / 1024`` within [16, 4096]. Measured on
    products-shaped synthetic graphs (4 parts): blocks of up to ~0.1% of the nodes cut
    about as few edges as one-node-at-a-time streaming; 0.5% costs ~4 points of cut in
    pass 1, 2% ~10 points (the nodes of a block see stale part sizes and each other's
    neighbours unplaced)."""
    return int(min(_BLOCK_MAX, max(_BLOCK_MIN, int(n) // _BLOCK_FRACTION)))


def _num_buckets(n: int, e: int | None, group_bytes: int | None) -> int:
    """Node-range buckets: enough that one bucket is well under the group budget (4 per
    group) when ``e`` is known, never more than one per ``_MIN_BUCKET_NODES`` nodes or
    ``_MAX_BUCKETS`` in all."""
    cap = max(1, min(_MAX_BUCKETS, -(-n // _MIN_BUCKET_NODES)))
    if e is None or group_bytes is None:
        return cap
    want = -(-4 * 8 * int(e) // max(1, int(group_bytes)))
    return int(min(cap, max(1, want)))


def _chunks(src: np.ndarray, dst: np.ndarray, rows: int) -> Iterator[tuple[np.ndarray, ...]]:
    for s in range(0, src.shape[0], rows):
        yield src[s:s + rows], dst[s:s + rows]


def _bucket_edges(bf: BucketFiles, edge_chunks: Callable[[], Iterable], n: int, span: int,
                  rows: int, symmetrize: bool, progress: bool) -> int:
    """Append every streamed edge's key ``src * n + dst`` to the bucket of ``src``; return
    the number of directed edges bucketed."""
    total = 0
    bar = tqdm(desc="stream-assign: bucket edges", unit="edge", unit_scale=True,
               file=sys.stderr, disable=not progress)
    for chunk in edge_chunks():
        src_all, dst_all = chunk
        src_all, dst_all = np.asarray(src_all), np.asarray(dst_all)
        if src_all.shape != dst_all.shape or src_all.ndim != 1:
            raise PartitionError(
                f"stream_assign: an edge chunk has src {src_all.shape} and dst "
                f"{dst_all.shape}; both must be 1-D of the same length")
        for src, dst in _chunks(src_all, dst_all, rows):
            if not src.shape[0]:
                continue
            lo, hi = min(int(src.min()), int(dst.min())), max(int(src.max()), int(dst.max()))
            if lo < 0 or hi >= n:
                raise PartitionError(
                    f"stream_assign: edge endpoints span [{lo}, {hi}], outside the "
                    f"{n} nodes [0, {n}); the edge stream and num_nodes disagree")
            pairs = ((src, dst), (dst, src)) if symmetrize else ((src, dst),)
            for a, b in pairs:
                a = a.astype(np.int64, copy=False)
                key = a * n
                key += b
                bf.add(a // span, key)
                total += int(a.shape[0])
            bar.update(int(src.shape[0]))
    bar.close()
    bf.flush()
    return total


def _groups(counts: np.ndarray, span: int, n: int, group_edges: int) -> list[tuple]:
    """Consecutive buckets whose edges fit ``group_edges`` (at least one bucket each):
    ``(first bucket, last bucket + 1, node lo, node hi, edges)``."""
    out, b, nb = [], 0, counts.shape[0]
    while b < nb:
        c, end = int(counts[b]), b + 1
        while end < nb and c + int(counts[end]) <= group_edges:
            c += int(counts[end])
            end += 1
        out.append((b, end, b * span, min(n, end * span), c))
        b = end
    return out


def _load_group(bf: BucketFiles, first: int, last: int, edges: int,
                sort: bool) -> np.ndarray:
    """The keys of buckets ``first..last-1`` read into one array (no second copy), sorted.

    With ``sort`` the keys are sorted and written back over the bucket files (each bucket is
    a node range, so its keys are one slice of the sorted group, of the same length): later
    passes read them with ``sort=False`` and skip the sort, the costliest step of a pass.
    """
    keys = np.empty(edges, dtype=np.int64)
    off = 0
    for b in range(first, last):
        c = bf.count(b)
        if not c:
            continue
        view = memoryview(keys[off:off + c]).cast("B")
        with open(bf.path(b), "rb") as f:
            got = f.readinto(view)
        if got != 8 * c:
            raise OSError(f"{bf.path(b)}: read {got} bytes, expected {8 * c} (the temporary "
                          "directory was changed underneath)")
        off += c
    if sort:
        keys.sort()
        off = 0
        for b in range(first, last):
            c = bf.count(b)
            if c:
                with open(bf.path(b), "r+b") as f:
                    f.write(memoryview(keys[off:off + c]).cast("B"))
                off += c
    return keys


class _State:
    """Part array, seed mask and the current pass's per-group part sizes and capacities."""

    def __init__(self, n: int, k: int, train: np.ndarray, method: str, e: int, eps: float):
        self.n, self.k, self.method = n, k, method
        self.part = np.full(n, -1, dtype=np.int64)
        self.train = train
        t = int(np.count_nonzero(train))
        group_n = np.array([n - t, t], dtype=np.int64)  # group 0: other nodes, 1: seeds
        self.cap = np.ceil(group_n / k * (1.0 + eps) - 1e-9).astype(np.int64)
        self.cap = np.maximum(self.cap, -(-group_n // k))  # never below the exact mean
        self.size = np.zeros((2, k), dtype=np.int64)
        m = e / 2.0  # undirected edges: both directions are streamed
        self.alpha = math.sqrt(k) * m / n**1.5 if n else 0.0

    def new_pass(self) -> None:
        self.size[:] = 0

    def scores(self, counts: np.ndarray, grp: np.ndarray) -> np.ndarray:
        """``float64 [B, k]`` scores of the block's nodes (``grp``: 0 other, 1 seed), with a
        tie-break towards the emptier part (relative to its group's capacity)."""
        fill = self.size / np.maximum(self.cap, 1)[:, None]  # [2, k]
        if self.method == "fennel":
            total = self.size.sum(axis=0).astype(np.float64)
            pen = self.alpha * FENNEL_GAMMA * total ** (FENNEL_GAMMA - 1.0)
            sc = counts - pen[None, :]
        else:
            sc = counts * (1.0 - fill[grp])
        # Nodes with no placed neighbour ("blind") of one block thus all pick the same
        # emptiest part. Dealing them over the parts instead (as one-at-a-time streaming
        # would) was measured worse: 200k-node synthetic, 4 parts, random order, 4 seeds,
        # mean cut ldg 2 passes 0.27 vs 0.19, fennel 0.27 vs 0.22; the piled-up blocks seed
        # coherent regions that later nodes follow.
        sc -= 1e-7 * fill[grp]
        return sc


def _place_block(st: _State, sc: np.ndarray, grp: np.ndarray) -> np.ndarray:
    """Parts for one block: argmax of ``sc`` over parts with room for the node's group;
    where a part would overflow, the nodes with the highest scores for it stay and the
    others move to their next choice (repeated, at most k rounds)."""
    k = st.k
    room = st.cap[:, None] - st.size  # [2, k]
    sc[room[grp] <= 0] = _NEG
    out = np.empty(sc.shape[0], dtype=np.int64)
    pending = np.arange(sc.shape[0])
    while pending.size:
        s = sc[pending]
        ch = s.argmax(axis=1)
        g = grp[pending]
        key = g * k + ch
        want = np.bincount(key, minlength=2 * k).reshape(2, k)
        over = want > room
        if not over.any():
            out[pending] = ch
            room -= want
            break
        ok = ~over[g, ch]
        out[pending[ok]] = ch[ok]
        room -= np.bincount(key[ok], minlength=2 * k).reshape(2, k)
        # the contested (group, part) pairs: best scores first, up to the room left
        idx = np.flatnonzero(~ok)
        best = s[idx, ch[idx]]
        order = np.lexsort((-best, key[idx]))
        idx, kk = idx[order], key[idx][order]
        starts = np.searchsorted(kk, kk, side="left")
        rank = np.arange(kk.shape[0]) - starts
        keep = rank < room.reshape(-1)[kk]
        out[pending[idx[keep]]] = ch[idx[keep]]
        room -= np.bincount(kk[keep], minlength=2 * k).reshape(2, k)
        pending = pending[idx[~keep]]
        # those pairs are now full: nobody of that group may choose them
        full = room <= 0
        sub = sc[pending]
        sub[full[grp[pending]]] = _NEG
        sc[pending] = sub
    return out


def _stream_block(st: _State, keys: np.ndarray, lo: int, hi: int) -> None:
    """Place nodes ``[lo, hi)`` given ``keys``, the sorted keys of a group holding them."""
    n, k = st.n, st.k
    a, b = np.searchsorted(keys, [lo * n, hi * n], side="left")
    blk = keys[a:b]
    src = blk // n
    dst = blk - src * n
    src -= lo
    pn = st.part[dst]
    ok = pn >= 0
    ok &= dst != src + lo  # self loops say nothing about where to go
    cnt = np.bincount(src[ok] * k + pn[ok], minlength=(hi - lo) * k)
    counts = cnt.reshape(hi - lo, k).astype(np.float64)
    grp = st.train[lo:hi].astype(np.int64)
    sc = st.scores(counts, grp)
    parts = _place_block(st, sc, grp)
    st.part[lo:hi] = parts
    st.size += np.bincount(grp * k + parts, minlength=2 * k).reshape(2, k)


def stream_assign(
    edge_chunks: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]],
    num_nodes: int,
    train_mask: np.ndarray | None,
    num_parts: int,
    *,
    method: str = "fennel",
    passes: int = 2,
    seed: int = 0,
    tmp_dir: str | Path | None = None,
    budget_bytes: int = 1 << 30,
    progress: bool = True,
    num_edges: int | None = None,
    block_nodes: int | None = None,
    order: str = "natural",
    epsilon: float = DEFAULT_EPSILON,
    symmetrize: bool = False,
    stats: dict | None = None,
) -> np.ndarray:
    """Part (``int64 [num_nodes]``, in ``[0, num_parts)``) of every node, by streaming
    Fennel or LDG with ``passes`` passes (see the module docstring).

    ``edge_chunks()`` returns an iterator of ``(src, dst)`` integer arrays of directed edges
    (both directions of every undirected edge); it is called once: the edges are bucketed
    by source range into files under ``tmp_dir`` (the system temporary directory when
    None; removed before returning) and every pass reads them back from there.
    ``train_mask`` (bool ``[num_nodes]`` or None) marks the training seeds, balanced as their
    own group. ``budget_bytes`` bounds this function's memory: the node arrays take 9 bytes
    per node, half of the rest holds one group of edge keys (8 bytes per edge), an eighth
    the bucket write buffers; below :func:`assign_bytes` it raises. ``num_edges`` (the
    number of directed edges the stream yields, when known) sizes the buckets; without it,
    one bucket per 1024 nodes (at most 1024 buckets). ``block_nodes`` nodes are placed per
    vectorised step. ``order`` is ``"natural"`` (node id order) or ``"random"`` (seeded).
    ``epsilon`` is the capacity slack per group. ``stats``, when a dict, receives figures of
    the run (buckets, groups, seconds per pass, balances, alpha). Deterministic for given
    arguments and input.
    """
    t0 = time.perf_counter()
    n, k = int(num_nodes), int(num_parts)
    if method not in STREAM_METHODS:
        raise PartitionError(f"unknown streaming method {method!r}; choose one of "
                             f"{', '.join(STREAM_METHODS)}")
    if k < 1 or k > max(1, n):
        raise PartitionError(f"num_parts={num_parts} must be in [1, {max(1, n)}] "
                             f"for {n} nodes")
    if int(passes) < 1:
        raise PartitionError(f"passes={passes} must be >= 1")
    if block_nodes is not None and int(block_nodes) < 1:
        raise PartitionError(f"block_nodes={block_nodes} must be >= 1")
    if order not in ("natural", "random"):
        raise PartitionError(f"order={order!r} must be 'natural' or 'random'")
    if not 0.0 <= float(epsilon) <= 1.0:
        raise PartitionError(f"epsilon={epsilon} must be in [0, 1]")
    if n > 3_000_000_000:
        raise PartitionError(f"{n} nodes: edge keys (src * n + dst) would overflow int64")
    if train_mask is None:
        train = np.zeros(n, dtype=bool)
    else:
        train = np.asarray(train_mask)
        if train.shape != (n,):
            raise PartitionError(f"train_mask has shape {train.shape}, expected ({n},)")
        train = train.astype(bool, copy=False)
    if k == 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    need = assign_bytes(method, n, int(num_edges or 0), k)
    if int(budget_bytes) < need:
        raise PartitionError(
            f"stream_assign: budget_bytes={int(budget_bytes):,} is below the "
            f"{need:,} bytes that --method {method} needs for {n:,} nodes"
            + (f" and {int(num_edges):,} edges" if num_edges else "")
            + "; raise the memory limit")
    rest = int(budget_bytes) - _NODE_BYTES * n
    group_bytes = rest // 2
    block = auto_block_nodes(n) if block_nodes is None else int(block_nodes)
    nb = _num_buckets(n, num_edges, group_bytes)
    # bucket ranges are whole blocks, so the blocks (and the assignment) do not depend on
    # how the buckets are grouped into loads, i.e. on the budget
    span = _ceil_div(_ceil_div(n, nb), block) * block
    nb = _ceil_div(n, span)
    buffer_bytes = max(rest // 8, 1 << 20)
    rows = max(1 << 14, (rest // 8) // _PER_CHUNK_EDGE)
    rng = np.random.default_rng(seed)
    info: dict = {"method": method, "passes": int(passes), "block_nodes": block,
                  "order": order, "epsilon": float(epsilon), "num_buckets": nb,
                  "group_bytes": group_bytes, "pass_s": []}

    with BucketFiles(tmp_dir if tmp_dir is not None else _default_tmp(), nb,
                     buffer_bytes=buffer_bytes) as bf:
        e = _bucket_edges(bf, edge_chunks, n, span, rows, symmetrize, progress)
        info["edges"] = e
        info["bucket_s"] = round(time.perf_counter() - t0, 3)
        groups = _groups(bf.counts(), span, n, max(1, group_bytes // 8))
        info["num_groups"] = len(groups)
        info["max_group_edges"] = max(g[4] for g in groups)
        st = _State(n, k, train, method, e, float(epsilon))
        info["alpha"] = st.alpha
        for p in range(int(passes)):
            tp = time.perf_counter()
            st.new_pass()
            bar = tqdm(total=n, desc=f"stream-assign {method}: pass {p + 1}/{passes}",
                       unit="node", unit_scale=True, file=sys.stderr, disable=not progress)
            g_order = rng.permutation(len(groups)) if order == "random" else range(len(groups))
            for gi in g_order:
                first, last, lo, hi, edges = groups[gi]
                keys = _load_group(bf, first, last, edges, sort=p == 0)
                starts = np.arange(lo, hi, block, dtype=np.int64)
                if order == "random":
                    starts = rng.permutation(starts)
                for s in starts.tolist():
                    t = min(hi, s + block)
                    _stream_block(st, keys, s, t)
                    bar.update(t - s)
                del keys
            bar.close()
            info["pass_s"].append(round(time.perf_counter() - tp, 3))
    parts = st.part
    if parts.min() < 0:  # cannot happen: every node of every group is placed
        raise PartitionError("stream_assign left a node unplaced (internal error)")
    counts = np.bincount(parts, minlength=k)
    tcounts = np.bincount(parts[train], minlength=k)
    info["part_nodes"] = counts.tolist()
    info["part_train"] = tcounts.tolist()
    info["node_balance"] = float(counts.max() / counts.mean())
    info["train_balance"] = float(tcounts.max() / tcounts.mean()) if tcounts.sum() else 1.0
    info["capacity"] = {"other": int(st.cap[0]), "train": int(st.cap[1])}
    info["seconds"] = round(time.perf_counter() - t0, 3)
    if stats is not None:
        stats.update(info)
    return parts


def _ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _default_tmp() -> str:
    import tempfile

    return tempfile.gettempdir()
