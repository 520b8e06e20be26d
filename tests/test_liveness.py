"""Liveness and memory with real processes on real sockets (DESIGN.md invariants 3 and 4).

* A trainer killed mid-training (SIGKILL, requests in flight) costs the servers nothing: they
  stay up (same pid), their sample queue drains to empty and stays there (no work is kept for
  the dead trainer), and a new training job against them completes.
* A DDP rank killed mid-training: the surviving rank exits non-zero within a bound (gloo sees
  the dead peer, or ``--ddp-timeout-s`` fires) instead of hanging; the servers keep serving.
* 1000 connect / Ping / disconnect cycles, plus clients that vanish with SampleRequests in
  flight: the server survives, its RSS and open file descriptors do not grow with the number
  of clients it has seen, and it still answers a valid SampleRequest exactly.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import zmq
from procs import REPO, ServerProcess, clean_env, free_ports, tail
from rpc_helpers import call, channel

from common.cluster import ClusterSpec
from common.messages import MFGReply, Ping, Pong, SampleRequest, StatsReply, StatsRequest
from common.rpc import expect

LONG_JOB = ["--epochs", "1000", "--batch-size", "64", "--fanouts", "5,5", "--no-progress",
            "--max-inflight", "8", "--num-threads", "1"]
SHORT_JOB = ["--epochs", "2", "--batch-size", "64", "--fanouts", "5,5", "--no-progress",
             "--max-inflight", "8", "--num-threads", "1"]
RPC_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- helpers




def _tcp_cluster(server_factory, parts: Path, tmp_path: Path,
                 ports: list[int]) -> tuple[Path, list[ServerProcess]]:
    """A cluster file with one TCP server per part, and those servers, started."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in ports]
    cluster = tmp_path / "cluster.yaml"
    ClusterSpec({p: [ep] for p, ep in enumerate(endpoints)}).write(cluster)
    servers = [server_factory(parts, p, cluster=cluster, endpoint=ep,
                              extra=["--peer-timeout-s", "5"])
               for p, ep in enumerate(endpoints)]
    return cluster, servers


class Trainer:
    """One ``trainer-client`` process; output in files (no pipe can fill up), always reaped."""

    def __init__(self, workdir: Path, name: str, cluster: Path, args: list[str],
                 env: dict[str, str]):
        self.name = name
        self.out = workdir / f"{name}.out"
        self.err = workdir / f"{name}.err"
        argv = [sys.executable, "-m", "deploy.trainer_cli", "--cluster", str(cluster), *args]
        with open(self.out, "w") as fo, open(self.err, "w") as fe:
            self.proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                         cwd=REPO, env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} still running after {timeout}s:\n"
                                 f"{tail(self.err, 40)}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stderr(self, n: int = 40) -> str:
        return tail(self.err, n)


def _ping(ctx: zmq.Context, server: ServerProcess) -> Pong:
    return call(server.endpoint, Ping(), Pong, ctx=ctx, timeout_s=RPC_TIMEOUT_S)


def _stats(ctx: zmq.Context, server: ServerProcess) -> dict[str, float]:
    return call(server.endpoint, StatsRequest(), StatsReply, ctx=ctx,
                timeout_s=RPC_TIMEOUT_S).values


def _sample(ctx: zmq.Context, endpoint: str, seeds: torch.Tensor) -> MFGReply:
    """One SampleRequest (fanouts 5,5) on a fresh channel, answered within the deadline."""
    return call(endpoint, SampleRequest(seeds=seeds, fanouts=[5, 5]), MFGReply, ctx=ctx,
                timeout_s=RPC_TIMEOUT_S)


def _wait_sampling(ctx: zmq.Context, servers: list[ServerProcess], trainers: list[Trainer],
                   at_least: int, timeout: float = 90.0) -> list[dict[str, float]]:
    """Wait until every server has answered ``at_least`` sample requests (training is on)."""
    deadline = time.monotonic() + timeout
    while True:
        for t in trainers:
            assert t.alive(), f"{t.name} exited early with {t.proc.returncode}:\n{t.stderr()}"
        stats = [_stats(ctx, s) for s in servers]
        if all(st["sample_requests"] >= at_least for st in stats):
            return stats
        assert time.monotonic() < deadline, \
            f"servers saw no training within {timeout}s: {stats}\n{trainers[0].stderr()}"
        time.sleep(0.1)


