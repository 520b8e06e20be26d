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
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def _floyd(deg: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` distinct positions in ``[0, deg[r])`` per row r (every deg > k), uniformly:
    Floyd's algorithm, one vectorised step per pick. Returns shape (rows, k)."""
    u = rng.random((k, deg.size))
    chosen = np.empty((k, deg.size), dtype=np.int64)
    for i in range(k):
        j = deg - k + i
        t = (u[i] * (j + 1)).astype(np.int64)  # uniform in [0, j]
        if i:
            t = np.where((chosen[:i] == t).any(axis=0), j, t)
        chosen[i] = t
    return chosen.T


def choose_positions(deg: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` distinct positions in ``[0, deg[r])`` for each row r (every deg > k), each set
    equally likely; shape (rows, k). Draws with replacement first (cheap, and rarely repeats
    when the degree is much larger than k); rows that repeated are drawn again with Floyd."""
    picks = np.sort((rng.random((deg.size, k)) * deg[:, None]).astype(np.int64), axis=1)
    if k > 1:
        redo = np.nonzero((picks[:, 1:] == picks[:, :-1]).any(axis=1))[0]
        if redo.size:
            picks[redo] = _floyd(deg[redo], k, rng)
    return picks


def sample_csc(indptr: np.ndarray, indices: np.ndarray, local: Tensor, fanout: int,
               seed: int) -> tuple[Tensor, Tensor]:
    """``(counts, src)`` for the rows ``local`` of a CSC (``indices[indptr[v]:indptr[v+1]]``
    are the in-neighbours of v): min(in-degree, fanout) distinct in-neighbours each (-1: all),
    concatenated in the order of ``local``; the same for the same ``seed``."""
    rows = local.numpy()
    start = indptr[rows]
    deg = indptr[rows + 1] - start
    counts = deg if fanout == -1 else np.minimum(deg, fanout)
    row_out = np.cumsum(counts) - counts  # where each row's sources begin in the output
    pos = np.repeat(start - row_out, counts) + np.arange(int(counts.sum()))
    if fanout != -1:
        big = np.nonzero(deg > fanout)[0]
        if big.size:
            picks = choose_positions(deg[big], fanout, np.random.default_rng(seed))
            pos[row_out[big, None] + np.arange(fanout)] = start[big, None] + picks
    src = torch.from_numpy(np.asarray(indices[pos], dtype=np.int64))
    return torch.from_numpy(np.asarray(counts, dtype=np.int64)), src
