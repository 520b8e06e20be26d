"""Liveness with real servers: a replica dies mid-epoch and the epoch still covers every
seed exactly once; without a replica the trainer fails fast with a clear error; a restarted
server is used again."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from rpc_helpers import call

from common.cluster import ClusterSpec
from common.errors import MfgServeError
from common.messages import Ping, Pong, StatsReply, StatsRequest
from common.shm_ring import ShmRing
from partition.layout import PartitionSetMeta
from trainer_client.loader import DistNodeDataLoader
from trainer_client.server_pool import ServerPool

pytestmark = pytest.mark.timeout(240)


def _cluster(tmp_path, num_parts: int, replicas: int) -> tuple[ClusterSpec, object]:
    cluster = ClusterSpec({p: [f"ipc://{tmp_path}/f{p}r{r}.sock" for r in range(replicas)]
                           for p in range(num_parts)})
    path = tmp_path / "cluster.yaml"
    cluster.write(path)
    return cluster, path


PEER_TIMEOUT_S = 2.0  # servers' deadline for each other; the trainer's must be longer


def _start(server_factory, parts, cluster: ClusterSpec, cluster_file) -> dict:
    return {ep: server_factory(parts, p, cluster=cluster_file, endpoint=ep,
                               extra=["--peer-timeout-s", str(PEER_TIMEOUT_S)])
            for p, ep in cluster.all_endpoints()}


def _loader(pool: ServerPool, parts, **kw) -> DistNodeDataLoader:
    meta = PartitionSetMeta.load(parts)
    seeds = pool.seeds("train")
    return DistNodeDataLoader(pool, seeds, meta.node_offsets, fanouts=[5, 5], batch_size=40,
                              max_inflight=6, shuffle=True, seed=3, **kw)


@pytest.mark.parametrize("prefetch", ["overlap", "alternate"])
def test_replica_death_mid_epoch_exactly_once(prefetch, server_factory, synth_parts2,
                                              tmp_path):
    """Also as a one-trainer worker-mode run does it by default: replies in the ring and
    requests sent a window at once (``--prefetch auto`` alternates there), the replica dying
    while the trainer waits for a whole window."""
    cluster, path = _cluster(tmp_path, 2, replicas=2)
    servers = _start(server_factory, synth_parts2, cluster, path)
    victim_ep = cluster.partitions[0][0]
    victim = servers[victim_ep]
    pool = ServerPool(cluster, timeout_s=60, max_message_bytes=64 << 20)
    ring = ShmRing(8, 4 << 20) if prefetch == "alternate" else None
    try:
        loader = _loader(pool, synth_parts2, prefetch=prefetch, ring=ring)
        assert len(loader) >= 20
        seen = []
        killer = None
        for i, (_, output_nodes, mfg) in enumerate(loader):
            seen.append(output_nodes.clone())
            assert torch.equal(mfg[-1].dstdata["_ID"], output_nodes)
            if i == 3:
                # Freeze the replica so requests pile up on it, then kill it while the
                # loader waits: those requests must be re-sent to the other replica.
                os.kill(victim.proc.pid, signal.SIGSTOP)
                killer = threading.Timer(1.5, os.kill, (victim.proc.pid, signal.SIGKILL))
                killer.start()
        if killer is not None:
            killer.join()
        seen_all = torch.cat(seen)
        # every training seed exactly once, retries included
        assert seen_all.numel() == loader.seeds.numel()
        assert torch.equal(torch.sort(seen_all).values, torch.sort(loader.seeds).values)
        assert pool.failovers >= 1, "requests in flight on the dead replica were not re-sent"
        assert victim.proc.wait(timeout=10) == -signal.SIGKILL
        if ring is not None:
            assert loader.stats.bursts > 0 and loader.stats.ring_hits > 0

        # A restarted server at the same endpoint is picked up again.
        servers[victim_ep] = server_factory(synth_parts2, 0, cluster=path, endpoint=victim_ep)
        loader.set_epoch(1)
        deadline = time.monotonic() + 30
        while not pool.channels[victim_ep].up and time.monotonic() < deadline:
            pool.channels[victim_ep].poll_events()
            time.sleep(0.05)
        second = torch.cat([out.clone() for _, out, _ in loader])
        assert torch.equal(torch.sort(second).values, torch.sort(loader.seeds).values)
        stats = pool.channels[victim_ep].call(StatsRequest())
        assert isinstance(stats, StatsReply) and stats.values["sample_requests"] > 0
    finally:
        pool.close()
        if ring is not None:
            ring.close()
    victim.stop_and_check(expect_code=None)  # the killed one; the restarted one is checked


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_no_replica_fails_fast_with_clear_error(how, server_factory, synth_parts2, tmp_path):
    cluster, path = _cluster(tmp_path, 2, replicas=1)
    servers = _start(server_factory, synth_parts2, cluster, path)
    victim_ep = cluster.partitions[1][0]
    victim = servers[victim_ep]
    timeout_s = 3 * PEER_TIMEOUT_S
    pool = ServerPool(cluster, timeout_s=timeout_s, max_message_bytes=64 << 20)
    try:
        loader = _loader(pool, synth_parts2)
        it = iter(loader)
        next(it)
        os.kill(victim.proc.pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(MfgServeError) as err:
            for _ in it:
                pass
        elapsed = time.monotonic() - t0
        text = str(err.value)
        # names what died and what to change; dead servers are noticed before any deadline,
        # hung ones at a deadline: the other server's (naming the hung peer) or ours
        assert victim_ep in text, text
        assert elapsed < (3.0 if how == "sigkill" else timeout_s + 3), elapsed
        # the healthy server keeps serving
        assert call(cluster.partitions[0][0], Ping(), Pong, ctx=pool.ctx).part_id == 0
    finally:
        pool.close()
        if how == "sigstop":
            os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    victim.stop_and_check(expect_code=None)


def test_frozen_replica_detected_by_heartbeat(server_factory, synth_parts2, tmp_path):
    """A replica that stops answering (SIGSTOP: connection open, process frozen) is dropped
    after the heartbeat timeout, long before the request deadline, and the epoch completes."""
    cluster, path = _cluster(tmp_path, 2, replicas=2)
    servers = _start(server_factory, synth_parts2, cluster, path)
    victim = servers[cluster.partitions[1][0]]
    pool = ServerPool(cluster, timeout_s=120, max_message_bytes=64 << 20, heartbeat_s=0.5,
                      heartbeat_timeout_s=2.0)
    try:
        loader = _loader(pool, synth_parts2)
        seen, t_freeze = [], None
        for i, (_, out, _) in enumerate(loader):
            seen.append(out.clone())
            if i == 2:
                os.kill(victim.proc.pid, signal.SIGSTOP)
                t_freeze = time.monotonic()
        elapsed = time.monotonic() - t_freeze
        seen_all = torch.cat(seen)
        assert torch.equal(torch.sort(seen_all).values, torch.sort(loader.seeds).values)
        assert pool.failovers >= 1
        assert elapsed < 60, f"took {elapsed:.1f}s: the frozen server was not dropped early"
    finally:
        pool.close()
        os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    victim.stop_and_check(expect_code=None)


@pytest.mark.parametrize("replicas", [1, 2])
def test_server_frozen_between_requests(replicas, server_factory, synth_parts2, tmp_path,
                                        caplog):
    """A server frozen while nothing is in flight on it (SIGSTOP between requests) misses its
    heartbeats and is dropped idle. With a replica, the part's requests go to the other one
    and one warning says so. Without one, the next request goes to it anyway (it may have
    recovered); its reconnection is accepted by the kernel but never completes a handshake,
    so the request fails within the heartbeat timeout (the handshake gets that time too),
    not after libzmq's default 30 s handshake timeout, with the "frozen" diagnosis."""
    cluster, path = _cluster(tmp_path, 2, replicas=replicas)
    servers = _start(server_factory, synth_parts2, cluster, path)
    victim_ep = cluster.partitions[1][0]
    victim = servers[victim_ep]
    hb_timeout_s = 2.0
    pool = ServerPool(cluster, timeout_s=120, max_message_bytes=64 << 20, heartbeat_s=0.5,
                      heartbeat_timeout_s=hb_timeout_s)
    caplog.set_level("WARNING", logger="mfgserve.replicas")
    try:
        for _ in range(replicas):  # every replica of part 1 answered once
            assert isinstance(pool.wait(pool.submit(1, StatsRequest())), StatsReply)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while pool.healthy(victim_ep):  # dropped once its heartbeats go unanswered
            assert time.monotonic() < deadline, "the frozen server was never dropped"
            time.sleep(0.1)
        t0 = time.monotonic()
        if replicas == 2:
            for _ in range(3):
                h = pool.submit(1, StatsRequest())
                assert h.channel.endpoint != victim_ep
                assert isinstance(pool.wait(h), StatsReply)
            warned = [r.getMessage() for r in caplog.records]
            assert len(warned) == 1 and f"{victim_ep} (part 1) dropped with no request" in \
                warned[0], warned
            assert pool.failovers == 0
        else:
            with pytest.raises(MfgServeError) as err:
                pool.wait(pool.submit(1, StatsRequest()))
            elapsed = time.monotonic() - t0
            text = str(err.value)
            assert victim_ep in text and "frozen" in text, text
            assert elapsed < hb_timeout_s + 8, f"took {elapsed:.1f}s: {text}"
    finally:
        pool.close()
        os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    victim.stop_and_check(expect_code=None)
