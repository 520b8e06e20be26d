"""relabel(): destination nodes first, every other source once in ascending order, positions
consistent; the native kernel, the numpy passes and the sort-based reference agree
and leave the scratch buffer clean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import native
from sampler_server import neighbor_sampler as ns
from sampler_server.neighbor_sampler import new_scratch, relabel

pytestmark = pytest.mark.timeout(120)


def _new_sorted(dst: list[int], src: list[int]) -> list[int]:
    return sorted(set(src) - set(dst))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_relabel_invariants(data):
    n = data.draw(st.integers(1, 60))
    dst = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True)),
                       dtype=torch.int64)
    src = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), max_size=80)),
                       dtype=torch.int64)
    scratch = new_scratch(n)
    nodes, local = relabel(dst, src, scratch)
    assert torch.equal(nodes[: dst.numel()], dst)
    assert nodes[dst.numel():].tolist() == _new_sorted(dst.tolist(), src.tolist())
    assert torch.equal(nodes[local], src)
    assert bool((scratch == -1).all())
    for other in (ns._relabel_numpy(dst, src, scratch), relabel(dst, src)):
        assert torch.equal(nodes, other[0]) and torch.equal(local, other[1])
        assert bool((scratch == -1).all())


def test_native_relabel_is_used_and_matches_numpy_on_a_large_hop():
    """On this machine (a C compiler present) the native kernel is loaded; on a hop of the
    size a sampler sees (10^5 sources over 10^5 nodes, many repeats) it equals the numpy
    passes exactly."""
    assert native.load() is not None, native.status()
    rng = np.random.default_rng(0)
    n = 200_000
    dst = torch.from_numpy(rng.choice(n, 20_000, replace=False))
    src = torch.from_numpy(rng.integers(0, n, 300_000))
    scratch = new_scratch(n)
    a = relabel(dst, src, scratch)
    b = ns._relabel_numpy(dst, src, scratch)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert bool((scratch == -1).all())


@pytest.mark.parametrize("n, lo", [(40_000, 0), (40_000_000, 0), (1_000_000, 970_001)])
def test_native_relabel_bitmap_and_sparse_paths(n, lo):
    """The kernel marks the sources in a bitmap of their id range when the range has at most
    4 words (256 ids) per source (40k and a window high in 1M ids: the bitmap, the second one
    starting mid-word), and takes provisional slots and a radix sort when it is sparser (40M
    ids: three radix passes); every path gives the reference's result and leaves the scratch
    clean."""
    if native.load() is None:
        pytest.skip(f"native kernels: {native.status()}")
    rng = np.random.default_rng(n + lo)
    dst = torch.from_numpy(lo + rng.choice(n - lo, 3_000, replace=False))
    src = torch.from_numpy(lo + rng.integers(0, n - lo, 60_000))
    src[:500] = dst[:500]  # some sources are destinations
    src[500] = n - 1  # the range's last id
    scratch = new_scratch(n)
    nodes, local = relabel(dst, src, scratch)
    ref = relabel(dst, src)
    assert torch.equal(nodes, ref[0]) and torch.equal(local, ref[1])
    assert bool((nodes[dst.numel():].diff() > 0).all())
    assert bool((scratch == -1).all())


@pytest.mark.parametrize("bad", [[-1], [10]])
def test_native_relabel_rejects_an_id_outside_the_scratch(bad):
    if native.load() is None:
        pytest.skip(f"native kernels: {native.status()}")
    scratch = new_scratch(10)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        relabel(torch.tensor([1, 2]), torch.tensor([3, *bad]), scratch)
    with pytest.raises(ValueError, match="outside"):
        relabel(torch.tensor(bad), torch.tensor([3]), scratch)
    assert bool((scratch == -1).all())
