"""Shared-memory replies (common.shm_ring) between real server processes and a trainer-side
loader: features land in the trainer's ring and equal the original rows; anything the ring
cannot take (slot too small, no slot free, a slot a server may not use) goes on the wire."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from rpc_helpers import call

from common.cluster import ClusterSpec
from common.messages import MFGReply, SampleRequest
from common.shm_ring import HEADER_BYTES, ShmRing, ShmWriter, SlotRef
from tests.test_mfg_oracle import Oracle, mixed_seeds, start_cluster
from trainer_client.feature_cache import FeatureCache
from trainer_client.loader import DistNodeDataLoader
from trainer_client.server_pool import ServerPool

pytestmark = pytest.mark.timeout(180)

FANOUTS = [5, 5]


def _loader(pool, info, parts, ring, **kw):
    from partition.layout import load_partition

    seeds = torch.cat([torch.from_numpy(np.array(load_partition(parts, p).train, dtype=np.int64))
                       for p in range(info.num_parts)])
    return DistNodeDataLoader(pool, seeds, info.node_offsets, fanouts=FANOUTS, batch_size=64,
                              shuffle=False, ring=ring, max_inflight=3, **kw)


def _check_rows(mfg, graph, oracle):
    want = graph.feat[oracle.n2o[mfg.input_nodes.numpy()]]
    got = mfg[0].srcdata["feat"]
    np.testing.assert_allclose(got.float().numpy(), want, rtol=1e-2 if got.element_size() == 2
                               else 0, atol=1e-2 if got.element_size() == 2 else 0)


@pytest.mark.parametrize("feat_transfer,cache_ratio", [("", 0.0), ("float16", 0.0),
                                                       ("", 0.25)])
def test_features_arrive_in_ring(feat_transfer, cache_ratio, pool2, synth_graph, synth_parts2):
    info = pool2.info()
    oracle = Oracle(synth_graph, synth_parts2)
    ring = ShmRing(5, 4 << 20)
    cache = (FeatureCache.fill(pool2, 2, info.num_nodes, cache_ratio, feat_transfer,
                               torch.device("cpu")) if cache_ratio else None)
    loader = _loader(pool2, info, synth_parts2, ring, feat_transfer=feat_transfer,
                     cache=cache, cache_ratio=cache_ratio)
    bytes0 = pool2.bytes_received + sum(c.bytes_received for c in pool2.channels.values())
    n = 0
    for _, _, mfg in loader:
        _check_rows(mfg, synth_graph, oracle)
        n += 1
    assert n == len(loader) and loader.stats.ring_hits == n
    assert not loader.no_ring and loader.stats.ring_misses == 0
    # The features did not travel through the socket: a few KB per batch at most.
    rx = sum(c.bytes_received for c in pool2.channels.values()) - bytes0
    assert rx < n * 64 * 11 * 11 * 8 * 4, rx
    # Every slot comes back once no batch is held.
    del mfg
    assert sorted(ring.free + [s for s, _ in ring.pending]) == list(range(5))
    ring.close()


def test_held_batches_keep_their_slots(pool2, synth_graph, synth_parts2):
    """A batch kept by the caller keeps its slot: with every batch held the ring runs out
    and later batches come on the wire, all still correct."""
    info = pool2.info()
    oracle = Oracle(synth_graph, synth_parts2)
    ring = ShmRing(2, 4 << 20)
    loader = _loader(pool2, info, synth_parts2, ring)
    held = [mfg for _, _, mfg in loader]
    assert len(held) > 4
    assert loader.stats.ring_hits == 2 and loader.stats.ring_misses == len(held) - 2
    for mfg in held:
        _check_rows(mfg, synth_graph, oracle)
    del held, mfg
    assert len(ring.free) + len(ring.pending) == 2
    ring.close()


def test_slot_too_small_goes_on_wire(pool2, synth_graph, synth_parts2):
    info = pool2.info()
    oracle = Oracle(synth_graph, synth_parts2)
    ring = ShmRing(4, 4096)
    loader = _loader(pool2, info, synth_parts2, ring)
    for _, _, mfg in loader:
        _check_rows(mfg, synth_graph, oracle)
    assert loader.stats.ring_hits == 0 and not loader.no_ring
    ring.close()


def test_abandoned_iteration_returns_slots(pool2, synth_parts2):
    info = pool2.info()
    ring = ShmRing(5, 4 << 20)
    loader = _loader(pool2, info, synth_parts2, ring)
    it = iter(loader)
    next(it)
    it.close()  # requests in flight are waited for, their slots returned
    del it
    assert not ring.poisoned and not ring.in_use
    ring.close()


def _raw_call(ep: str, req: SampleRequest) -> MFGReply:
    return call(ep, req, timeout_s=30)


def test_server_refuses_what_is_not_a_ring(server_factory, synth_parts1, synth_graph,
                                           tmp_path):
    """A slot naming a regular file, a wrong token or a dead pid is not written; the reply
    says why and carries the features on the wire; the server keeps serving."""
    cluster = start_cluster(server_factory, synth_parts1, tmp_path, 1)
    ep = cluster.partitions[0][0]
    oracle = Oracle(synth_graph, synth_parts1)
    seeds = mixed_seeds(synth_parts1, 20, 3)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"\0" * (1 << 20))
    ring = ShmRing(1, 1 << 20)
    fd = os.open(victim, os.O_RDWR)
    try:
        cases = {
            "regular file": SlotRef(os.getpid(), fd, ring.token, HEADER_BYTES, 1 << 19),
            "wrong token": SlotRef(os.getpid(), ring.fd, "ab" * 16, HEADER_BYTES, 1 << 19),
            "dead pid": SlotRef(2**22 + 7, ring.fd, ring.token, HEADER_BYTES, 1 << 19),
            "outside": SlotRef(os.getpid(), ring.fd, ring.token, HEADER_BYTES, 1 << 30),
        }
        for what, ref in cases.items():
            reply = _raw_call(ep, SampleRequest(seeds=seeds, fanouts=[3], slot=ref))
            f = reply.mfg.only.feat
            assert f.via == "frames" and f.slot_error, what
            np.testing.assert_array_equal(
                f.rows.numpy(), synth_graph.feat[oracle.n2o[reply.mfg.input_nodes.numpy()]])
        assert victim.read_bytes() == b"\0" * (1 << 20), "a non-ring file was written"
        reply = _raw_call(ep, SampleRequest(seeds=seeds, fanouts=[3],
                                            slot=ring.ref(ring.acquire())))
        f = reply.mfg.only.feat
        assert f.via == "ring" and f.num_rows == reply.mfg.input_nodes.numel()
        assert not f.slot_error
        got = ring.view(0, f.num_rows, f.rows.shape[1], f.rows.dtype)
        np.testing.assert_array_equal(
            got.numpy(), synth_graph.feat[oracle.n2o[reply.mfg.input_nodes.numpy()]])
        del got
    finally:
        os.close(fd)
        ring.close()


def test_writer_unmaps_idle_rings():
    ring = ShmRing(2, 8192)
    writer = ShmWriter(idle_s=0.0)
    slot = ring.acquire()
    ref = ring.ref(slot)
    t = writer.target(ref, 2, 3, torch.float32)
    t.copy_(torch.arange(6, dtype=torch.float32).view(2, 3))
    del t
    assert ring.view(slot, 2, 3, torch.float32).sum().item() == 15
    assert writer.target(ref, 10_000, 3, torch.float32) is None  # does not fit
    writer.expire()
    assert not writer.maps
    ring.close()


def _faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_first_use_of_a_slot_is_populated_in_one_call():
    """The writer populates the bytes it is about to write, the ring the bytes it is about to
    read: touching them then takes (almost) no page faults, where a slot of 4 MiB would take
    1,024 one by one. Only what was not populated yet is populated again."""
    from common.shm_ring import _madvise

    if _madvise is None:
        pytest.skip("no libc madvise here")
    ring = ShmRing(2, 4 << 20)
    writer = ShmWriter()
    slot = ring.acquire()
    ref = ring.ref(slot)
    rows, cols = 4096, 256  # 4 MiB of float32
    t = writer.target(ref, rows, cols, torch.float32)
    (populated,) = [m.populated for m in writer.maps.values()]
    if not populated.supported:
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
    assert populated.done == {t.data_ptr(): 4 << 20}
    before = _faults()
    t.fill_(1.0)
    assert _faults() - before < 64  # not 1,024
    half = writer.target(ref, rows // 2, cols, torch.float32)
    assert populated.done == {t.data_ptr(): 4 << 20}  # nothing new to populate
    del t, half
    view = ring.view(slot, rows, cols, torch.float32)
    assert ring.populated.done == {view.data_ptr(): 4 << 20}
    before = _faults()
    assert view.sum().item() == rows * cols
    assert _faults() - before < 64
    del view
    writer.close()
    ring.close()


def test_an_advice_the_kernel_refuses_is_not_fatal():
    from common.shm_ring import _Populated

    ring = ShmRing(1, 8192)
    bogus = _Populated(-12345)
    arr = ring.base[HEADER_BYTES:HEADER_BYTES + 8192]
    bogus.ensure(arr.ctypes.data, 8192)  # EINVAL: remembered, pages fault in as used
    assert not bogus.supported and not bogus.done
    arr[:] = 7
    assert int(arr.sum()) == 7 * 8192
    del arr
    ring.close()


def test_sampler_threads_share_one_mapping_per_ring():
    """A server's sampler threads share one ShmWriter: concurrent requests into different
    slots of one ring map it once; each thread's rows land in its own slot."""
    import threading

    ring = ShmRing(4, 1 << 20)
    writer = ShmWriter()
    slots = [ring.acquire() for _ in range(4)]
    errors = []

    def write(k: int) -> None:
        try:
            for _ in range(50):
                t = writer.target(ring.ref(slots[k]), 256, 64, torch.float32)
                t.fill_(float(k))
                del t
                writer.expire()  # another thread's idle(): must not unmap a ring in use
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(writer.maps) == 1
    for k, slot in enumerate(slots):
        v = ring.view(slot, 256, 64, torch.float32)
        assert torch.all(v == k)
        del v
    writer.close()
    ring.close()


