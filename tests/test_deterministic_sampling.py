"""Reproducible sampling (issue 13): a SampleRequest with ``sample_seed`` >= 0 gets the same
MFG every time, from sampler threads or sampler processes, from either replica of a part,
across parts, under concurrent load, and after a trainer's failover resend; the seeded
sampler still samples what DGL's does (edges of the graph, min(degree, fanout) each,
uniformly). Real server processes on real sockets (tests/procs.py)."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from procs import ServerProcess, stop_all
from rpc_helpers import channel
from scipy.stats import chisquare

from common.cluster import ClusterSpec
from common.messages import MFGReply, SampleRequest
from common.mfg import MFG
from partition.layout import PartitionSetMeta
from sampler_server.partition_store import PartitionStore
from tests.test_mfg_oracle import Oracle, mixed_seeds
from trainer_client.loader import DistNodeDataLoader, mfg_tensors
from trainer_client.server_pool import ServerPool

pytestmark = pytest.mark.timeout(240)
FANOUTS = [4, 3, 2]


def _tensors(reply: MFGReply) -> list[torch.Tensor]:
    """Everything a reply's MFG holds (ids, per-layer CSC, features, labels)."""
    assert isinstance(reply, MFGReply), reply
    return mfg_tensors(MFG.of(reply.mfg))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _requests(parts, n: int) -> list[SampleRequest]:
    return [SampleRequest(seeds=mixed_seeds(parts, 48, i), fanouts=FANOUTS, sample_seed=1000 + i)
            for i in range(n)]


def _serve_all(endpoint: str, reqs: list[SampleRequest], inflight: int = 4) -> list[MFGReply]:
    """Replies to ``reqs`` from one channel, up to ``inflight`` outstanding, in request order."""
    out: dict[int, MFGReply] = {}
    with channel(endpoint, timeout_s=60) as ch:
        pending: dict[int, int] = {}
        todo = list(enumerate(reqs))
        while todo or pending:
            while todo and len(pending) < inflight:
                i, req = todo.pop(0)
                pending[ch.send(req)] = i
            reply, rid = ch.recv()
            out[pending.pop(rid)] = reply
    return [out[i] for i in range(len(reqs))]


def _cluster(tmp_path, layout: dict[int, int]) -> tuple[ClusterSpec, object]:
    """A cluster file with ``layout[part]`` replicas of each part."""
    cluster = ClusterSpec({p: [f"ipc://{tmp_path}/d{p}r{r}.sock" for r in range(n)]
                           for p, n in layout.items()})
    path = tmp_path / "cluster.yaml"
    cluster.write(path)
    return cluster, path


def _start_all(parts, cluster: ClusterSpec, path, tmp_path, extra: dict[str, list[str]]
               ) -> list[ServerProcess]:
    """Every server of ``cluster`` started at once (``extra[endpoint]``: its own options),
    then waited for."""
    servers = [ServerProcess(parts, p, ep, path, tmp_path,
                             ["--peer-timeout-s", "2", *extra.get(ep, [])])
               for p, ep in cluster.all_endpoints()]
    try:
        for s in servers:
            s.wait_ready()
    except AssertionError:
        stop_all(servers)
        raise
    return servers


@pytest.fixture(scope="module")
def mixed_cluster(tmp_path_factory, synth_parts2):
    """Two parts; part 0 has two replicas, one sampling in 2 threads and one in 2 sampler
    processes; part 1 one server."""
    tmp_path = tmp_path_factory.mktemp("mixed")
    cluster, path = _cluster(tmp_path, {0: 2, 1: 1})
    threads_ep, procs_ep = cluster.partitions[0]
    servers = _start_all(synth_parts2, cluster, path, tmp_path, {
        threads_ep: ["--num-workers", "2"], procs_ep: ["--sampler-procs", "2"]})
    yield cluster
    stop_all(servers)


@pytest.fixture(scope="module")
def replica_pair(tmp_path_factory, synth_parts1):
    """One part served by two replicas: (cluster, servers)."""
    tmp_path = tmp_path_factory.mktemp("pair")
    cluster, path = _cluster(tmp_path, {0: 2})
    servers = _start_all(synth_parts1, cluster, path, tmp_path, {})
    yield cluster, servers
    stop_all(servers)


