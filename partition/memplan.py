"""Memory plan of ``partition-ogbn --max-memory-gb M``: what each method needs, checked before
any work, and the resident memory actually used, measured while it runs.

:func:`min_bytes` is the smallest budget a method can run in on a graph of ``n`` nodes, ``e``
directed edges and ``d``-dim features:

* **random / fennel / ldg** (the streaming pipeline of :mod:`partition.stream`): memory linear
  in nodes, never in edges or features. Per node: the part id, both relabel maps (int64 each),
  the training mask, the split ids, the pre-sampling counts and the out-degrees
  (:data:`STREAM_BYTES_PER_NODE`
  in all), plus the assignment's own arrays (:func:`assign_bytes`; for fennel / ldg the
  streaming assigner's), plus fixed-size buffers: one edge chunk (:data:`EDGE_CHUNK_BYTES_PER_ROW`
  per edge row), one feature chunk, the bucket write buffers and the smallest sort bucket
  (:data:`MIN_SORT_BYTES`) -- all sized from the budget by :func:`stream_plan`. A larger
  budget buys larger chunks and sort buckets (fewer passes over the temporary files), not
  correctness.
* **metis** (the in-memory path of :mod:`partition.partitioner`): the whole graph, its sort
  keys, DGL's symmetrised copy and METIS's own structures. Fitted to runs of this pipeline
  (see :data:`METIS_BYTES_PER_EDGE`): 80 bytes per directed edge (44 when the edges come in
  ogb's inverse pairs) plus the float32 features twice plus ~800 MiB.

:func:`check_budget` raises :class:`MemoryBudgetError` (a :class:`PartitionError`, exit 2 in
the CLI) naming the minimum and what to change. :class:`RssMonitor` polls this process's
resident set size (psutil) in a thread and keeps the peak, reported as
``peak_rss_sampled_bytes``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from partition.outdir import PartitionError

__all__ = ["MemoryBudgetError", "min_bytes", "check_budget", "stream_plan", "StreamPlan",
           "RssMonitor", "assign_bytes", "METHODS", "STREAM_METHODS", "GiB"]

GiB = 1 << 30
MiB = 1 << 20
METHODS = ("metis", "random", "fennel", "ldg")
STREAM_METHODS = ("random", "fennel", "ldg")

# interpreter, numpy, pandas / zipfile readers, tqdm: measured ~120 MiB RSS before any data
BASE_BYTES = 200 * MiB
# part id (int64), new_to_orig and orig_to_new (int64), train mask (bool), split ids (int64,
# up to one per node), hotness counts (int64), argsort's merge buffer (int64 / 2), the
# out-degrees of --node-order degree (int64, while relabelling)
STREAM_BYTES_PER_NODE = 8 + 8 + 8 + 1 + 8 + 8 + 4 + 8
# random assignment: flatnonzero + permutation + arange of a group (int64 each), live at once
RANDOM_ASSIGN_BYTES_PER_NODE = 24
# one edge chunk in flight: src, dst (+ reverses), relabelled ids, owners, keys, the bucket
# sort's order and grouped copies (int64 each)
EDGE_CHUNK_BYTES_PER_ROW = 8 * 14
MIN_EDGE_ROWS = 1 << 16
MAX_EDGE_ROWS = 1 << 22
MIN_SORT_BYTES = 32 * MiB
MIN_BUCKET_BUFFER = 8 * MiB
MAX_BUCKET_BUFFER = 256 * MiB
# the in-memory METIS path (ogb's loader, then src + dst + sort keys + DGL's graph, its
# symmetrised copy and METIS's CSR), fitted to measured peaks of `partition-ogbn --method
# metis --num-parts 4`, 100-dim float32 features, ~800 MiB of interpreter, torch and DGL and
# twice the features (ogb's array and the float32 copy) besides the edges:
# * edges given as (u, v), (v, u) pairs (ogb's add_inverse_edge, e.g. ogbn-products): DGL
#   gets one edge per pair; 7.1-7.6 GiB for 2.45M nodes / 124M directed edges (issue 12's
#   figure): ~41 bytes per directed edge, rounded up to 44;
# * reverses appended (--add-reverse-edges, the binary layout as papers100M ships): DGL
#   gets every directed edge and symmetrises them; measured here 1.47 GiB for 300k nodes /
#   12M directed edges and 4.82 GiB for 1M nodes / 50M: ~72 bytes per directed edge, rounded
#   up to 80 (the estimate is then 29% and 9% above those runs).
METIS_BYTES_PER_EDGE = 80
METIS_BYTES_PER_EDGE_PAIRED = 44
METIS_BASE_BYTES = 800 * MiB


class MemoryBudgetError(PartitionError):
    """``--max-memory-gb`` is below what the chosen method needs; nothing was done."""


def assign_bytes(method: str, n: int, e: int, num_parts: int) -> int:
    """Memory of the node assignment itself (beyond the pipeline's per-node arrays)."""
    if method == "random":
        return RANDOM_ASSIGN_BYTES_PER_NODE * n
    if method in ("fennel", "ldg"):
        try:
            from partition.streamassign import assign_bytes as stream_assign_bytes
        except ImportError:
            # the streaming assigner's own figure when it is not importable: its per-node
            # arrays (degrees, part, scores) and one adjacency block
            return 40 * n + 64 * MiB
        return int(stream_assign_bytes(method, n, e, num_parts))
    return 0


def _gb(b: float) -> str:
    return f"{b / GiB:.2f}".rstrip("0").rstrip(".") if b >= 0.01 * GiB else f"{b / GiB:.3f}"


def min_bytes(method: str, n: int, e: int, d: int, feat_itemsize: int, num_parts: int,
              *, paired: bool = False) -> int:
    """Smallest budget (bytes of resident memory) ``method`` can partition this graph in.
    ``paired``: the edges come as (u, v), (v, u) pairs (ogb's add_inverse_edge), which the
    METIS path halves before building DGL's graph."""
    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    n, e, d = int(n), int(e), int(d)
    if method == "metis":
        per_edge = METIS_BYTES_PER_EDGE_PAIRED if paired else METIS_BYTES_PER_EDGE
        return METIS_BASE_BYTES + per_edge * e + 2 * 4 * n * d
    fixed = (BASE_BYTES + STREAM_BYTES_PER_NODE * n + assign_bytes(method, n, e, num_parts)
             + EDGE_CHUNK_BYTES_PER_ROW * MIN_EDGE_ROWS + MIN_BUCKET_BUFFER + MIN_SORT_BYTES)
    feat_rows = max(1, (4 * MiB) // max(1, d * feat_itemsize))
    return fixed + 3 * feat_rows * d * max(feat_itemsize, 4)


@dataclass
class StreamPlan:
    """Buffer sizes of the streaming pipeline for one budget (see :func:`stream_plan`)."""

    budget_bytes: int | None
    edge_rows: int            # directed edges per chunk read from the source
    feat_rows: int            # feature rows per chunk
    bucket_buffer_bytes: int  # BucketFiles write buffers
    sort_bytes: int           # the largest bucket of edge keys sorted in memory at once
    assign_budget_bytes: int  # what the streaming assigner may use (fennel / ldg)


def stream_plan(method: str, n: int, e: int, d: int, feat_itemsize: int, num_parts: int,
                budget_bytes: int | None) -> StreamPlan:
    """Chunk and bucket sizes that fit ``budget_bytes`` (``None``: generous defaults)."""
    if budget_bytes is None:
        return StreamPlan(None, MAX_EDGE_ROWS, max(1, (64 * MiB) // max(1, d * feat_itemsize)),
                          64 * MiB, 2 * GiB, 4 * GiB)
    free = budget_bytes - min_bytes(method, n, e, d, feat_itemsize, num_parts)
    free = max(0, int(free * 0.8))  # keep a fifth for fragmentation and what polling misses
    # a quarter to the edge chunk, a sixteenth to bucket buffers, the rest to the sort
    rows = int(min(MAX_EDGE_ROWS, MIN_EDGE_ROWS + free // 4 // EDGE_CHUNK_BYTES_PER_ROW))
    buf = int(min(MAX_BUCKET_BUFFER, MIN_BUCKET_BUFFER + free // 16))
    sort = int(MIN_SORT_BYTES + max(0, free - (rows - MIN_EDGE_ROWS) * EDGE_CHUNK_BYTES_PER_ROW
                                    - (buf - MIN_BUCKET_BUFFER)))
    feat_rows = max(1, (min(64 * MiB, 4 * MiB + free // 64)) // max(1, d * feat_itemsize))
    # fennel / ldg run before the sort: they may use the sort's share and their own minimum
    assign = assign_bytes(method, n, e, num_parts) + sort
    return StreamPlan(int(budget_bytes), rows, int(feat_rows), buf, sort, int(assign))


def check_budget(method: str, n: int, e: int, d: int, feat_itemsize: int, num_parts: int,
                 max_memory_gb: float | None, *, paired: bool = False) -> int | None:
    """Raise :class:`MemoryBudgetError` when ``max_memory_gb`` is below :func:`min_bytes`;
    return the budget in bytes (None without a budget)."""
    if max_memory_gb is None:
        return None
    budget = int(float(max_memory_gb) * GiB)
    need = min_bytes(method, n, e, d, feat_itemsize, num_parts, paired=paired)
    if budget >= need:
        return budget
    what = (f"{n:,} nodes, {e:,} directed edges, {d}-dim features, {num_parts} part(s)")
    alt = ""
    if method == "metis":
        stream_need = min_bytes("fennel", n, e, d, feat_itemsize, num_parts)
        alt = (f", or use --method fennel (streaming, memory linear in nodes: ~{_gb(stream_need)}"
               " GB here) or --method random")
        if budget < stream_need:
            alt = (f", or use --method random / fennel (streaming; they need ~"
                   f"{_gb(stream_need)} GB here)")
    else:
        alt = ", or partition on a machine with more memory (the need grows with the nodes)"
    raise MemoryBudgetError(
        f"--max-memory-gb {max_memory_gb:g} is below the ~{_gb(need)} GB that --method {method} "
        f"needs for {what}; raise it to at least {_gb(need * 1.01 + 0.005 * GiB)}{alt}. "
        "Nothing was done")


class RssMonitor:
    """Poll this process's resident set size every ``interval_s`` in a daemon thread.

    ``peak`` is the largest RSS seen (bytes), including one sample at start and stop.
    Use as a context manager, or :meth:`start` / :meth:`stop`. Sampling misses spikes
    shorter than the interval; ``resource.getrusage``'s ``ru_maxrss``
    (:func:`partition.partitioner.peak_rss_bytes`) is the kernel's exact peak over the
    whole process lifetime and is reported beside it.
    """

    def __init__(self, interval_s: float = 0.05):
        import psutil

        self._proc = psutil.Process()
        self.interval_s = float(interval_s)
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        """One reading now (also updates ``peak``)."""
        try:
            rss = int(self._proc.memory_info().rss)
        except Exception:  # the process is exiting; keep what we have
            return self.peak
        self.samples += 1
        if rss > self.peak:
            self.peak = rss
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> RssMonitor:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop polling; return the peak."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()
        return self.peak

    def __enter__(self) -> RssMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
