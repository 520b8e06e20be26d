"""Sampler worker processes (``sampler-server --sampler-procs N``): the same MFGs as threads
(checked against the graph), memory reported, and a worker's death stops its server; the
server's exit (asked or killed) takes its workers with it."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import psutil
import pytest
import torch
import zmq
from rpc_helpers import channel

from common.cluster import ClusterSpec
from common.messages import MFGReply, SampleRequest, StatsReply, StatsRequest
from common.stats import ServerStats
from tests.test_mfg_oracle import Oracle, mixed_seeds

pytestmark = pytest.mark.timeout(240)


def _cluster(server_factory, parts, tmp_path, num_parts, procs=2):
    cluster = ClusterSpec({p: [f"ipc://{tmp_path}/sp{p}.sock"] for p in range(num_parts)})
    cluster_file = tmp_path / "cluster.yaml"
    cluster.write(cluster_file)
    servers = [server_factory(parts, p, cluster=cluster_file, endpoint=ep,
                              extra=["--sampler-procs", str(procs)])
               for p, ep in cluster.all_endpoints()]
    return cluster, servers


def _workers(server) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children()


def test_mfgs_from_sampler_processes_match_graph(server_factory, synth_graph, synth_parts2,
                                                  tmp_path):
    cluster, servers = _cluster(server_factory, synth_parts2, tmp_path, 2)
    oracle = Oracle(synth_graph, synth_parts2)
    assert all(len(_workers(s)) == 2 for s in servers)
    ctx = zmq.Context()
    try:
        with channel(cluster.partitions[0][0], ctx=ctx, timeout_s=60) as ch:
            rids = {}
            for i in range(6):  # several in flight: both processes work
                seeds = mixed_seeds(synth_parts2, 40, i)
                rids[ch.send(SampleRequest(seeds=seeds, fanouts=[4, 3]))] = seeds
            while rids:
                reply, rid = ch.recv()
                assert isinstance(reply, MFGReply)
                oracle.check(reply, rids.pop(rid), [4, 3])
                want = synth_graph.feat[oracle.n2o[reply.mfg.input_nodes.numpy()]]
                assert torch.equal(reply.mfg.only.feat.rows, torch.from_numpy(want))
            stats = ch.call(StatsRequest())
    finally:
        ctx.term()
    assert isinstance(stats, StatsReply)
    v = stats.values
    assert list(v) == [f.name for f in dataclasses.fields(ServerStats)]  # typed, by name
    assert v["sample_requests"] == 6 and v["errors"] == 0 and v["queue_len"] == 0
    assert v["sampler_processes"] == 3  # the server and its two workers
    assert 0 < v["mem_pss_bytes"] <= v["mem_rss_bytes"]
    for s in servers:
        pids = [w.pid for w in _workers(s)]
        s.stop_and_check()
        assert not [p for p in pids if psutil.pid_exists(p)
                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_dead_sampler_process_stops_its_server(server_factory, synth_parts1, tmp_path):
    _, (server,) = _cluster(server_factory, synth_parts1, tmp_path, 1)
    victim = _workers(server)[0]
    victim.send_signal(signal.SIGKILL)
    code = server.proc.wait(timeout=30)
    server.checked = True
    assert code == 1
    assert "sampler process" in server.log.read_text()


def test_killed_server_takes_its_workers(server_factory, synth_parts1, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the killed server's directory stays there
    _, (server,) = _cluster(server_factory, synth_parts1, tmp_path, 1)
    workers = _workers(server)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    server.checked = True
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(w.is_running() and w.status() != "zombie"
                                              for w in workers):
        time.sleep(0.1)
    assert not any(w.is_running() and w.status() != "zombie" for w in workers)


def test_next_server_removes_a_killed_servers_directory(server_factory, synth_parts1, tmp_path,
                                                        monkeypatch):
    """A server with sampler processes keeps their socket in a private directory; killed with
    SIGKILL it cannot remove it, so the next server with sampler processes does
    (common/rundirs.py) and keeps its own."""
    tmp = tmp_path / "t"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the servers' temporary directory
    _, (server,) = _cluster(server_factory, synth_parts1, tmp_path, 1)
    (left,) = tmp.glob("mfgserve-samplers-*")
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    server.checked = True
    assert left.is_dir()  # nothing ran to remove it
    server_factory(synth_parts1, 0, endpoint=f"ipc://{tmp_path}/again.sock",
                   extra=["--sampler-procs", "1"])
    assert not left.exists()
    assert len(list(tmp.glob("mfgserve-samplers-*"))) == 1  # the running server's own