def test_seeded_mfg_repeats_and_matches_graph(replica_pair, synth_graph, synth_parts1):
    """One part: the same seed gives the same MFG, another seed another one, and both are
    valid samples (the DGL oracle of test_mfg_oracle); the unseeded path still works."""
    ep = replica_pair[0].partitions[0][1]  # the replica the failover test keeps alive
    oracle = Oracle(synth_graph, synth_parts1)
    seeds = mixed_seeds(synth_parts1, 60, 1)
    for fanouts in ([4, 3], [-1, 2, 5]):
        reqs = [SampleRequest(seeds=seeds, fanouts=fanouts, sample_seed=s) for s in (7, 7, 8)]
        reqs.append(SampleRequest(seeds=seeds, fanouts=fanouts))
        replies = _serve_all(ep, reqs)
        for reply in replies:
            oracle.check(reply, seeds, fanouts)
        first, again, other, _ = (_tensors(r) for r in replies)
        assert _same(first, again), "the same sample seed gave another MFG"
        assert not _same(first, other), "another sample seed gave the same MFG"


def test_seeded_choice_uniform(synth_graph, synth_parts2):
    """A high-degree node with in-neighbours in both parts, sampled with seeds 0..1999 by
    its part's store: each neighbour is picked with probability fanout/degree (chi-square),
    never one twice, and each seed's pick is the same every time."""
    oracle = Oracle(synth_graph, synth_parts2)
    offsets = PartitionSetMeta.load(synth_parts2).node_offsets
    owner = np.searchsorted(offsets, np.arange(oracle.n), side="right") - 1
    v = next(v for v in np.argsort(-oracle.in_deg)[:200] if oracle.in_deg[v] >= 12
             and len(set(owner[oracle.src[oracle.dst == v]])) == 2)
    store = PartitionStore(str(synth_parts2), int(owner[v]))
    node, fanout, rounds = torch.tensor([int(v)]), 4, 2000
    picks = [store.sample_neighbors(node, fanout, seed)[1] for seed in range(rounds)]
    assert torch.equal(picks[7], store.sample_neighbors(node, fanout, 7)[1])
    assert all(torch.unique(p).numel() == fanout for p in picks)
    picked = torch.cat(picks).numpy()
    uniq = np.unique(oracle.src[oracle.dst == v])
    assert set(picked.tolist()) <= set(uniq.tolist())
    observed = np.array([(picked == u).sum() for u in uniq])
    assert chisquare(observed, np.full(uniq.size, rounds * fanout / uniq.size)).pvalue > 1e-4


def test_seeded_halo_sample_repeats_and_is_valid(synth_graph, synth_parts2_halo):
    """A store with a halo answers for owned and halo nodes together: seeded, the same
    sample every time, min(in-degree, fanout) distinct in-neighbours each."""
    oracle = Oracle(synth_graph, synth_parts2_halo)
    store = PartitionStore(str(synth_parts2_halo), 0)
    nodes = torch.cat([torch.arange(store.start, store.end)[::7], store.halo_nodes[::3]])
    assert store.halo_nodes.numel() > 0 and not store.all_owned(nodes)
    counts, src = store.sample_neighbors(nodes, 3, 11)
    again = store.sample_neighbors(nodes, 3, 11)
    assert torch.equal(counts, again[0]) and torch.equal(src, again[1])
    assert not torch.equal(src, store.sample_neighbors(nodes, 3, 12)[1])
    ids = nodes.numpy()
    assert np.array_equal(counts.numpy(), np.minimum(oracle.in_deg[ids], 3))
    dst = np.repeat(ids, counts.numpy())
    keys = dst * oracle.n + src.numpy()
    assert np.isin(keys, oracle.edge_keys).all() and np.unique(keys).size == keys.size


def _concurrent(endpoints: list[str], reqs: list[SampleRequest], clients: int) -> list:
    """Every client sends every request (to its endpoint, round robin) at the same time."""
    with ThreadPoolExecutor(clients) as pool:
        jobs = [pool.submit(_serve_all, endpoints[c % len(endpoints)], reqs)
                for c in range(clients)]
        return [j.result(timeout=180) for j in jobs]


