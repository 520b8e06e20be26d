"""``--prefetch`` (trainer_client/loader.py) against real server processes: in "alternate"
the trainer takes turns with the servers (no request is out while it holds a batch to
compute on) and gets exactly the batches "overlap" gets; "auto" alternates only for a CPU
trainer whose threads cover every core (``threads_cover_cores``) once a server on its host
has written into its ring; a loop left in the middle of a window gives every slot back; a
consumer that drops each batch before asking for the next touches ``max_inflight`` + 1 slots,
and the training loop's batch generator (``_batches``) keeps no batch behind."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from common.shm_ring import ShmRing
from partition.layout import load_partition
from trainer_client.loader import DistNodeDataLoader
from trainer_client.train import _batches, threads_cover_cores

pytestmark = pytest.mark.timeout(180)


def _loader(pool, parts, ring, **kw) -> DistNodeDataLoader:
    info = pool.info()
    seeds = torch.cat([torch.from_numpy(np.array(load_partition(parts, p).train, dtype=np.int64))
                       for p in range(info.num_parts)])
    return DistNodeDataLoader(pool, seeds, info.node_offsets, fanouts=[5, 5], batch_size=64,
                              shuffle=True, seed=3, ring=ring, max_inflight=3, **kw)


def _walk(loader, pool) -> tuple[list, list[int]]:
    """Each batch's (input nodes, features, labels), and the requests out at each yield."""
    batches, out = [], []
    for inputs, _, mfg in loader:
        out.append(pool.outstanding())
        batches.append((inputs.clone(), mfg[0].srcdata["feat"].clone(),
                        mfg[-1].dstdata["label"].clone()))
    return batches, out


def test_alternate_takes_turns_with_the_servers(pool2, synth_parts2):
    ring = ShmRing(5, 4 << 20)
    over = _loader(pool2, synth_parts2, ring, prefetch="overlap")
    alt = _loader(pool2, synth_parts2, ring, prefetch="alternate")
    n = len(alt)
    assert n > 2 * alt.max_inflight
    want, out_over = _walk(over, pool2)
    got, out_alt = _walk(alt, pool2)
    # overlap keeps requests out while a batch is computed on; alternate never does
    assert max(out_over) > 0 and out_alt == [0] * n, (out_over, out_alt)
    assert alt.stats.bursts == math.ceil(n / alt.max_inflight) and over.stats.bursts == 0
    assert alt.alternating() and not over.alternating()
    # the same batches (deterministic sampling): only the timing of the requests differs
    assert len(got) == len(want) == n
    for (i0, f0, y0), (i1, f1, y1) in zip(want, got):
        assert torch.equal(i0, i1) and torch.equal(f0, f1) and torch.equal(y0, y1)
    assert alt.stats.ring_hits == n and not ring.poisoned and not ring.in_use
    ring.close()


@pytest.mark.parametrize("local,with_ring,alternates", [
    (True, True, True),  # threads cover the cores, a server on this host: take turns
    (False, True, False),  # cores to spare: the servers' work overlaps compute for free
    (True, False, False),  # no ring, so no sign that a server shares this host
])
def test_auto_alternates_only_with_a_server_on_this_host(local, with_ring, alternates, pool2,
                                                         synth_parts2):
    ring = ShmRing(5, 4 << 20) if with_ring else None
    loader = _loader(pool2, synth_parts2, ring, prefetch="auto", alternate_if_local=local)
    assert not loader.alternating()  # nothing is known before the first reply
    _, out = _walk(loader, pool2)
    assert loader.alternating() == alternates
    assert (loader.stats.bursts > 0) == alternates
    if alternates:  # overlap until the first reply came through the ring, then turns
        assert out[0] > 0 and out[-3:] == [0, 0, 0], out
    if ring is not None:
        ring.close()


