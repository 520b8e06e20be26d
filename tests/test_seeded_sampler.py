"""sampler_server/seeded_sampler.py: a pure function of (graph, rows, fanout, seed), valid
(existing edges, distinct per destination, min(deg, fanout) each, all when deg <= fanout),
uniform, and the same output as the module's first version (kept below as the reference), so
MFGs sampled before its speed-up repeat exactly after it (checkpoint / resume); the native
kernels (common/native.c) and the numpy passes give that same output."""

from __future__ import annotations

import threading
import warnings
from itertools import combinations

import numpy as np
import pytest
import torch

from common import native
from sampler_server import seeded_sampler
from sampler_server.seeded_sampler import choose_positions, sample_csc, sample_runs

pytestmark = pytest.mark.timeout(120)


# --- the module's first version, verbatim (the reference its output must keep) -------------

def _ref_floyd(deg, k, rng):
    u = rng.random((k, deg.size))
    chosen = np.empty((k, deg.size), dtype=np.int64)
    for i in range(k):
        j = deg - k + i
        t = (u[i] * (j + 1)).astype(np.int64)
        if i:
            t = np.where((chosen[:i] == t).any(axis=0), j, t)
        chosen[i] = t
    return chosen.T


def _ref_choose_positions(deg, k, rng):
    picks = np.sort((rng.random((deg.size, k)) * deg[:, None]).astype(np.int64), axis=1)
    if k > 1:
        redo = np.nonzero((picks[:, 1:] == picks[:, :-1]).any(axis=1))[0]
        if redo.size:
            picks[redo] = _ref_floyd(deg[redo], k, rng)
    return picks


def _ref_sample_csc(indptr, indices, local, fanout, seed):
    rows = local.numpy()
    start = indptr[rows]
    deg = indptr[rows + 1] - start
    counts = deg if fanout == -1 else np.minimum(deg, fanout)
    row_out = np.cumsum(counts) - counts
    pos = np.repeat(start - row_out, counts) + np.arange(int(counts.sum()))
    if fanout != -1:
        big = np.nonzero(deg > fanout)[0]
        if big.size:
            picks = _ref_choose_positions(deg[big], fanout, np.random.default_rng(seed))
            pos[row_out[big, None] + np.arange(fanout)] = start[big, None] + picks
    src = torch.from_numpy(np.asarray(indices[pos], dtype=np.int64))
    return torch.from_numpy(np.asarray(counts, dtype=np.int64)), src


# --- graphs ---------------------------------------------------------------------------------

def _csc(degrees: np.ndarray, num_src: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A CSC whose row v has ``degrees[v]`` distinct in-neighbours among ``num_src`` ids."""
    rng = np.random.default_rng(seed)
    indptr = np.zeros(degrees.size + 1, dtype=np.int64)
    np.cumsum(degrees, out=indptr[1:])
    indices = np.concatenate(
        [rng.choice(num_src, int(d), replace=False) for d in degrees]
        or [np.zeros(0, np.int64)]).astype(np.int64)
    return indptr, indices


@pytest.fixture(scope="module")
def mixed():
    """Degrees around and far from the fanouts used: 0, 1, small, = fanout, just above
    (Floyd's rows), a few hundred (rows kept from the with-replacement draw)."""
    rng = np.random.default_rng(7)
    deg = np.concatenate([np.zeros(50), np.ones(50), rng.integers(2, 15, 300),
                          np.full(100, 10), np.full(100, 15), rng.integers(16, 40, 600),
                          rng.integers(100, 400, 200)]).astype(np.int64)
    rng.shuffle(deg)
    return _csc(deg, 5000, 8)


@pytest.fixture(scope="module")
def skewed():
    """Mostly rows far under the fanout (the run-building path), a few large ones."""
    rng = np.random.default_rng(9)
    deg = np.where(rng.random(2000) < 0.05, rng.integers(20, 300, 2000),
                   rng.integers(0, 4, 2000)).astype(np.int64)
    return _csc(deg, 5000, 10)


def _rows(n: int, size: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).permutation(n)[:size].astype(np.int64))


def _check_valid(indptr, indices, local, fanout, counts, src):
    assert counts.dtype == torch.int64 and src.dtype == torch.int64
    rows = local.numpy()
    deg = indptr[rows + 1] - indptr[rows]
    want = deg if fanout == -1 else np.minimum(deg, fanout)
    assert np.array_equal(counts.numpy(), want)
    assert src.numel() == int(want.sum())
    off = np.concatenate([[0], np.cumsum(want)])
    s = src.numpy()
    for i, v in enumerate(rows):
        got = s[off[i]:off[i + 1]]
        nbrs = indices[indptr[v]:indptr[v + 1]]
        assert np.unique(got).size == got.size, f"row {v}: a neighbour twice"
        assert np.isin(got, nbrs).all(), f"row {v}: a source that is not an in-neighbour"
        if deg[i] <= fanout or fanout == -1:
            assert np.array_equal(got, nbrs), f"row {v}: deg <= fanout must take all, in order"


# --- tests ------------------------------------------------------------------------------------

@pytest.fixture(params=["native", "numpy"])
def kernel(request, monkeypatch):
    """Run the test with the native kernels (built on this machine: a C compiler is part of
    the install) or with them switched off (the numpy passes)."""
    if request.param == "native":
        assert native.load() is not None, native.status()
    else:
        monkeypatch.setattr(seeded_sampler.native, "load", lambda: None)
    return request.param


@pytest.mark.parametrize("graph", ["mixed", "skewed"])
@pytest.mark.parametrize("fanout", [-1, 0, 1, 2, 5, 10, 15, 25])
def test_valid_and_same_as_reference(request, graph, fanout, kernel):
    indptr, indices = request.getfixturevalue(graph)
    n = indptr.size - 1
    deg = np.diff(indptr)
    above = torch.from_numpy(np.flatnonzero(deg > max(fanout, 0)))  # every row drawn
    for seed, size in [(0, n), (123, 700), (2**62 + 5, 37), (9, -1)]:
        local = _rows(n, size, seed % 1000) if size > 0 else above
        counts, src = sample_csc(indptr, indices, local, fanout, seed)
        _check_valid(indptr, indices, local, fanout, counts, src)
        rc, rs = _ref_sample_csc(indptr, indices, local, fanout, seed)
        assert torch.equal(counts, rc) and torch.equal(src, rs), \
            f"{graph} fanout {fanout} seed {seed}: another sample than the first version's"


def test_same_seed_same_sample_other_seed_other_sample(mixed):
    indptr, indices = mixed
    local = _rows(indptr.size - 1, 1000, 1)
    a = sample_csc(indptr, indices, local, 10, 42)
    b = sample_csc(indptr, indices, local.clone(), 10, 42)
    c = sample_csc(indptr, indices, local, 10, 43)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])


