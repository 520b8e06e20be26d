"""server-client mode as a user runs it: long-lived ``sampler-server`` processes on real TCP
sockets, a cluster file written first, and training jobs that come and go.

* loopback: two servers (one per part) serve two jobs in a row -- a single trainer, then two
  trainers configured the torchrun way (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the
  environment, no rank flags). The servers stay up (same pid and server id answer a ping after
  each job), their request counters grow across jobs, and SIGTERM stops them with exit code 0.
* multi-host: two "server hosts" and one "trainer host", each its own network namespace on a
  private bridge (tests/netns.py), train over TCP between namespaces; nothing is left behind.
* no server at the cluster file's endpoint: the trainer fails within its deadline, naming the
  endpoint and ``--request-timeout-s``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from netns import Host, NetnsLab, list_namespaces, netns_hosts
from procs import REPO, ServerProcess, clean_env, free_ports, tail
from rpc_helpers import call

from common.cluster import ClusterSpec
from common.messages import Ping, Pong, StatsReply, StatsRequest

TRAIN_ARGS = ["--epochs", "2", "--batch-size", "256", "--fanouts", "5,5", "--no-progress",
              "--num-threads", "1"]
NUM_CLASSES = 5  # synth_graph in conftest: chance accuracy is 0.2
MIN_ACC = 0.45
JOB_TIMEOUT_S = 120.0




def _trainer_argv(cluster: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deploy.trainer_cli", "--cluster", str(cluster), *extra]


class Job:
    """Trainer processes of one training job, their output in files (no pipe can fill up)."""

    def __init__(self, workdir: Path, name: str):
        self.workdir = workdir
        self.name = name
        self.procs: list[tuple[subprocess.Popen, Path, Path]] = []

    def start(self, popen: Callable[..., subprocess.Popen], argv: list[str],
              env: dict[str, str]) -> None:
        i = len(self.procs)
        out = self.workdir / f"{self.name}-t{i}.out"
        err = self.workdir / f"{self.name}-t{i}.err"
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, cwd=REPO, env=env)
        self.procs.append((proc, out, err))

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> list[str]:
        """Wait for every trainer; any non-zero exit or the deadline kills the rest and fails
        the test with that trainer's stderr. Returns each trainer's stdout."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p, _, _ in self.procs]
                for i, code in enumerate(codes):
                    if code not in (None, 0):
                        raise AssertionError(f"{self.name} trainer {i} exited with {code}:\n"
                                             f"{tail(self.procs[i][2], 40)}")
                if all(c == 0 for c in codes):
                    return [out.read_text() for _, out, _ in self.procs]
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{self.name}: trainers still running after {timeout}s:\n"
                        + "\n".join(f"--- trainer {i}:\n{tail(err, 15)}"
                                    for i, (_, _, err) in enumerate(self.procs)))
                time.sleep(0.1)
        finally:
            for p, _, _ in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)


def _summary(stdout: str, where: str) -> dict:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    assert lines, f"{where} printed nothing on stdout"
    return json.loads(lines[-1])


def _check_summary(summary: dict, num_trainers: int) -> None:
    assert summary["num_trainers"] == num_trainers, summary
    assert summary["num_parts"] == 2 and summary["epochs"] == 2, summary
    assert summary["seeds_per_s"] > 0 and summary["bytes_received"] > 0, summary
    assert summary["test_acc"] >= MIN_ACC, summary  # chance is 1/NUM_CLASSES


def _ping_and_stats(ctx: zmq.Context, endpoint: str) -> tuple[Pong, dict[str, float]]:
    return (call(endpoint, Ping(), Pong, ctx=ctx),
            call(endpoint, StatsRequest(), StatsReply, ctx=ctx).values)


# --------------------------------------------------------------------------- loopback TCP


@pytest.mark.timeout(240)
def test_servers_outlive_two_jobs_on_tcp(synth_parts2, server_factory, tmp_path):
    ports = free_ports(3)
    cluster = tmp_path / "cluster.yaml"
    ClusterSpec({p: [f"tcp://127.0.0.1:{ports[p]}"] for p in (0, 1)}).write(cluster)
    servers = [server_factory(synth_parts2, p, cluster=cluster,
                              endpoint=f"tcp://127.0.0.1:{ports[p]}") for p in (0, 1)]
    for p, s in enumerate(servers):
        assert s.endpoint == f"tcp://127.0.0.1:{ports[p]}"

    ctx = zmq.Context()
    try:
        # Job 1: one trainer, rank flags on the command line.
        job1 = Job(tmp_path, "job1")
        job1.start(subprocess.Popen, _trainer_argv(cluster, *TRAIN_ARGS, "--world-size", "1"),
                   clean_env())
        (out1,) = job1.wait()
        _check_summary(_summary(out1, "job 1"), 1)
        after1 = {}
        for p, s in enumerate(servers):
            assert s.proc.poll() is None, f"server {p} died after job 1:\n{tail(s.log)}"
            pong, stats = _ping_and_stats(ctx, s.endpoint)
            assert (pong.part_id, pong.pid) == (p, s.proc.pid)
            assert stats["sample_requests"] > 0, (p, stats)
            after1[p] = (pong.server_id, stats)
        assert sum(st["remote_requests"] for _, st in after1.values()) > 0, \
            "servers never sampled across the part boundary"

        # Job 2: two trainers configured the torchrun way (environment only, no rank flags).
        job2 = Job(tmp_path, "job2")
        for rank in range(2):
            env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[2]))
            job2.start(subprocess.Popen, _trainer_argv(cluster, *TRAIN_ARGS), env)
        out_rank0, out_rank1 = job2.wait()
        _check_summary(_summary(out_rank0, "job 2 rank 0"), 2)
        assert not out_rank1.strip(), f"rank 1 printed on stdout: {out_rank1[-500:]}"
        for p, s in enumerate(servers):
            assert s.proc.poll() is None, f"server {p} died after job 2:\n{tail(s.log)}"
            pong, stats = _ping_and_stats(ctx, s.endpoint)
            server_id, stats1 = after1[p]
            assert (pong.server_id, pong.pid) == (server_id, s.proc.pid), "server was replaced"
            assert stats["sample_requests"] > stats1["sample_requests"], (p, stats1, stats)
            assert stats["seeds_served"] > stats1["seeds_served"], (p, stats1, stats)
    finally:
        ctx.term()

    for s in servers:
        assert s.stop_and_check(expect_code=0) == 0


