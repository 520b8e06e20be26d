"""FeatureCache.assemble on its own: received rows where present, cached rows elsewhere, the
row positions found on the host (a host slot map), a clear error where trainer and servers
disagree on what is cached; on CUDA (skipped without a device) the same result with no
host-device synchronisation, on any stream."""

from __future__ import annotations

import pytest
import torch
from syncs import assert_detects_a_sync, syncs_of

from trainer_client.feature_cache import FeatureCache

pytestmark = pytest.mark.timeout(60)

NUM_NODES, DIM = 50, 4


def _case(seed: int = 0):
    """A cache of 10 nodes, a batch of 12 input nodes (5 of them cached), the features the
    server sends (the uncached rows, in order) and the full matrix wanted."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(NUM_NODES, DIM, generator=g)
    cached = torch.randperm(NUM_NODES, generator=g)[:10]
    uncached = torch.tensor(sorted(set(range(NUM_NODES)) - set(cached.tolist())))
    ids = torch.cat([cached[:5], uncached[:7]])[torch.randperm(12, generator=g)]
    present = ~torch.isin(ids, cached)
    return table, cached, ids, present, table[ids[present]], table[ids]


def test_assemble_puts_received_and_cached_rows_in_place():
    table, cached, ids, present, received, want = _case()
    cache = FeatureCache(cached, table[cached], NUM_NODES, torch.device("cpu"))
    assert cache.slot.device.type == "cpu" and cache.slot.dtype == torch.int32
    got = cache.assemble(ids, received, present)
    assert torch.equal(got, want)
    assert cache.rows_served == 5 and cache.bytes_saved == 5 * DIM * 4
    # nothing cached in this batch, or everything
    assert torch.equal(cache.assemble(ids[present], received, present[present]), received)
    only = ids[~present]
    assert torch.equal(cache.assemble(only, received[:0], present[~present]), table[only])


def test_assemble_names_the_disagreement_when_a_missing_row_is_not_cached():
    table, cached, ids, present, received, _ = _case()
    cache = FeatureCache(cached[:3], table[cached[:3]], NUM_NODES, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="disagree on --cache-ratio"):
        cache.assemble(ids, received, present)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_assemble_equals_the_cpu_one_and_never_makes_the_host_wait():
    table, cached, ids, present, received, want = _case(1)
    cache = FeatureCache(cached, table[cached], NUM_NODES, torch.device("cuda"))
    assert cache.feat.is_cuda and cache.slot.device.type == "cpu"
    received = received.pin_memory()  # as in a registered ring slot
    side = torch.cuda.Stream()
    out = []

    def assemble():
        with torch.cuda.stream(side):  # as the loader runs it: on its copy stream
            out.append(cache.assemble(ids, received, present))

    assert_detects_a_sync()
    syncs = syncs_of(assemble)
    assert not syncs, "\n".join(syncs)
    got = out[0]
    side.synchronize()
    assert got.is_cuda and torch.equal(got.cpu(), want)