def test_leaving_a_window_early_returns_its_slots(pool2, synth_parts2):
    """A loop left while replies of the window are taken but not yet handed out: their
    servers are done with those slots, which come back (none poisoned)."""
    ring = ShmRing(5, 4 << 20)
    loader = _loader(pool2, synth_parts2, ring, prefetch="alternate")
    it = iter(loader)
    next(it)
    assert pool2.outstanding() == 0
    it.close()
    del it
    assert not ring.poisoned and not ring.in_use
    assert sorted(ring.free + [s for s, _ in ring.pending]) == list(range(5))
    ring.close()


def test_unknown_prefetch_mode_is_refused(pool2, synth_parts2):
    with pytest.raises(ValueError, match="prefetch must be one of"):
        _loader(pool2, synth_parts2, None, prefetch="eager")


def test_threads_cover_cores():
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(max(2, cores))
        assert threads_cover_cores(torch.device("cpu"))
        assert not threads_cover_cores(torch.device("cuda", 0))  # compute is on the GPU
        torch.set_num_threads(1)
        assert not threads_cover_cores(torch.device("cpu"))  # one thread has no barrier
        if cores > 2:
            torch.set_num_threads(cores - 1)  # a core left for the servers
            assert not threads_cover_cores(torch.device("cpu"))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("prefetch", ["overlap", "alternate"])
def test_a_dropped_batch_frees_its_slot_for_the_next_requests(prefetch, pool2, synth_parts2):
    """The training loop drops each batch before asking for the next (trainer_client/train.py):
    its slot is free again when the loader sends its next requests, so a whole epoch runs in
    max_inflight + 1 slots overlapping (the one decoded ahead), and in max_inflight slots
    alternating (a window's last batch goes out before the next window is sent); the ring has
    max_inflight + 2, and each slot touched costs its pages' first touches. A batch still held
    when the next is asked for pins one more."""
    base = 3 if prefetch == "alternate" else 4  # max_inflight 3
    for drop, want in ((True, base), (False, base + 1)):
        ring = ShmRing(6, 4 << 20)
        loader = _loader(pool2, synth_parts2, ring, prefetch=prefetch)
        n = 0
        for _, _, mfg in loader:
            assert mfg[0].srcdata["feat"].shape[0] == mfg.input_nodes.numel()
            n += 1
            if drop:
                del mfg
        assert n == len(loader) > 6 and loader.stats.ring_hits == n
        assert len(ring.touched) == want, (prefetch, drop, sorted(ring.touched))
        if not drop:
            del mfg
        assert not ring.in_use and not ring.poisoned
        ring.close()


@pytest.mark.parametrize("bar", [False, True])
def test_batches_keeps_no_batch_behind(bar, capsys):
    """``_batches`` (with or without its progress bar) holds no batch once the next one is
    asked for, so the caller's ``del`` really frees a batch's ring slot."""
    import weakref

    class Batch:
        pass

    made: list = []

    class Loader:
        def __len__(self):
            return 4

        def __iter__(self):
            for _ in range(4):
                b = Batch()
                made.append(weakref.ref(b))
                yield None, None, b
                del b

    seen = 0
    for _, _, b in _batches(Loader(), bar, desc="t"):
        assert all(r() is None for r in made[:-1]), "an earlier batch is still alive"
        seen += 1
        del b
    assert seen == 4 and all(r() is None for r in made)


@pytest.mark.parametrize("offsets,batch,want", [
    ([0, 100], [5, 99, 0], 0),  # one part
    ([0, 10, 20, 30], [25, 12, 27, 3, 29], 2),  # most seeds in part 2
    ([0, 10, 20, 30], [15, 5, 16, 6], 0),  # a tie: the lowest part, as torch's argmax
    ([0, 10, 20, 30], [10, 19, 9], 1),  # part bounds: 10 and 19 are part 1's
])
def test_a_request_goes_to_the_part_owning_most_of_its_seeds(offsets, batch, want):
    loader = DistNodeDataLoader.__new__(DistNodeDataLoader)  # _owner needs the offsets only
    loader.offsets = torch.tensor(offsets)
    loader._offsets_np = loader.offsets.numpy()
    got = loader._owner(torch.tensor(batch))
    owners = torch.searchsorted(loader.offsets, torch.tensor(batch), right=True) - 1
    assert got == want == int(torch.bincount(owners).argmax())
