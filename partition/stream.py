"""Bounded-memory partitioning: the pipeline of :mod:`partition.partitioner`, streamed.

:func:`partition_stream` writes exactly the layout of :mod:`partition.layout` (same
invariants, same relabel, same statistics) from a source read in chunks
(:func:`partition.rawstream.open_raw`, or :class:`GraphSource` over a graph in memory),
holding only per-node arrays and fixed-size buffers in memory, never the edges or the
features:

1. **Assign** every node to a part: ``random`` deals nodes round-robin from a shuffled order
   exactly as :mod:`partition.partitioner` does (the same seed gives the same assignment and
   therefore byte-identical arrays); ``fennel`` / ``ldg`` stream the edges a few passes
   through :func:`partition.streamassign.stream_assign` (balanced on nodes and training
   seeds, memory linear in nodes).
2. **Relabel** by part and, within a part, by ``node_order`` (out-degree, highest first, by
   default; the degrees counted in one more pass over the edges), as the in-memory path does.
3. **Bucket the edges** in one pass: each directed edge's key ``new_dst * n + new_src`` goes
   to the temporary file of its destination's part (:class:`partition.buckets.BucketFiles`
   under ``work_dir``), the edge cut counted on the way.
4. **Sort each part's keys** into CSC (``indptr``, ``indices``): a part whose keys fit the
   sort budget is read and sorted at once; a larger one is split by destination ranges
   (from its in-degree histogram) into sub-buckets sorted one after another.
5. **Features, labels, original ids** are appended per part from the source's chunks in
   original-id order, so every part's files are written sequentially, by chunks (``.npy``
   header first, then the rows: no ``np.memmap`` writes, so nothing written is ever
   resident). With ``node_order="id"`` new ids follow original ids within a part and these
   are the part's files; with ``"degree"`` they go to temporary files under the work
   directory and are then rewritten in new-id order, by chunks read from their map (the
   read pages dropped after each). The stored feature dtype is kept (float32 or float16).
6. **Splits**, ``orig_to_new.npy``, ``hot_rank.npy`` (a numpy neighbour sampler over the
   parts' memory-mapped CSC) and ``metadata.json`` last, everything inside
   :func:`partition.outdir.staged_out` (a failed run leaves nothing behind).

``meta.stats`` holds the keys of the in-memory path plus ``max_memory_bytes`` (the budget,
or null), ``peak_rss_sampled_bytes`` (psutil poll, :class:`partition.memplan.RssMonitor`),
``method``, ``passes`` (edge passes of the assignment, plus the bucketing pass) and
``sort_sub_buckets`` (parts that did not fit the sort budget at once, summed sub-buckets).
Halos (``halo_hops > 0``) are found over the written parts' memory-mapped CSC with one byte
of state per node (the same node sets as :mod:`partition.halo`), and their in-edges,
features and labels gathered from the owners' mapped files by slices of nodes (the touched
pages dropped after each) and written by chunks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from partition import layout, memplan
from partition.buckets import BucketFiles
from partition.graph_data import DatasetError, GraphData
from partition.hotness import rank_within_parts
from partition.layout import PartInfo, PartitionSetMeta
from partition.outdir import PartitionError, staged_out
from partition.partitioner import (
    NODE_ORDERS,
    _random_assign,
    _relabel_nodes,
    _stats,
    check_node_order,
    node_order_keys,
)

__all__ = ["partition_stream", "GraphSource", "NpyWriter", "STREAM_METHODS"]

STREAM_METHODS = memplan.STREAM_METHODS
_WRITE_CHUNK = 1 << 20  # int64 values per write of a sorted bucket


class GraphSource:
    """A :class:`GraphData` in memory seen through the ``RawSource`` interface of
    :mod:`partition.rawstream` (tests, and graphs generated in memory). Its edges are
    already directed, so ``add_reverse_edges`` is ignored."""

    def __init__(self, data: GraphData):
        data.validate()
        if data.task_type != "multiclass":
            raise PartitionError(
                f"{data.name} is a {data.num_tasks}-task {data.task_type} (multi-label) "
                "dataset; the streaming pipeline (--method fennel / ldg, or random with "
                "--max-memory-gb) writes single-task multiclass labels only: partition it "
                "in memory with --method metis or random and no --max-memory-gb")
        if data.is_typed:
            raise PartitionError(
                f"{data.name} is a typed (heterogeneous) graph; the streaming pipeline "
                "(--method fennel / ldg, or random with --max-memory-gb) handles homogeneous "
                "graphs only: partition it in memory with --method metis or random")
        self.data = data
        self.name = data.name
        self.num_nodes = int(data.num_nodes)
        self.num_stored_edges = int(data.num_edges)
        self.feat_dim = int(data.feat_dim)
        self.feat_dtype = np.dtype(data.feat.dtype)
        self.num_classes = int(data.num_classes)
        self.add_inverse_edge = False
        self.binary = False
        self.where = f"graph {data.name} (in memory)"
        self.feat_source = data.feat_source

    def num_directed_edges(self, add_reverse_edges: bool = False) -> int:
        return int(self.data.num_edges)

    def edge_chunks(self, rows: int = 1 << 22, add_reverse_edges: bool = False
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        e = self.data.num_edges
        for s in range(0, e, rows):
            yield self.data.src[s: s + rows], self.data.dst[s: s + rows]

    def feat_chunks(self, rows: int) -> Iterator[np.ndarray]:
        for s in range(0, self.num_nodes, rows):
            yield self.data.feat[s: s + rows]

    def label_chunks(self, rows: int) -> Iterator[np.ndarray]:
        for s in range(0, self.num_nodes, rows):
            yield self.data.label[s: s + rows]

    def splits(self) -> dict[str, np.ndarray]:
        return {s: np.asarray(self.data.split(s), dtype=np.int64) for s in layout.SPLITS}

    def train_mask(self) -> np.ndarray:
        return self.data.train_mask()


def _drop_pages(*arrays: np.ndarray) -> None:
    """Give back the resident pages of memory-mapped ``arrays`` (they stay readable)."""
    import mmap

    for arr in arrays:
        mm = getattr(arr, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass


class NpyWriter:
    """A ``.npy`` file written by appended C-order chunks: header first, then the rows as
    they come (plain ``file.write``), checked to fill ``shape`` exactly at :meth:`close`."""

    def __init__(self, path: str | os.PathLike, shape: tuple[int, ...], dtype):
        self.path = Path(path)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.expected = int(np.prod(self.shape, dtype=np.int64))
        self.written = 0
        self._f = open(self.path, "wb")  # noqa: SIM115  (closed by close())
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": self.shape}
        try:
            np.lib.format.write_array_header_1_0(self._f, header)
        except ValueError:  # a header over 64 KiB (absurd shapes): format 2.0
            self._f.seek(0)
            np.lib.format.write_array_header_2_0(self._f, header)

    def write(self, chunk: np.ndarray) -> None:
        chunk = np.ascontiguousarray(chunk, dtype=self.dtype)
        if self.written + chunk.size > self.expected:
            raise ValueError(f"{self.path}: {self.written + chunk.size} values written, the "
                             f"shape {self.shape} holds {self.expected}")
        chunk.tofile(self._f)
        self.written += chunk.size

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        if self.written != self.expected:
            raise ValueError(f"{self.path}: {self.written} values written, the shape "
                             f"{self.shape} needs {self.expected}")

    def abort(self) -> None:
        self._f.close()


@contextlib.contextmanager
def _filled(writers: list[NpyWriter]) -> Iterator[list[NpyWriter]]:
    """Close every writer when the block ends (each checks it was filled), or abort them all
    when it raises."""
    try:
        yield writers
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise


class _MaskGraph:
    """What :func:`partition.partitioner._random_assign` reads of a graph."""

    def __init__(self, n: int, mask: np.ndarray):
        self.num_nodes, self._mask = n, mask

    def train_mask(self) -> np.ndarray:
        return self._mask


def _bar(total: int, desc: str, progress: bool, unit: str = "edge"):
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr,
                disable=not progress)


def partition_stream(source, num_parts: int, out: str | os.PathLike, method: str = "fennel",
                     *, seed: int = 0, progress: bool = True, overwrite: bool = False,
                     max_memory_gb: float | None = None, add_reverse_edges: bool = False,
                     halo_hops: int = 0, presample_batches: int = 16, passes: int = 2,
                     work_dir: str | os.PathLike | None = None,
                     presample_fanouts: tuple[int, ...] = (15, 10, 5),
                     presample_batch_size: int = 1024,
                     sort_bytes: int | None = None,
                     node_order: str = NODE_ORDERS[0]) -> PartitionSetMeta:
    """Partition ``source`` (a ``RawSource`` or :class:`GraphSource`) into ``num_parts``
    parts under ``out`` with bounded memory (module docstring); return the metadata.
    ``halo_hops`` (0-3) adds halos as :func:`partition.partitioner.partition_graph` does.

    ``max_memory_gb``: the budget; below what ``method`` needs
    (:func:`partition.memplan.min_bytes`) it raises :class:`memplan.MemoryBudgetError`
    before anything is read or written. ``work_dir``: where the temporary bucket files go
    (default: inside the staging directory beside ``out``, same filesystem); they take
    about 8 bytes per directed edge and are deleted before returning. ``sort_bytes``
    overrides the plan's largest in-memory sort (a smaller one splits parts into more
    sub-buckets; the output is the same). ``node_order``: how each part's nodes are ordered
    (:data:`partition.partitioner.NODE_ORDERS`; ``"degree"`` costs one more edge pass and a
    rewrite of the feature files).
    """
    t0 = time.perf_counter()
    if not isinstance(num_parts, (int, np.integer)) or num_parts < 1:
        raise PartitionError(f"num_parts={num_parts} must be a positive integer")
    if method == "metis":
        raise PartitionError(
            "--method metis partitions in memory (METIS needs the whole graph); the streaming "
            "pipeline runs --method random, fennel or ldg. partition-ogbn runs metis in "
            "memory when --max-memory-gb allows it")
    if method not in STREAM_METHODS:
        raise PartitionError(f"unknown streaming method {method!r}; choose one of "
                             f"{', '.join(STREAM_METHODS)}")
    if not isinstance(halo_hops, (int, np.integer)) or not 0 <= halo_hops <= 3:
        raise PartitionError(f"halo_hops={halo_hops} must be 0, 1, 2 or 3")
    if not isinstance(passes, (int, np.integer)) or passes < 1:
        raise PartitionError(f"passes={passes} must be >= 1")
    check_node_order(node_order)
    n, k = int(source.num_nodes), int(num_parts)
    if k > n:
        raise PartitionError(f"num_parts={k} exceeds the {n} nodes of {source.name}")
    if n > 3_000_000_000:
        raise PartitionError(f"{n} nodes: edge sort keys (dst * n + src) would overflow int64")
    # the exact count may need a pass over the edges (self loops are not reversed): use the
    # headers' upper bound for the budget and for sizing, count while bucketing
    doubled = bool(getattr(source, "add_inverse_edge", False)) or (
        add_reverse_edges and not isinstance(source, GraphSource))
    e = int(source.num_stored_edges) * (2 if doubled else 1)
    d = int(source.feat_dim)
    feat_dtype = np.dtype(source.feat_dtype)
    if feat_dtype.name not in layout.FEAT_DTYPES:
        raise DatasetError(f"{source.where}: features are {feat_dtype}; expected float32 or "
                           "float16")
    budget = memplan.check_budget(method, n, e, d, feat_dtype.itemsize, k, max_memory_gb)
    plan = memplan.stream_plan(method, n, e, d, feat_dtype.itemsize, k, budget)
    if sort_bytes is not None:
        plan.sort_bytes = max(8, int(sort_bytes))
    args = _Args(source, k, method, seed, progress, add_reverse_edges, passes, plan,
                 (presample_batches, tuple(presample_fanouts), presample_batch_size), n, e, d,
                 feat_dtype, t0)
    args.halo_hops = int(halo_hops)
    args.node_order = node_order
    with memplan.RssMonitor() as monitor, staged_out(out, overwrite) as tmp:
        parent = Path(work_dir) if work_dir else tmp
        parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".stream-work-", dir=parent))
        try:
            return _write_set(args, tmp, work, Path(out), monitor)
        finally:
            shutil.rmtree(work, ignore_errors=True)


class _Args:
    def __init__(self, source, k, method, seed, progress, add_reverse_edges, passes, plan,
                 presample, n, e, d, feat_dtype, t0):
        self.source, self.k, self.method, self.seed = source, k, method, int(seed)
        self.progress, self.add_reverse_edges, self.passes = progress, add_reverse_edges, passes
        self.plan, self.presample, self.n, self.e, self.d = plan, presample, n, e, d
        self.feat_dtype, self.t0 = feat_dtype, t0


def _assign(a: _Args, work: Path) -> np.ndarray:
    """Step 1: the part of every node (int64 [n]), checked."""
    n, k = a.n, a.k
    mask = np.asarray(a.source.train_mask(), dtype=bool)
    if mask.shape != (n,):
        raise DatasetError(f"{a.source.where}: train mask has shape {mask.shape}, expected "
                           f"({n},)")
    if k == 1:
        parts = np.zeros(n, dtype=np.int64)
    elif a.method == "random":
        parts = _random_assign(_MaskGraph(n, mask), k, a.seed)
    else:
        try:
            from partition.streamassign import stream_assign
        except ImportError as e:
            raise PartitionError(f"--method {a.method} needs partition.streamassign, which "
                                 f"cannot be imported ({e}); use --method random") from e
        parts = stream_assign(
            lambda: a.source.edge_chunks(a.plan.edge_rows, a.add_reverse_edges), n, mask, k,
            method=a.method, passes=a.passes, seed=a.seed, tmp_dir=str(work),
            budget_bytes=a.plan.assign_budget_bytes, progress=a.progress, num_edges=a.e)
        parts = np.asarray(parts)
    if parts.shape != (n,) or (n and (parts.min() < 0 or parts.max() >= k)):
        raise PartitionError(f"part assignment is malformed (shape {parts.shape}, range "
                             f"[{parts.min()}, {parts.max()}])")
    return parts.astype(np.int64, copy=False)


def _checked_edges(a: _Args, src, dst, seen: int) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of the source's edges as int64 arrays, every endpoint checked to be a node."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.size:
        lo, hi = min(src.min(), dst.min()), max(src.max(), dst.max())
        if lo < 0 or hi >= a.n:
            raise DatasetError(f"{a.source.where}: edge endpoint {lo if lo < 0 else hi} "
                               f"(near directed edge {seen}) is outside [0, {a.n}); fix the "
                               "edge list")
    return src, dst


def _out_degrees(a: _Args) -> np.ndarray:
    """Step 2 for ``node_order="degree"``: every node's out-degree (int64 [n]), one pass."""
    deg = np.zeros(a.n, dtype=np.int64)
    seen = 0
    bar = _bar(a.e, "count degrees", a.progress)
    for src, dst in a.source.edge_chunks(a.plan.edge_rows, a.add_reverse_edges):
        src, _ = _checked_edges(a, src, dst, seen)
        deg += np.bincount(src, minlength=a.n)
        seen += src.shape[0]
        bar.update(src.shape[0])
    bar.close()
    return deg