def _wait_idle(ctx: zmq.Context, server: ServerProcess, timeout: float) -> dict[str, float]:
    """Wait until the server's sample queue is empty and its counters stop moving: no work is
    left for anybody. Returns the settled stats."""
    deadline = time.monotonic() + timeout
    prev = None
    while True:
        st = _stats(ctx, server)
        if (st["queue_len"] == 0 and prev is not None
                and st["sample_requests"] == prev["sample_requests"]):
            return st
        prev = st
        assert time.monotonic() < deadline, \
            f"server {server.endpoint} still busy {timeout}s after its client died: {st}"
        time.sleep(0.5)


def _stop_all(servers: list[ServerProcess]) -> None:
    """SIGTERM every server and require exit code 0 of each; all are stopped even when one
    fails its check, so none is left running."""
    failures = []
    for s in servers:
        try:
            code = s.stop_and_check(expect_code=None)
        except AssertionError as e:  # did not stop in time (it was killed)
            failures.append(str(e))
            continue
        if code != 0:
            failures.append(f"server {s.endpoint} exited with {code}:\n{tail(s.log)}")
    assert not failures, "\n".join(failures)


def _summary(stdout: str, where: str) -> dict:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    assert lines, f"{where} printed nothing on stdout"
    return json.loads(lines[-1])


def _assert_same_servers(ctx, servers: list[ServerProcess], pongs_before: list[Pong]) -> None:
    for p, (s, before) in enumerate(zip(servers, pongs_before)):
        assert s.proc.poll() is None, f"server {p} died:\n{tail(s.log)}"
        pong = _ping(ctx, s)
        assert (pong.part_id, pong.pid, pong.server_id) == (p, s.proc.pid, before.server_id), \
            "a server was replaced"


# --------------------------------------------------------------------------- trainer death


@pytest.mark.timeout(180)
def test_trainer_sigkill_leaves_servers_clean(server_factory, synth_parts2, tmp_path):
    cluster, servers = _tcp_cluster(server_factory, synth_parts2, tmp_path, free_ports(2))
    ctx = zmq.Context()
    try:
        pongs = [_ping(ctx, s) for s in servers]
        doomed = Trainer(tmp_path, "doomed", cluster, [*LONG_JOB, "--world-size", "1"],
                         clean_env())
        try:
            _wait_sampling(ctx, servers, [doomed], at_least=1)
            doomed.proc.send_signal(signal.SIGKILL)  # up to 8 requests in flight right now
            assert doomed.wait(10) == -signal.SIGKILL, doomed.stderr()
        finally:
            doomed.kill()

        t0 = time.monotonic()
        settled = [_wait_idle(ctx, s, timeout=10.0) for s in servers]
        idle_s = time.monotonic() - t0
        _assert_same_servers(ctx, servers, pongs)
        for p, st in enumerate(settled):
            assert st["queue_len"] == 0 and st["busy"] == 0, (p, st)
        print(f"\nservers idle {idle_s:.2f}s after the trainer's SIGKILL: "
              f"{[(st['sample_requests'], st['queue_len']) for st in settled]}")

        # A new job against the same servers runs to completion.
        fresh = Trainer(tmp_path, "fresh", cluster, [*SHORT_JOB, "--world-size", "1"],
                        clean_env())
        try:
            code = fresh.wait(120)
        finally:
            fresh.kill()
        assert code == 0, f"new job exited with {code}:\n{fresh.stderr()}"
        summary = _summary(fresh.out.read_text(), "the new job")
        assert summary["epochs"] == 2 and summary["num_parts"] == 2, summary
        assert summary["failovers"] == 0 and summary["seeds_per_s"] > 0, summary
        _assert_same_servers(ctx, servers, pongs)
        after = [_stats(ctx, s) for s in servers]
        for p, (st0, st1) in enumerate(zip(settled, after)):
            assert st1["sample_requests"] > st0["sample_requests"], (p, st0, st1)
            assert st1["queue_len"] == 0 and st1["busy"] == 0, (p, st1)
    finally:
        ctx.term()
    _stop_all(servers)


