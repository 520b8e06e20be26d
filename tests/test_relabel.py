"""relabel(): destination nodes first, every other source once, positions consistent; the
O(n) scratch version agrees with the sort-based one and leaves its buffer clean."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_server.neighbor_sampler import new_scratch, relabel

pytestmark = pytest.mark.timeout(120)


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
    assert torch.unique(nodes).numel() == nodes.numel()
    assert set(nodes.tolist()) == set(dst.tolist()) | set(src.tolist())
    assert torch.equal(nodes[local], src)
    assert bool((scratch == -1).all())
    ref_nodes, ref_local = relabel(dst, src)
    assert torch.equal(nodes, ref_nodes) and torch.equal(local, ref_local)