def test_ring_off_only_for_the_server_that_cannot_use_it(server_factory, synth_parts1,
                                                         synth_graph, tmp_path):
    """Two replicas of a part: one on this host, one in another pid namespace (as a server on
    another host: it cannot open /proc/<trainer pid>/fd). The second says why and gets no
    more slots; the first keeps writing into the ring; every batch is correct."""
    from common.messages import Shutdown

    cluster = ClusterSpec({0: [f"ipc://{tmp_path}/near.sock", f"ipc://{tmp_path}/far.sock"]})
    server_factory(synth_parts1, 0, endpoint=cluster.partitions[0][0])
    far = server_factory(synth_parts1, 0, endpoint=cluster.partitions[0][1],
                         prefix=["unshare", "--pid", "--fork", "--mount-proc",
                                 "--kill-child=SIGTERM"])
    oracle = Oracle(synth_graph, synth_parts1)
    pool = ServerPool(cluster, timeout_s=30, max_message_bytes=64 << 20)
    try:
        info = pool.info()
        ring = ShmRing(5, 4 << 20)
        loader = _loader(pool, info, synth_parts1, ring)
        n = 0
        for _, _, mfg in loader:
            _check_rows(mfg, synth_graph, oracle)
            n += 1
        assert loader.no_ring == {cluster.partitions[0][1]}
        # the near server kept using the ring; after its first refusal the far one got
        # no slot again, so about half the batches (round robin) arrived in the ring
        assert n // 2 - 1 <= loader.stats.ring_hits <= n - n // 2 + 1, (n, loader.stats)
        pool.channels[cluster.partitions[0][1]].call(Shutdown(token=far.token))
    finally:
        pool.close()
    far.proc.wait(timeout=20)
    far.stop_and_check()  # exit code 0, through unshare
    ring.close()