# --------------------------------------------------------------------------- DDP rank death

RANK0_EXIT_LIMIT_S = 60.0
DDP_TIMEOUT_S = 20


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_ddp_rank_death_surviving_rank_exits(how, server_factory, synth_parts2, tmp_path):
    """SIGKILL: gloo sees the connection close. SIGSTOP (a hung rank, sockets still open):
    only ``--ddp-timeout-s`` can end rank 0's collective."""
    *server_ports, master_port = free_ports(3)
    cluster, servers = _tcp_cluster(server_factory, synth_parts2, tmp_path, server_ports)
    ctx = zmq.Context()
    try:
        pongs = [_ping(ctx, s) for s in servers]
        ranks = []
        try:
            for rank in range(2):
                env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
                ranks.append(Trainer(tmp_path, f"rank{rank}", cluster,
                                     [*LONG_JOB, "--ddp-timeout-s", str(DDP_TIMEOUT_S)], env))
            # Sample requests are sent only after the process group and DDP are set up on
            # both ranks; a few dozen in means both are in their training loop.
            _wait_sampling(ctx, servers, ranks, at_least=20)
            victim = ranks[1]
            victim.proc.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
            t0 = time.monotonic()
            # Hard bound well past the limit so a hang is reported as a hang, with output.
            code = ranks[0].wait(RANK0_EXIT_LIMIT_S + 30)
            elapsed = time.monotonic() - t0
            victim.proc.kill()  # a stopped process dies of SIGKILL too
            assert victim.wait(10) == -signal.SIGKILL, victim.stderr()
        finally:
            for t in ranks:
                t.kill()
        err = ranks[0].stderr(25)
        print(f"\n[{how}] rank 0 exited with {code} {elapsed:.1f}s after rank 1's {how}; "
              f"stderr tail:\n{err}")
        assert code == 2, f"rank 0 should stop with a clear error (exit 2), got {code}:\n{err}"
        assert "--ddp-timeout-s" in err and "rank 0" in err and "Traceback" not in err, err
        assert elapsed < RANK0_EXIT_LIMIT_S, f"rank 0 took {elapsed:.1f}s to give up:\n{err}"
        assert not ranks[0].out.read_text().strip(), "a failed job must not print a summary"

        # The servers are unaffected: same processes, idle, and they serve a new request.
        settled = [_wait_idle(ctx, s, timeout=10.0) for s in servers]
        _assert_same_servers(ctx, servers, pongs)
        for p, s in enumerate(servers):
            seeds = torch.arange(pongs[p].node_offsets[p], pongs[p].node_offsets[p] + 32)
            reply = _sample(ctx, s.endpoint, seeds)
            assert torch.equal(reply.mfg.input_nodes[:32], seeds)
            assert reply.mfg.only.label.numel() == 32
            st = _stats(ctx, s)
            assert st["sample_requests"] == settled[p]["sample_requests"] + 1, (p, st)
    finally:
        ctx.term()
    _stop_all(servers)


# --------------------------------------------------------------------------- churn


CYCLES = 1000
ABANDON_EVERY = 100  # one client in ABANDON_EVERY vanishes with SampleRequests in flight
ABANDONED_REQUESTS = 4  # per vanishing client: more than the server's 2 sampler threads
MAX_RSS_GROWTH = 10 << 20


def _vanish_mid_request(ctx: zmq.Context, endpoint: str, seeds: torch.Tensor) -> int:
    """Send SampleRequests, make sure the server has read them, and close without reading
    their replies (a client that disappears mid-request). Returns how many replies were
    left unread."""
    with channel(endpoint, ctx=ctx, timeout_s=RPC_TIMEOUT_S) as ch:
        for _ in range(ABANDONED_REQUESTS):
            ch.send(SampleRequest(seeds=seeds, fanouts=[-1, -1]))
        ch.send(Ping())
        # One connection delivers in order and the server reads its input in order, answering
        # a Ping at once: when the Pong is here, it holds every SampleRequest.
        unread = ABANDONED_REQUESTS
        while not isinstance(ch.recv(waiting_for="the Pong")[0], Pong):
            unread -= 1  # a sample reply beat the Pong (rare): it was read, not abandoned
        return unread


