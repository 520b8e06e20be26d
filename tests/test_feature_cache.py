"""FeatureCache.assemble on its own: received rows where present, cached rows elsewhere, the
row positions found on the host (a host slot map), a clear error where trainer and servers
disagree on what is cached; on the CPU the native kernel (common/native.c's
mfg_assemble_rows) and the torch path give the same matrix; on CUDA (skipped without a device)
the same result with no host-device synchronisation, on any stream."""

from __future__ import annotations

import pytest
import torch
from syncs import assert_detects_a_sync, syncs_of

from common import native
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


def _needs_native() -> None:
    if native.load() is None:  # tests/test_native.py fails where a compiler should build it
        pytest.skip(f"native kernels: {native.status()}")


def _torch_only(monkeypatch) -> None:
    """The torch path, as where the native library is switched off (MFGSERVE_NATIVE=0)."""
    monkeypatch.setattr(native, "load", lambda: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_and_torch_assemble_give_the_same_matrix(monkeypatch, dtype):
    _needs_native()
    g = torch.Generator().manual_seed(7)
    num_nodes, dim = 5000, 100
    table = torch.randn(num_nodes, dim, generator=g).to(dtype)
    cached = torch.randperm(num_nodes, generator=g)[:1000]
    ids = torch.randperm(num_nodes, generator=g)[:3000]  # about 600 of them cached
    present = ~torch.isin(ids, cached)
    received = table[ids[present]]
    cache = FeatureCache(cached, table[cached], num_nodes, torch.device("cpu"))
    got = cache._assemble_native(ids, received, present)  # the kernel ran: not None
    assert got is not None and got.dtype == dtype and torch.equal(got, table[ids])
    assert torch.equal(cache.assemble(ids, received, present), table[ids])
    assert cache.rows_served == 2 * int((~present).sum())
    _torch_only(monkeypatch)
    slow = FeatureCache(cached, table[cached], num_nodes, torch.device("cpu"))
    assert torch.equal(slow.assemble(ids, received, present), got)
    assert (slow.rows_served, slow.bytes_saved) == (cache.rows_served // 2,
                                                    cache.bytes_saved // 2)


def test_native_assemble_rejects_a_reply_that_does_not_fit_and_counts_nothing():
    _needs_native()
    table, cached, ids, present, received, _ = _case()
    cache = FeatureCache(cached, table[cached], NUM_NODES, torch.device("cpu"))
    for rows in (received[:-1], torch.cat([received, received[:1]])):  # one row short, over
        with pytest.raises(RuntimeError, match="row count differs from its present-mask"):
            cache.assemble(ids, rows, present)
    outside = ids.clone()
    outside[0] = NUM_NODES  # a node id past the graph
    with pytest.raises(RuntimeError, match="a node outside the graph"):
        cache.assemble(outside, received, present)
    with pytest.raises(RuntimeError, match="do not match its input nodes"):
        cache.assemble(ids, received, present[:-1])
    assert cache.rows_served == 0 and cache.bytes_saved == 0


def test_torch_assemble_still_names_the_disagreement(monkeypatch):
    _torch_only(monkeypatch)
    table, cached, ids, present, received, want = _case()
    cache = FeatureCache(cached, table[cached], NUM_NODES, torch.device("cpu"))
    assert torch.equal(cache.assemble(ids, received, present), want)
    small = FeatureCache(cached[:3], table[cached[:3]], NUM_NODES, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="disagree on --cache-ratio"):
        small.assemble(ids, received, present)


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