def _bucket_edges(a: _Args, parts: np.ndarray, orig_to_new: np.ndarray, buckets: BucketFiles
                  ) -> np.ndarray:
    """Step 3: every directed edge's key into its destination part's bucket; the per-part
    edge cut (edges stored in part p whose source lies elsewhere)."""
    n, k = a.n, a.k
    part_cut = np.zeros(k, dtype=np.int64)
    seen = 0
    bar = _bar(a.e, "bucket edges", a.progress)
    for src, dst in a.source.edge_chunks(a.plan.edge_rows, a.add_reverse_edges):
        src, dst = _checked_edges(a, src, dst, seen)
        if src.size == 0:
            continue
        pd = parts[dst]
        if k > 1:
            cut = parts[src] != pd
            part_cut += np.bincount(pd[cut], minlength=k)
            del cut
        key = orig_to_new[dst]
        key *= n
        key += orig_to_new[src]
        del src, dst
        buckets.add(pd, key)
        seen += key.shape[0]
        bar.update(key.shape[0])
        del key, pd
    bar.close()
    if seen > a.e:
        raise DatasetError(f"{a.source.where}: read {seen} directed edges, more than the "
                           f"{a.e} its headers allow (the edge list changed while it was read?)")
    a.e = seen  # exact from here on
    return part_cut