@pytest.mark.timeout(150)
def test_connect_disconnect_churn_does_not_leak(server_factory, synth_parts1, tmp_path):
    server = server_factory(synth_parts1, 0, endpoint="tcp://127.0.0.1:0")
    proc = psutil.Process(server.proc.pid)
    ctx = zmq.Context()
    try:
        pong = _ping(ctx, server)
        all_nodes = torch.arange(pong.num_nodes)
        # Warm-up (not counted): concurrent whole-graph samples page in the mmapped partition
        # and give each sampler thread its allocator arena before the baseline is taken.
        with channel(server.endpoint, ctx=ctx, timeout_s=RPC_TIMEOUT_S) as ch:
            for _ in range(ABANDONED_REQUESTS):
                ch.send(SampleRequest(seeds=all_nodes, fanouts=[-1, -1]))
            for _ in range(ABANDONED_REQUESTS):
                expect(ch.recv(waiting_for="a warm-up sample")[0], MFGReply, server.endpoint)
        warm = ABANDONED_REQUESTS
        sent = unread = 0
        rss_100 = fds_100 = 0
        t0 = time.monotonic()
        for i in range(1, CYCLES + 1):
            if i % ABANDON_EVERY == ABANDON_EVERY // 2:
                unread += _vanish_mid_request(ctx, server.endpoint, all_nodes)
                sent += ABANDONED_REQUESTS
            assert _ping(ctx, server).pid == server.proc.pid
            if i == 100:
                _wait_idle(ctx, server, timeout=20.0)  # the vanished client's work is done
                rss_100, fds_100 = proc.memory_info().rss, proc.num_fds()
        churn_s = time.monotonic() - t0
        assert server.proc.poll() is None, f"server died under churn:\n{tail(server.log)}"
        assert unread >= sent // 2, f"only {unread} of {sent} sample replies went unread"
        # Every request of a vanished client was still sampled (its reply dropped), nothing
        # failed, nothing is left queued.
        st = _wait_idle(ctx, server, timeout=20.0)
        assert st["sample_requests"] == warm + sent and st["errors"] == 0, st
        assert st["requests"] >= CYCLES + sent, st  # each cycle really reached the server
        assert st["busy"] == 0, st
        time.sleep(0.5)  # let libzmq finish tearing down the last closed connections
        rss_end, fds_end = proc.memory_info().rss, proc.num_fds()
        print(f"\n{CYCLES} cycles in {churn_s:.1f}s ({unread} of {sent} sample replies left unread): server "
              f"RSS {rss_100 / 2**20:.1f} MiB after 100, {rss_end / 2**20:.1f} MiB after "
              f"{CYCLES} ({(rss_end - rss_100) / 2**20:+.2f} MiB); fds {fds_100} -> {fds_end}")
        assert rss_end - rss_100 < MAX_RSS_GROWTH, (rss_100, rss_end)
        assert fds_end <= fds_100 + 2, f"file descriptors leak: {fds_100} -> {fds_end}"

        # A valid request is still answered, exactly: seeds first, labels of those seeds.
        seeds = torch.tensor([0, 7, 123, pong.num_nodes - 1])
        reply = _sample(ctx, server.endpoint, seeds)
        labels = torch.from_numpy(np.load(synth_parts1 / "part-0" / "label.npy"))
        assert torch.equal(reply.mfg.input_nodes[:4], seeds)
        assert torch.equal(reply.mfg.only.label, labels[seeds])
        assert reply.mfg.only.feat.rows.shape == (reply.mfg.input_nodes.numel(), pong.feat_dim)
    finally:
        ctx.term()
    assert server.stop_and_check(expect_code=0) == 0