def test_seeded_mfg_same_from_threads_processes_replicas_and_parts(
        mixed_cluster, synth_graph, synth_parts2):
    """A seeded request gives the same MFG from all three servers (the one of part 1 samples
    part 0's nodes through NEIGHBORS requests, and the other way round), also while several
    clients load them at once."""
    (threads_ep, procs_ep), (other_ep,) = mixed_cluster.partitions.values()
    oracle = Oracle(synth_graph, synth_parts2)
    reqs = _requests(synth_parts2, 6)
    reference = _serve_all(threads_ep, reqs)
    for reply, req in zip(reference, reqs):
        oracle.check(reply, req.seeds, FANOUTS)
    assert sum(r.timings["remote_requests"] for r in reference) > 0, "no hop crossed parts"
    want = [_tensors(r) for r in reference]
    for ep in (procs_ep, other_ep):
        got = [_tensors(r) for r in _serve_all(ep, reqs)]
        assert all(_same(w, g) for w, g in zip(want, got)), f"{ep} sampled other MFGs"
    for replies in _concurrent([threads_ep, procs_ep, other_ep], reqs, clients=4):
        assert all(_same(w, _tensors(g)) for w, g in zip(want, replies))


def _epoch(loader: DistNodeDataLoader, on_batch=None) -> list[list[torch.Tensor]]:
    out = []
    for i, (_, _, mfg) in enumerate(loader):
        out.append([t.clone() for t in mfg_tensors(mfg)])
        if on_batch is not None:
            on_batch(i)
    return out


def test_loader_failover_resend_keeps_the_mfgs(replica_pair):
    """A deterministic loader's epoch gives the same MFGs when one of the part's two
    replicas dies in the middle of it (its requests in flight re-sent to the other replica
    with their seed)."""
    cluster, servers = replica_pair
    victim = servers[0]
    pool = ServerPool(cluster, timeout_s=60, max_message_bytes=64 << 20)
    try:
        num_nodes = pool.info().num_nodes
        loader = DistNodeDataLoader(pool, pool.seeds("train"), [0, num_nodes],
                                    fanouts=[5, 5], batch_size=40, max_inflight=6, seed=3)
        assert len(loader) >= 10
        first = _epoch(loader)
        killers: list[threading.Timer] = []

        def kill_at_3(i: int) -> None:
            if i == 3:  # requests pile up on the frozen replica, then it dies
                os.kill(victim.proc.pid, signal.SIGSTOP)
                killers.append(threading.Timer(1.5, os.kill, (victim.proc.pid, signal.SIGKILL)))
                killers[-1].start()

        second = _epoch(loader, kill_at_3)
        for k in killers:
            k.join()
        assert pool.failovers >= 1, "no request was re-sent"
        assert len(first) == len(second)
        assert all(_same(a, b) for a, b in zip(first, second)), "failover changed an MFG"
        assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        victim.stop_and_check(expect_code=None)  # killed on purpose (or to end the test)
        pool.close()


def _loader(**kw) -> DistNodeDataLoader:
    """A loader that is only asked for its seeds (no server needed for that)."""
    return DistNodeDataLoader(None, torch.arange(100), [0, 100],  # type: ignore[arg-type]
                              fanouts=[2], batch_size=10, **kw)


def test_loader_sample_seeds_differ_per_batch_epoch_rank_and_are_stable():
    seen = set()
    for rank in range(2):
        for epoch in range(3):
            a, b = _loader(rank=rank, world_size=2, seed=5), _loader(rank=rank, world_size=2,
                                                                     seed=5)
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            seeds = [a.sample_seed(i) for i in range(len(a))]
            assert seeds == [b.sample_seed(i) for i in range(len(b))]
            assert all(0 <= s < 2**63 for s in seeds)
            seen.update(seeds)
    assert len(seen) == 2 * 3 * 5, "two batches share a sample seed"
    assert _loader(seed=6).sample_seed(0) != _loader(seed=5).sample_seed(0)
    assert _loader(deterministic=False).sample_seed(0) == -1


def test_sample_seed_out_of_range_is_refused():
    from common.errors import ProtocolError

    with pytest.raises(ProtocolError):
        SampleRequest(seeds=torch.tensor([1]), fanouts=[2], sample_seed=-2).check()
    with pytest.raises(ProtocolError):
        SampleRequest(seeds=torch.tensor([1]), fanouts=[2], sample_seed=2**63).check()