# --------------------------------------------------------------------------- multi-host


class NsServer(ServerProcess):
    """A ``sampler-server`` started inside a network namespace (same checks as ServerProcess)."""

    def __init__(self, lab: NetnsLab, host: Host, parts: Path, part_id: int, endpoint: str,
                 cluster: Path, workdir: Path):
        self.endpoint = endpoint
        self.ready = workdir / f"ready-{host.name}"
        self.log = workdir / f"server-{host.name}.log"
        argv = [sys.executable, "-m", "sampler_server.main", "--parts", str(parts),
                "--part-id", str(part_id), "--bind", endpoint, "--cluster", str(cluster),
                "--ready-file", str(self.ready)]
        self._log_file = open(self.log, "w")
        self.proc = lab.popen(host, argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, cwd=REPO)


STATS_SNIPPET = """
import json, sys
sys.path.insert(0, "tests")
from common.messages import Ping, Pong, StatsReply, StatsRequest
from rpc_helpers import call
out = {ep: {"part_id": call(ep, Ping(), Pong).part_id,
            **call(ep, StatsRequest(), StatsReply).values} for ep in sys.argv[1:]}
print(json.dumps(out))
"""


@pytest.mark.timeout(240)
def test_multi_host_over_tcp_between_namespaces(synth_parts2, tmp_path):
    port = 15550
    names: list[str] = []
    with netns_hosts(3) as lab:
        names = lab.namespaces
        assert set(names) <= list_namespaces()
        server_hosts, trainer_host = lab.hosts[:2], lab.hosts[2]
        endpoints = [f"tcp://{h.ip}:{port}" for h in server_hosts]
        cluster = tmp_path / "cluster.yaml"
        ClusterSpec({p: [endpoints[p]] for p in (0, 1)}).write(cluster)
        servers = [NsServer(lab, h, synth_parts2, p, endpoints[p], cluster, tmp_path)
                   for p, h in enumerate(server_hosts)]
        try:
            for s in servers:
                s.wait_ready()

            def in_trainer_host(argv, **kw):
                return lab.popen(trainer_host, argv, **kw)

            job = Job(tmp_path, "netns")
            for rank in range(2):
                env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                 MASTER_ADDR=trainer_host.ip, MASTER_PORT="29555")
                job.start(in_trainer_host, _trainer_argv(cluster, *TRAIN_ARGS), env)
            out_rank0, out_rank1 = job.wait()
            _check_summary(_summary(out_rank0, "rank 0 on the trainer host"), 2)
            assert not out_rank1.strip(), f"rank 1 printed on stdout: {out_rank1[-500:]}"

            # From the trainer host: both servers still answer, and both served samples.
            probe = in_trainer_host([sys.executable, "-c", STATS_SNIPPET, *endpoints],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=REPO, env=clean_env())
            out, err = probe.communicate(timeout=60)
            assert probe.returncode == 0, err[-3000:]
            stats = json.loads(out.strip().splitlines()[-1])
            for p, ep in enumerate(endpoints):
                assert stats[ep]["part_id"] == p
                assert stats[ep]["sample_requests"] > 0, stats
            assert sum(v["remote_requests"] for v in stats.values()) > 0, \
                "servers never talked to each other across hosts"
            for s in servers:
                assert s.stop_and_check(expect_code=0) == 0
        finally:
            for s in servers:
                if s.proc.poll() is None:
                    s.proc.kill()
                    s.proc.wait(timeout=10)
                s._log_file.close()
    assert names and not set(names) & list_namespaces(), "network namespaces left behind"


# --------------------------------------------------------------------------- no server


@pytest.mark.timeout(120)
def test_trainer_fails_fast_when_no_server_listens(tmp_path):
    port_a, port_b = free_ports(2)  # nothing listens on either
    endpoint = f"tcp://127.0.0.1:{port_a}"
    cluster = tmp_path / "cluster.yaml"
    ClusterSpec({0: [endpoint], 1: [f"tcp://127.0.0.1:{port_b}"]}).write(cluster)
    t0 = time.monotonic()
    proc = subprocess.run(_trainer_argv(cluster, *TRAIN_ARGS, "--request-timeout-s", "3"),
                          capture_output=True, text=True, timeout=90, cwd=REPO, env=clean_env(),
                          stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - t0
    assert proc.returncode not in (0, None), proc.stdout[-2000:]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert endpoint in proc.stderr and "--request-timeout-s" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not proc.stdout.strip(), "a failed job must not print a summary"
    assert elapsed < 60, f"took {elapsed:.1f}s to give up with --request-timeout-s 3"