def _write_sorted(keys: np.ndarray, n: int, writer: NpyWriter) -> None:
    keys.sort()
    for s in range(0, keys.shape[0], _WRITE_CHUNK):
        writer.write(np.remainder(keys[s: s + _WRITE_CHUNK], n))


def _write_csc(a: _Args, buckets: BucketFiles, p: int, lo: int, hi: int, pdir: Path,
               work: Path) -> tuple[int, int]:
    """Step 4 for part ``p`` (new ids [lo, hi)): indptr.npy and indices.npy from its bucket;
    returns (edges, sub-buckets used; 0 when sorted at once)."""
    n = a.n
    m = buckets.count(p)
    cap = max(1, a.plan.sort_bytes // 8)
    writer = NpyWriter(pdir / "indices.npy", (m,), np.int64)
    with _filled([writer]):
        if m <= cap:
            keys = buckets.read(p)
            buckets.discard(p)
            keys.sort()
            indptr = np.searchsorted(keys, np.arange(lo, hi + 1, dtype=np.int64) * n)
            for s in range(0, m, _WRITE_CHUNK):
                writer.write(np.remainder(keys[s: s + _WRITE_CHUNK], n))
            del keys
            subs = 0
        else:
            deg = np.zeros(hi - lo, dtype=np.int64)
            rows = max(1 << 16, min(cap, a.plan.edge_rows))
            for block in buckets.read_chunks(p, rows):
                deg += np.bincount(block // n - lo, minlength=hi - lo)
            indptr = np.zeros(hi - lo + 1, dtype=np.int64)
            np.cumsum(deg, out=indptr[1:])
            del deg
            # destination ranges of at most ``cap`` edges each (a node's in-edges are never
            # split; a single node with more than ``cap`` in-edges gets a range of its own)
            bounds = [0]
            while indptr[bounds[-1]] < m:
                nxt = int(np.searchsorted(indptr, indptr[bounds[-1]] + cap, side="right")) - 1
                bounds.append(max(nxt, bounds[-1] + 1))
            bounds[-1] = hi - lo
            starts = np.asarray(bounds[:-1], dtype=np.int64)
            subs = len(starts)
            with BucketFiles(work, subs, a.plan.bucket_buffer_bytes) as sub:
                for block in buckets.read_chunks(p, rows):
                    sub.add(np.searchsorted(starts, block // n - lo, side="right") - 1, block)
                buckets.discard(p)
                for s in range(subs):
                    keys = sub.read(s)
                    sub.discard(s)
                    _write_sorted(keys, n, writer)
                    del keys
    layout.save_array(pdir / "indptr.npy", indptr)
    return m, subs


def _write_rows(a: _Args, parts: np.ndarray, part_nodes: np.ndarray, tmp: Path,
                new_to_orig: np.ndarray, offsets: np.ndarray, work: Path) -> None:
    """Step 5: feat.npy and label.npy of every part, appended from the source's chunks in
    original-id order; where new ids do not follow original ids within a part
    (``node_order="degree"``), into ``work`` first and then rewritten in new-id order."""
    n, k, d = a.n, a.k, a.d
    inplace = a.node_order == "id"
    for what in ("feat", "label"):
        writers = [NpyWriter(tmp / f"part-{p}" / f"{what}.npy" if inplace
                             else work / f"{what}-{p}.npy",
                             (int(part_nodes[p]), d) if what == "feat" else (int(part_nodes[p]),),
                             a.feat_dtype if what == "feat" else np.int64) for p in range(k)]
        with _filled(writers):
            rows = a.plan.feat_rows if what == "feat" else max(a.plan.feat_rows, 1 << 20)
            chunks = (a.source.feat_chunks(rows) if what == "feat"
                      else a.source.label_chunks(rows))
            r = 0
            bar = _bar(n, f"write {what}", a.progress, unit="node")
            for chunk in chunks:
                chunk = np.asarray(chunk)
                if what == "feat" and chunk.ndim == 1:
                    chunk = chunk.reshape(-1, 1)
                c = chunk.shape[0]
                if r + c > n:
                    raise DatasetError(f"{a.source.where}: more than {n} {what} rows")
                owner = parts[r: r + c]
                if k == 1:
                    writers[0].write(chunk)
                else:
                    order = np.argsort(owner, kind="stable")
                    counts = np.bincount(owner, minlength=k)
                    ends = np.cumsum(counts)
                    for p in np.flatnonzero(counts):
                        writers[p].write(chunk[order[ends[p] - counts[p]: ends[p]]])
                r += c
                bar.update(c)
            bar.close()
            if r != n:
                raise DatasetError(f"{a.source.where}: {r} {what} rows, expected {n}")
        if not inplace:
            for p in range(k):
                _reorder_rows(work / f"{what}-{p}.npy", tmp / f"part-{p}" / f"{what}.npy",
                              new_to_orig[offsets[p]: offsets[p + 1]], a.plan.feat_rows)


def _reorder_rows(src: Path, dst: Path, part_orig: np.ndarray, rows: int) -> None:
    """``dst``: the rows of ``src`` (a part's, in original-id order) in new-id order; new id
    ``lo + j`` is original id ``part_orig[j]``. Read from the map by chunks of ``rows`` new
    ids, the pages read dropped after each; ``src`` is deleted."""
    pos = np.searchsorted(np.sort(part_orig), part_orig)  # each new row's place in src
    arr = np.load(src, mmap_mode="r")
    writer = NpyWriter(dst, arr.shape, arr.dtype)
    with _filled([writer]):
        for s in range(0, pos.shape[0], max(1, rows)):
            writer.write(arr[pos[s: s + rows]])
            _drop_pages(arr)
    del arr
    src.unlink()


def _unique(x: np.ndarray) -> np.ndarray:
    """Sorted unique values (sort + mask: numpy 2's hash-based np.unique is many times
    slower on large int64 id arrays)."""
    x = np.sort(x)
    if x.size:
        x = x[np.concatenate(([True], x[1:] != x[:-1]))]
    return x


_SAMPLE_SLICE = 4096  # frontier nodes gathered per step before the mapped pages are dropped


class _MappedCSC:
    """One part's indptr / indices, memory-mapped read-only. The pages a gather touches
    count in this process's RSS until unmapped, so :meth:`drop` returns them
    (``madvise(MADV_DONTNEED)``; they stay in the page cache) after every slice of
    :data:`_SAMPLE_SLICE` nodes: resident memory stays at one slice's pages however large
    the part."""

    def __init__(self, pdir: Path):
        self.indptr = np.load(pdir / "indptr.npy", mmap_mode="r")
        self.indices = np.load(pdir / "indices.npy", mmap_mode="r")

    def drop(self) -> None:
        _drop_pages(self.indptr, self.indices)

    def sample(self, loc: np.ndarray, fanout: int, rng: np.random.Generator) -> np.ndarray:
        """In-neighbours of local nodes ``loc`` (sorted): all of them where the in-degree is
        at most ``fanout`` (or fanout < 0), else ``fanout`` uniform draws with replacement
        (a hotness ranking needs only the frequencies right)."""
        out = []
        for s in range(0, loc.size, _SAMPLE_SLICE):
            sl = loc[s: s + _SAMPLE_SLICE]
            starts = np.asarray(self.indptr[sl])
            deg = np.asarray(self.indptr[sl + 1]) - starts
            take = deg if fanout < 0 else np.minimum(deg, fanout)
            full = take == deg
            df = deg[full]
            pos_full = np.repeat(starts[full] - np.cumsum(df) + df, df) + np.arange(
                int(df.sum()))
            cnt = take[~full]
            pos_draw = np.repeat(starts[~full], cnt) + (
                rng.random(int(cnt.sum())) * np.repeat(deg[~full], cnt)).astype(np.int64)
            pos = np.sort(np.concatenate([pos_full, pos_draw]))
            if pos.size:
                out.append(np.asarray(self.indices[pos]))
            self.drop()
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def _presample_hotness(tmp: Path, offsets: np.ndarray, n: int, train: np.ndarray,
                       a: _Args) -> np.ndarray | None:
    """How often each node is an input node of pre-sampled mini-batches, sampled over the
    parts' memory-mapped CSC by numpy (memory: one batch's frontier, the counts, and one
    slice's mapped pages)."""
    batches, fanouts, batch_size = a.presample
    if batches <= 0 or train.size == 0:
        return None
    csc = [_MappedCSC(tmp / f"part-{p}") for p in range(a.k)]
    rng = np.random.default_rng(a.seed)
    counts = np.zeros(n, dtype=np.int64)
    for _ in tqdm(range(batches), desc="pre-sample hot nodes", file=sys.stderr,
                  disable=not a.progress):
        frontier = np.sort(rng.choice(train, size=min(batch_size, train.size), replace=False))
        for fanout in fanouts:
            owner = np.searchsorted(offsets, frontier, side="right") - 1
            bounds = np.searchsorted(owner, np.arange(a.k + 1))  # frontier is sorted
            nbrs = [csc[p].sample(frontier[bounds[p]: bounds[p + 1]] - offsets[p], fanout, rng)
                    for p in range(a.k) if bounds[p + 1] > bounds[p]]
            # the next layer samples from every source node of this one, destinations
            # included (as DGL's blocks do)
            frontier = _unique(np.concatenate([frontier, *nbrs]))
        counts[frontier] += 1
    return counts


class _MappedPart(_MappedCSC):
    """A written part's CSC, features and labels, memory-mapped; pages dropped on demand."""

    def __init__(self, pdir: Path):
        super().__init__(pdir)
        self.feat = np.load(pdir / "feat.npy", mmap_mode="r")
        self.label = np.load(pdir / "label.npy", mmap_mode="r")

    def drop(self) -> None:
        super().drop()
        _drop_pages(self.feat, self.label)


def _by_owner(nodes: np.ndarray, offsets: np.ndarray):
    """(part, local ids) slices of sorted global ``nodes``, at most _SAMPLE_SLICE each."""
    k = offsets.shape[0] - 1
    owner = np.searchsorted(offsets, nodes, side="right") - 1
    bounds = np.searchsorted(owner, np.arange(k + 1))
    for q in range(k):
        loc = nodes[bounds[q]: bounds[q + 1]] - offsets[q]
        for s in range(0, loc.size, _SAMPLE_SLICE):
            yield q, loc[s: s + _SAMPLE_SLICE]


def _in_edges(part: _MappedPart, loc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(in-degrees, concatenated in-neighbours) of local nodes ``loc`` of ``part``."""
    starts = np.asarray(part.indptr[loc])
    deg = np.asarray(part.indptr[loc + 1]) - starts
    pos = np.repeat(starts - np.cumsum(deg) + deg, deg) + np.arange(int(deg.sum()))
    return deg, np.asarray(part.indices[pos])


def _halo_nodes(p: int, parts: list[_MappedPart], offsets: np.ndarray, n: int, hops: int,
                rows: int) -> np.ndarray:
    """Sorted global ids of the other parts' nodes within ``hops`` in-hops of part ``p``
    (exactly partition.halo.halo_arrays' set), found with one byte of state per node."""
    lo, hi = int(offsets[p]), int(offsets[p + 1])
    state = np.zeros(n, dtype=np.int8)  # 1: own, 2: halo, 3: found this hop
    state[lo:hi] = 1
    own = parts[p]
    for s in range(0, own.indices.shape[0], rows):  # hop 1: the part's own in-edges
        chunk = np.asarray(own.indices[s: s + rows])
        state[chunk[state[chunk] == 0]] = 3
        own.drop()
    for _ in range(hops - 1):
        frontier = np.flatnonzero(state == 3)
        state[frontier] = 2
        for q, loc in _by_owner(frontier, offsets):
            _, nbrs = _in_edges(parts[q], loc)
            parts[q].drop()
            state[nbrs[state[nbrs] == 0]] = 3
        del frontier
    return np.flatnonzero(state >= 2)


def _write_halo(p: int, parts: list[_MappedPart], offsets: np.ndarray, a: _Args, pdir: Path
                ) -> tuple[int, int]:
    """halo_*.npy of part ``p``, gathered from the owners' mapped files by slices and
    written by chunks; returns (halo nodes, halo edges)."""
    halo = _halo_nodes(p, parts, offsets, a.n, a.halo_hops, max(1 << 16, a.plan.edge_rows))
    layout.save_array(pdir / "halo_nodes.npy", halo)
    h = int(halo.shape[0])
    indptr = np.zeros(h + 1, dtype=np.int64)
    i = 0
    for q, loc in _by_owner(halo, offsets):
        starts = np.asarray(parts[q].indptr[loc])
        indptr[i + 1: i + 1 + loc.size] = np.asarray(parts[q].indptr[loc + 1]) - starts
        parts[q].drop()
        i += loc.size
    np.cumsum(indptr, out=indptr)
    layout.save_array(pdir / "halo_indptr.npy", indptr)
    edges = int(indptr[-1])
    del indptr
    writers = [NpyWriter(pdir / "halo_indices.npy", (edges,), np.int64),
               NpyWriter(pdir / "halo_feat.npy", (h, a.d), a.feat_dtype),
               NpyWriter(pdir / "halo_label.npy", (h,), np.int64)]
    with _filled(writers):
        for q, loc in _by_owner(halo, offsets):
            src = parts[q]
            writers[0].write(_in_edges(src, loc)[1])
            writers[1].write(np.asarray(src.feat[loc]).reshape(loc.size, a.d))
            writers[2].write(np.asarray(src.label[loc]))
            src.drop()
    return h, edges


def _write_set(a: _Args, tmp: Path, work: Path, shown: Path,
               monitor: memplan.RssMonitor) -> PartitionSetMeta:
    n, k = a.n, a.k
    parts = _assign(a, work)  # 1.
    t_assign = time.perf_counter()
    degree = _out_degrees(a) if a.node_order == "degree" else None
    new_to_orig, orig_to_new, part_nodes, offsets = _relabel_nodes(
        parts, k, n, node_order_keys(a.node_order, degree))  # 2.
    del degree
    with BucketFiles(work, k, a.plan.bucket_buffer_bytes) as buckets:  # 3.
        part_cut = _bucket_edges(a, parts, orig_to_new, buckets)
        e = a.e
        t_relabel = time.perf_counter()
        part_edges, subs = np.zeros(k, dtype=np.int64), 0
        for p in tqdm(range(k), desc=f"sort parts for {shown}", file=sys.stderr,
                      disable=not a.progress):  # 4.
            pdir = tmp / f"part-{p}"
            pdir.mkdir()
            part_edges[p], s = _write_csc(a, buckets, p, int(offsets[p]), int(offsets[p + 1]),
                                          pdir, work)
            subs += s
    _write_rows(a, parts, part_nodes, tmp, new_to_orig, offsets, work)  # 5.
    del parts
    for p in range(k):
        layout.save_array(tmp / f"part-{p}" / "orig_ids.npy",
                          new_to_orig[offsets[p]: offsets[p + 1]])
    del new_to_orig
    halos = [(0, 0)] * k
    if a.halo_hops:
        mapped = [_MappedPart(tmp / f"part-{p}") for p in range(k)]
        halos = [_write_halo(p, mapped, offsets, a, tmp / f"part-{p}")
                 for p in tqdm(range(k), desc=f"write {a.halo_hops}-hop halos",
                               file=sys.stderr, disable=not a.progress)]
        del mapped
    splits = a.source.splits()  # 6.
    infos = []
    splits_new = {}
    for s in layout.SPLITS:
        ids = np.asarray(splits[s], dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise DatasetError(f"{a.source.where}: the {s} split names nodes outside [0, {n})")
        splits_new[s] = np.sort(orig_to_new[ids])
    del splits
    for p in range(k):
        lo, hi = int(offsets[p]), int(offsets[p + 1])
        nums = {}
        for s in layout.SPLITS:
            ids = splits_new[s]
            i, j = np.searchsorted(ids, [lo, hi])
            layout.save_array(tmp / f"part-{p}" / f"{s}.npy", ids[i:j])
            nums[s] = int(j - i)
        infos.append(PartInfo(id=p, dir=f"part-{p}", num_nodes=hi - lo,
                              num_edges=int(part_edges[p]), num_train=nums["train"],
                              num_valid=nums["valid"], num_test=nums["test"],
                              num_halo_nodes=halos[p][0], num_halo_edges=halos[p][1]))
    layout.save_array(tmp / "orig_to_new.npy", orig_to_new)
    del orig_to_new
    hot = _presample_hotness(tmp, offsets, n, splits_new["train"], a)
    del splits_new
    if hot is not None:
        layout.save_array(tmp / layout.HOT_RANK_FILE, rank_within_parts(hot, offsets))
        del hot
    t_write = time.perf_counter()
    monitor.sample()
    stats = _stats(e, part_nodes, infos, part_cut.tolist(),
                   (a.t0, t_assign, t_relabel, t_write))
    stats.update({
        "max_memory_bytes": a.plan.budget_bytes,
        "peak_rss_sampled_bytes": int(monitor.peak),
        "method": a.method,
        "passes": (a.passes if a.method in ("fennel", "ldg") and k > 1 else 0) + 1
        + (a.node_order == "degree"),
        "node_order": a.node_order,
        "sort_sub_buckets": int(subs),
        "feat_dtype": a.feat_dtype.name,
    })
    meta = PartitionSetMeta(
        dataset=a.source.name, num_parts=k, num_nodes=n, num_edges=e, feat_dim=a.d,
        num_classes=int(a.source.num_classes), node_offsets=offsets.tolist(), parts=infos,
        feat_dtype=a.feat_dtype.name, method=a.method, halo_hops=a.halo_hops,
        edge_cut=stats["edge_cut"],
        seed=a.seed, set_id=layout.new_set_id(), stats=stats)
    layout.write_metadata(tmp, meta)
    return meta
