"""Reproducible neighbour sampling: the sample is a function of the request's seed only.

A trainer that resumes from a checkpoint must see the same MFGs as an uninterrupted run, so a
``SampleRequest`` may carry a ``sample_seed`` (>= 0). The unseeded path keeps DGL's C++
sampler (``dgl.sampling.sample_neighbors``); a seeded request is sampled here instead.

Why not seed DGL: its randomness comes from per-OS-thread engines
(``RandomEngine::ThreadLocal()``). ``dgl.seed(s)`` seeds each engine with ``s +
GetThreadId()``, where the thread id is a per-process counter in the order threads first
touched an engine, and the CPU sampler's ``parallel_for`` splits rows over however many
OpenMP threads the calling thread's team has. A seeded DGL call would therefore give another
sample in a sampler thread than in a sampler process (``torch.set_num_threads(1)`` there), on
a replica whose threads started in another order, or on a machine with another core count;
and seeding a process-wide engine needs a lock that serialises every sampler thread.

What this does instead: a request-local ``numpy.random.Generator`` (PCG64) seeded with the
request's seed draws, for the rows with more in-neighbours than the fanout, first ``fanout``
positions with replacement per row (sorted; a row without a repeat is kept: conditioned on
no repeat, every set of ``fanout`` distinct positions is equally likely), then, for the rows
that repeated, a fresh draw with Floyd's algorithm (exactly uniform, ``fanout`` steps). So
DGL's semantics hold: uniform without replacement, every in-neighbour when the in-degree is
at most the fanout, fanout -1 = all. The draws depend only on the seed, the rows' degrees and
their order, never on threads or processes; a multi-hop MFG gives each hop and each part its
own seed (:func:`common.messages.derive_seed` of the sample seed, hop, part), so the server
that owns a remote part samples it exactly as the requesting server's copy would.

How it is kept fast (the same draws and the same output as the first, plainer version of
this module, checked by tests/test_seeded_sampler.py against a copy of it). Where the native
kernels are loaded (common/native.py; the default after ``deploy/install.sh``), every step
is a C pass with the GIL released: the rows' runs from the indptr; then one call that makes
the numpy generator's own draws in C (PCG64 from ``rng.bit_generator.state``, the same
doubles as ``Generator.random``: the with-replacement picks, then Floyd's uniforms for the
rows that repeated), scales them, sorts each row by rank counts in SSE2 vectors, finds the
rows with a repeat and runs Floyd on them, without arrays of draws (docs/benchmarks.md,
"session 27"); and one pass that writes every row's sources (its picks, or its whole run)
straight from the CSC indices, the next rows' memory fetched ahead (each row is a cache miss;
measured in docs/benchmarks.md, "session 21"). Otherwise (no compiler, ``MFGSERVE_NATIVE=0``,
degrees >= 2^31 - 1, indices neither int32 nor int64), every step is
one numpy/torch call over a whole hop's arrays (no Python loop over rows or edges; numpy's
loops, sorts, fancy indexing and the generator's fills run without the GIL, as does torch's
``index_select``), so a sampler thread holds the GIL only between calls. Positions are int32
while drawn (degrees < 2^31); rows with repeats are found by comparing neighbours in the
sorted picks, eight columns per 64-bit word; Floyd's per-step "already chosen" test is a
compare against the earlier steps and a branch-free blend (a masked write was several times
slower: its branches mispredict). The positions of the output edges are built as a (rows x
fanout) matrix (``start + offset``, the rows above the fanout overwritten by their picks,
the short rows' unused cells masked out) when most cells are used, else as consecutive runs
by one cumulative sum (no ``np.repeat``); the sources are then read by one
``torch.index_select`` of the CSC indices.
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import numpy as np
import torch
from torch import Tensor

from common import native

# Build the position matrix when at least this share of its rows x fanout cells are edges;
# below it (many rows under the fanout: skewed degrees) build runs and scatter the picks.
_MATRIX_MIN_FILL = 0.6
_U64 = (1 << 64) - 1
_warn_lock = threading.Lock()


def _pos_dtype(deg: np.ndarray) -> type:
    """int32 for positions within rows when every degree fits (always, in practice)."""
    return np.int32 if deg.size == 0 or int(deg.max()) < 2**31 - 1 else np.int64


def _floyd(deg: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` distinct positions in ``[0, deg[r])`` per row r (every deg > k), uniformly:
    Floyd's algorithm, one vectorised step per pick. Returns shape (rows, k).

    Step i (j = deg - k + i) picks t uniform in [0, j], or j when t was picked before."""
    u = rng.random((k, deg.size))
    it = _pos_dtype(deg)
    j = (deg - k).astype(it)[None, :] + np.arange(k, dtype=it)[:, None]
    np.multiply(u, j + 1, out=u)
    chosen = u.astype(it)  # chosen[i] = t before the "picked before" test
    for i in range(1, k):
        t = chosen[i]
        hit = (chosen[:i] == t).any(axis=0)
        step = j[i]
        np.subtract(step, t, out=step)
        np.multiply(step, hit, out=step)
        t += step  # t = j where hit, else t (branch-free)
    return chosen.T