def test_empty_rows_and_bad_fanout(mixed):
    indptr, indices = mixed
    counts, src = sample_csc(indptr, indices, torch.zeros(0, dtype=torch.int64), 10, 1)
    assert counts.numel() == 0 and src.numel() == 0 and src.dtype == torch.int64
    with pytest.raises(ValueError, match="fanout"):
        sample_csc(indptr, indices, torch.arange(3), -2, 1)


def test_read_only_memmap_no_warning_and_threads_agree(mixed, tmp_path, kernel):
    """The server's CSC is a read-only memory map; sampler threads give the same samples."""
    indptr, indices = mixed
    np.save(tmp_path / "indptr.npy", indptr)
    np.save(tmp_path / "indices.npy", indices)
    ip = np.load(tmp_path / "indptr.npy", mmap_mode="r")
    ix = np.load(tmp_path / "indices.npy", mmap_mode="r")
    local = _rows(indptr.size - 1, 1200, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = [sample_csc(ip, ix, local, 10, s) for s in range(8)]
    got: dict[int, list] = {}

    def work(t: int) -> None:
        got[t] = [sample_csc(ip, ix, local, 10, s) for s in range(8)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == 4
    for res in got.values():
        for (c, s), (wc, ws) in zip(res, want):
            assert torch.equal(c, wc) and torch.equal(s, ws)


@pytest.mark.parametrize("deg,k", [(5, 3), (6, 2), (7, 4)])
def test_every_subset_equally_likely(deg, k):
    """Chi-square over all C(deg, k) subsets, 30000 draws (fixed seeds: cannot flake).
    The bound is generous (its p-value is far below 1e-6 for these few degrees of freedom)."""
    subsets = {s: i for i, s in enumerate(combinations(range(deg), k))}
    draws = []
    for seed in range(10):
        p = choose_positions(np.full(3000, deg, dtype=np.int64), k, np.random.default_rng(seed))
        draws.append(np.sort(p, axis=1))
    seen = np.bincount([subsets[tuple(r)] for r in np.concatenate(draws).tolist()],
                       minlength=len(subsets))
    expected = seen.sum() / len(subsets)
    chi2 = float(((seen - expected) ** 2 / expected).sum())
    dof = len(subsets) - 1
    assert chi2 < dof + 10 * np.sqrt(2 * dof) + 20, (chi2, dof, seen)


@pytest.mark.parametrize("deg,k", [(16, 15), (20, 15), (40, 10), (300, 5)])
def test_positions_and_pairs_uniform(deg, k):
    """Each position is picked with probability k/deg and each pair with k(k-1)/(deg(deg-1)),
    on both paths (Floyd's rows near the fanout, kept with-replacement draws far above it)."""
    n = 20000
    p = choose_positions(np.full(n, deg, dtype=np.int64), k, np.random.default_rng(11))
    assert ((p >= 0) & (p < deg)).all()
    assert (np.diff(np.sort(p, axis=1), axis=1) > 0).all()
    marg = np.bincount(p.ravel(), minlength=deg) / n
    # binomial sd of a share over n draws is < 0.5 / sqrt(n) = 0.0035; allow ~6 sd
    assert np.abs(marg - k / deg).max() < 0.021, marg
    inc = np.zeros((n, deg), dtype=np.float32)
    np.put_along_axis(inc, p, 1.0, axis=1)
    pair = (inc.T @ inc) / n
    off = pair[~np.eye(deg, dtype=bool)]
    assert np.abs(off - k * (k - 1) / (deg * (deg - 1))).max() < 0.021


def _picks_case(k):
    rng = np.random.default_rng(k)
    return np.concatenate([np.full(3000, k + 1), rng.integers(k + 1, 4 * k + 2, 3000),
                           rng.integers(k + 1, 10**6, 3000),
                           np.full(50, 2**31 - 2)]).astype(np.int64)


@pytest.mark.parametrize("k", [1, 2, 5, 15, 16, 17, 32, 33, 40])
def test_native_picks_equal_numpy_picks(k):
    """The C pass (numpy's PCG64 draws made in C, scaled, sorted by rank or by insertion,
    repeats found, Floyd on those rows) gives exactly the numpy passes' picks, Floyd's redrawn
    rows included (degrees just above k repeat often), and leaves the generator where numpy's
    draws leave it."""
    lib = native.load()
    assert lib is not None, native.status()
    deg = _picks_case(k)
    ga, gb = np.random.default_rng(5), np.random.default_rng(5)
    a = choose_positions(deg, k, ga, lib)
    b = choose_positions(deg, k, gb)
    assert a.dtype == b.dtype == np.int32 and np.array_equal(a, b)
    assert ga.bit_generator.state == gb.bit_generator.state
    assert ga.random(3).tolist() == gb.random(3).tolist()


def test_native_picks_refuse_a_degree_at_the_fanout():
    """A row whose degree is not above the fanout is an error from the C pass (it would loop
    or read past the row), not picks."""
    lib = native.load()
    assert lib is not None, native.status()
    with pytest.raises(ValueError, match="fanout 5 with a degree"):
        choose_positions(np.array([9, 5, 7], dtype=np.int64), 5, np.random.default_rng(0), lib)


def test_portable_native_picks_equal_the_vector_ones(tmp_path):
    """native.c built without 128-bit integers and without SSE2 (the plain-C paths other
    compilers and CPUs take) draws and sorts exactly as the default build."""
    import ctypes
    import subprocess

    lib = native.load()
    assert lib is not None, native.status()
    so = tmp_path / "portable.so"
    cmd = [*native.compiler(), *native.CFLAGS, "-U__SIZEOF_INT128__", "-U__SSE2__",
           "-o", str(so), str(native.SOURCE)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    portable = native._bind(ctypes.CDLL(str(so)))
    for k in (3, 15, 17, 40):
        deg = _picks_case(k)
        a = choose_positions(deg, k, np.random.default_rng(k), portable)
        b = choose_positions(deg, k, np.random.default_rng(k), lib)
        assert np.array_equal(a, b), k


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_native_gather_int32_indices_and_bad_runs(mixed, dtype):
    """int32 CSC indices give the same int64 sources; a run past the end of the indices, or
    a row past the end of the indptr, is an error naming it, not a read out of bounds."""
    assert native.load() is not None, native.status()
    indptr, indices = mixed
    local = _rows(indptr.size - 1, 900, 4).numpy()
    start = indptr[local]
    deg = indptr[local + 1] - start
    ix = indices.astype(dtype)
    c, s = sample_runs(start, deg, ix, 10, 3)
    rc, rs = _ref_sample_csc(indptr, indices, torch.from_numpy(local), 10, 3)
    assert torch.equal(c, rc) and torch.equal(s, rs)
    bad = start.copy()
    bad[7] = indices.size - 1  # this row's run now runs past the end
    deg[7] = max(int(deg[7]), 2)
    with pytest.raises(ValueError, match="outside"):
        sample_runs(bad, deg, ix, 10, 3)
    with pytest.raises(IndexError, match="outside the CSC"):
        sample_csc(indptr, ix, torch.tensor([0, indptr.size - 1]), 10, 3)