def _rows_with_repeats(picks: np.ndarray) -> np.ndarray:
    """Indices of the rows of sorted ``picks`` (rows, k >= 2) with two equal neighbours."""
    n, k = picks.shape
    eq = np.zeros((n, (k + 6) // 8 * 8), dtype=bool)  # k - 1 flags, padded to 64-bit words
    np.equal(picks[:, 1:], picks[:, :-1], out=eq[:, :k - 1])
    words = eq.view(np.uint64)
    any_eq = words[:, 0]
    for c in range(1, words.shape[1]):
        any_eq = any_eq | words[:, c]
    return np.flatnonzero(any_eq)


def choose_positions(deg: np.ndarray, k: int, rng: np.random.Generator,
                     lib: ctypes.CDLL | None = None) -> np.ndarray:
    """``k`` distinct positions in ``[0, deg[r])`` for each row r (every deg > k), each set
    equally likely; shape (rows, k), int32 (int64 for degrees >= 2^31 - 1). Draws with
    replacement first (cheap, and rarely repeats when the degree is much larger than k); rows
    that repeated are drawn again with Floyd (their positions then in Floyd's order, not
    sorted). With ``lib`` (common/native.py) and a PCG64 ``rng`` (``np.random.default_rng``'s),
    one C call makes numpy's draws from the generator's state, scales, sorts, finds the
    repeats and runs Floyd on those rows, then leaves ``rng`` where numpy's draws would have:
    the same picks as the numpy passes, without the arrays of draws."""
    if (lib is not None and isinstance(rng.bit_generator, np.random.PCG64)
            and _pos_dtype(deg) is np.int32):
        d = np.ascontiguousarray(deg, dtype=np.int64)
        picks = np.empty((deg.size, k), dtype=np.int32)
        redo = np.empty(deg.size, dtype=np.int64)
        st = rng.bit_generator.state
        pcg = np.array([st["state"]["state"] >> 64, st["state"]["state"] & _U64,
                        st["state"]["inc"] >> 64, st["state"]["inc"] & _U64], dtype=np.uint64)
        rc = lib.mfg_draw_picks(pcg.ctypes.data, d.ctypes.data, deg.size, k, picks.ctypes.data,
                                redo.ctypes.data)
        if rc == native.NO_MEMORY:
            raise MemoryError(f"seeded sampling: no memory for the draws of {deg.size} rows x "
                              f"fanout {k} ({deg.size * k * 4} bytes)")
        if rc < 0:
            raise ValueError(f"seeded sampling: fanout {k} with a degree not in ({k}, 2^31-1)")
        st["state"]["state"] = (int(pcg[0]) << 64) | int(pcg[1])
        rng.bit_generator.state = st  # where numpy's own draws would have left it
        return picks
    r = rng.random((deg.size, k))
    np.multiply(r, deg[:, None], out=r)
    picks = r.astype(_pos_dtype(deg))
    picks.sort(axis=1)
    if k > 1:
        redo = _rows_with_repeats(picks)
        if redo.size:
            picks[redo] = _floyd(deg[redo], k, rng)
    return picks


def _runs(start: np.ndarray, counts: np.ndarray, total: int) -> np.ndarray:
    """``[start[r], start[r] + counts[r])`` for every row r (each count > 0), concatenated:
    one cumulative sum of steps (1 inside a run, the jump to the next run's start)."""
    pos = np.ones(total, dtype=np.int64)
    pos[0] = start[0]
    pos[np.cumsum(counts[:-1])] = start[1:] - (start[:-1] + counts[:-1] - 1)
    return np.cumsum(pos, out=pos)


def _index_tensor(a: np.ndarray) -> Tensor:
    """``a`` as a tensor sharing its memory (read only here). A read-only (memory-mapped)
    array makes torch warn that writing would be undefined; nothing writes it."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with _warn_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def sample_csc(indptr: np.ndarray, indices: np.ndarray, local: Tensor, fanout: int,
               seed: int) -> tuple[Tensor, Tensor]:
    """``(counts, src)`` for the rows ``local`` of a CSC (``indices[indptr[v]:indptr[v+1]]``
    are the in-neighbours of v): min(in-degree, fanout) distinct in-neighbours each (-1: all),
    concatenated in the order of ``local``; the same for the same ``seed``."""
    rows = local.numpy()
    lib = native.load()
    ip = np.asarray(indptr)
    if lib is not None and ip.dtype == np.int64 and ip.flags.c_contiguous:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        start, deg = np.empty(rows.size, dtype=np.int64), np.empty(rows.size, dtype=np.int64)
        if lib.mfg_row_runs(ip.ctypes.data, ip.size - 1, rows.ctypes.data, rows.size,
                            start.ctypes.data, deg.ctypes.data) < 0:
            raise IndexError(f"seeded sampling: a row outside the CSC's {ip.size - 1} rows")
        return sample_runs(start, deg, indices, fanout, seed)
    start = indptr[rows]
    return sample_runs(start, indptr[rows + 1] - start, indices, fanout, seed)


def sample_runs(start: np.ndarray, deg: np.ndarray, indices: np.ndarray, fanout: int,
                seed: int) -> tuple[Tensor, Tensor]:
    """:func:`sample_csc` over explicit runs: row r's candidates are
    ``indices[start[r]:start[r] + deg[r]]`` (a typed graph's one-relation run of a
    destination's in-edge segment, sampler_server/partition_store.py); the same draws as
    :func:`sample_csc` for the runs it reads from an indptr."""
    if fanout < -1:
        raise ValueError(f"fanout must be >= 0 or -1 (all in-neighbours), got {fanout}")
    counts = deg if fanout == -1 else np.minimum(deg, fanout)
    total = int(counts.sum())
    big = (np.flatnonzero(deg > fanout) if fanout > 0 and total
           else np.zeros(0, dtype=np.int64))
    lib = native.load()
    ix = np.asarray(indices)
    if (lib is not None and total and ix.dtype in (np.int32, np.int64)
            and ix.flags.c_contiguous and _pos_dtype(deg) is np.int32):
        src = _gather_native(lib, start, deg, ix, fanout, big, total, seed)
        return torch.from_numpy(np.asarray(counts, dtype=np.int64)), src
    if total == 0:
        pos = np.zeros(0, dtype=np.int64)
    elif big.size and total >= _MATRIX_MIN_FILL * start.size * fanout:
        picks = choose_positions(deg[big], fanout, np.random.default_rng(seed))
        if big.size == start.size:
            offset = picks
        else:
            offset = np.empty((start.size, fanout), dtype=picks.dtype)
            offset[:] = np.arange(fanout, dtype=picks.dtype)
            offset[big] = picks
        pos = start[:, None] + offset
        pos = pos.ravel() if total == pos.size else pos[np.arange(fanout) < counts[:, None]]
    else:
        nz = np.flatnonzero(counts)
        pos = (_runs(start, counts, total) if nz.size == start.size
               else _runs(start[nz], counts[nz], total))
        if big.size:
            picks = choose_positions(deg[big], fanout, np.random.default_rng(seed))
            row_out = np.cumsum(counts) - counts  # where each row's sources begin
            at = (row_out[big, None] + np.arange(fanout)).ravel()
            pos[at] = (start[big, None] + picks).ravel()
    src = _index_tensor(ix).index_select(0, torch.from_numpy(pos))
    if src.dtype != torch.int64:
        src = src.long()
    return torch.from_numpy(np.asarray(counts, dtype=np.int64)), src


def _gather_native(lib: ctypes.CDLL, start: np.ndarray, deg: np.ndarray, ix: np.ndarray,
                   fanout: int, big: np.ndarray, total: int, seed: int) -> Tensor:
    """:func:`sample_runs`'s sources by the C kernel: the picks of the rows above the fanout
    (:func:`choose_positions`, the same draws), then one pass that reads every row's sources
    (no position arrays); identical to the numpy path's output."""
    start = np.ascontiguousarray(start, dtype=np.int64)
    deg = np.ascontiguousarray(deg, dtype=np.int64)
    if big.size:
        picks = choose_positions(deg[big], fanout, np.random.default_rng(seed), lib)
    else:
        picks = np.zeros((0, max(fanout, 1)), dtype=np.int32)
    src = torch.empty(total, dtype=torch.int64)
    got = lib.mfg_gather_rows(start.ctypes.data, deg.ctypes.data, start.size, fanout,
                              picks.ctypes.data, big.size, ix.ctypes.data, ix.size,
                              int(ix.dtype == np.int64), src.data_ptr())
    if got != total:
        raise ValueError(f"seeded sampling: a run outside the {ix.size} CSC indices or a "
                         f"pick outside its row (kernel returned {got}, expected {total})")
    return src
