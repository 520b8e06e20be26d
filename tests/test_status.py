"""``mfgserve-status`` against real servers on real TCP sockets.

* a live 2-part cluster after some sampling traffic (part 0 samples in a sampler process, part
  1 in threads): the table and the JSON document name both parts, every server is up with
  nonzero request counts and rates, the sampler process's counts are included, the traffic's
  connection counts as a trainer, a bad request is counted under its error code; exit 0;
* a frozen server (SIGSTOP) is reported down as frozen within --timeout-s (exit 1 naming its
  part) and up again after SIGCONT; a killed one (SIGKILL) is reported down as refused;
* a missing or malformed cluster file: exit 2 with one line, no traceback;
* the last minute's window (common.stats.WindowedTally) on an explicit clock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from procs import REPO, free_ports
from rpc_helpers import channel

from common.cluster import ClusterSpec
from common.errors import RemoteError
from common.messages import MFGReply, SampleRequest, SeedsReply, SeedsRequest
from common.shm_ring import ShmRing
from common.stats import ServerCounters, WindowedTally
from deploy.status_cli import main as status_main

CLI_TIMEOUT_S = 60.0  # the CLI's own deadline is --timeout-s; this only catches a hang


def status(cluster: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run mfgserve-status to completion (a hang fails the test at CLI_TIMEOUT_S)."""
    return subprocess.run([sys.executable, "-m", "deploy.status_cli", "--cluster", str(cluster),
                           *extra], capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          cwd=REPO, stdin=subprocess.DEVNULL)


def status_here(capsys, *argv: str) -> tuple[int, str, str]:
    """mfgserve-status in this process (same code, no interpreter start): (code, out, err)."""
    capsys.readouterr()
    code = status_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def sample_traffic(ch) -> int:
    """A few SAMPLE requests for the part's own train seeds (the first with its features
    gathered into a shared-memory ring slot, as for a trainer on the same host) and one bad
    one (a seed id out of range); returns the number of good requests."""
    seeds = ch.call(SeedsRequest(split="train"))
    assert isinstance(seeds, SeedsReply) and seeds.seeds.numel() > 0
    batches = seeds.seeds[:96].split(32)
    ring = ShmRing(1, 4 << 20)
    try:
        for i, batch in enumerate(batches):
            slot = ring.ref(ring.acquire()) if i == 0 else None
            reply = ch.call(SampleRequest(seeds=batch, fanouts=[3, 3], slot=slot))
            assert isinstance(reply, MFGReply)
            assert (reply.mfg.only.feat.via == "ring") == (i == 0), reply.mfg.only.feat
    finally:
        ring.close()
    with pytest.raises(RemoteError, match="id_out_of_range"):
        ch.call(SampleRequest(seeds=torch.tensor([10**9]), fanouts=[3]))
    return len(batches)


def check_up(doc: dict, part: int, good: int) -> None:
    (srv,) = [s for s in doc["servers"] if s["part"] == part]
    assert srv["state"] == "up", srv
    st, d = srv["status"], srv["derived"]
    assert st["part_id"] == part and st["num_parts"] == 2 and st["pid"] > 0, st
    assert st["stats"]["sample_requests"] == good, st["stats"]  # sampler counts included
    assert st["window"]["requests"] >= good + 2 and d["requests_per_s"] > 0, (st, d)
    assert st["window"]["seeds_served"] > 0 and d["seeds_per_s"] > 0, (st, d)
    assert st["trainers"] >= 1, st  # the traffic's connection, seen within the minute
    assert st["error_codes"] == {"id_out_of_range": 1.0}, st["error_codes"]
    assert st["stats"]["mem_rss_bytes"] > 0 and st["samplers_alive"] == st["samplers"] >= 1
    assert (d["ring_replies"], d["wire_replies"]) == (1, good - 1), d
    assert st["stats"]["ring_rows"] > 0, st["stats"]
    assert st["queue_limit"] > 0 and st["protocol_version"] > 0 and st["uptime_s"] > 0


@pytest.mark.timeout(240)
def test_status_live_frozen_and_killed(synth_parts2, server_factory, tmp_path, capsys):
    ports = free_ports(2)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    cluster = tmp_path / "cluster.yaml"
    ClusterSpec({p: [endpoints[p]] for p in (0, 1)}).write(cluster)
    servers = [server_factory(synth_parts2, 0, cluster, endpoints[0], ["--sampler-procs", "1"]),
               server_factory(synth_parts2, 1, cluster, endpoints[1], ["--num-workers", "1"])]
    with channel(endpoints[0]) as ch0, channel(endpoints[1]) as ch1:
        good = [sample_traffic(ch0), sample_traffic(ch1)]

        code, table, err = status_here(capsys, "--cluster", str(cluster))
        assert code == 0, err
        assert all(ep in table for ep in endpoints), table
        assert table.count(" up ") == 2 and "processes" in table, table
        js = status(cluster, "--json")
        assert js.returncode == 0, js.stderr
        doc = json.loads(js.stdout)
        assert doc["ok"] and doc["missing_parts"] == [], doc
        assert doc["parts"] == {"0": {"servers": 1, "live": 1}, "1": {"servers": 1, "live": 1}}
        for part in (0, 1):
            check_up(doc, part, good[part])
        by_part = {s["part"]: s["status"] for s in doc["servers"]}
        assert by_part[0]["peers"] + by_part[1]["peers"] >= 1  # sampling crossed parts
        assert by_part[0]["sampler_kind"] == "processes" and by_part[0]["samplers"] == 1
        assert by_part[1]["sampler_kind"] == "threads" and by_part[1]["samplers"] == 1

    frozen = servers[1].proc
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        code, out, err = status_here(capsys, "--cluster", str(cluster), "--json",
                                     "--timeout-s", "3")
        took = time.monotonic() - t0
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    assert code == 1, (out, err)
    assert "part 1 has no live server" in err and endpoints[1] in err, err
    down = {s["part"]: s for s in json.loads(out)["servers"]}
    assert down[0]["state"] == "up" and down[1]["state"] == "down", down
    assert "frozen" in down[1]["reason"] and "--timeout-s" in down[1]["reason"], down[1]
    assert took < CLI_TIMEOUT_S, took  # 3 s and a little: one deadline for all servers
    code, again, err = status_here(capsys, "--cluster", str(cluster))  # resumed: answers
    assert code == 0, (again, err)

    servers[1].proc.send_signal(signal.SIGKILL)
    assert servers[1].stop_and_check(expect_code=-signal.SIGKILL) == -signal.SIGKILL
    out = status(cluster, "--timeout-s", "3")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "part 1 has no live server" in out.stderr, out.stderr
    assert "refused" in out.stderr and "part 0" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content, says", [
    (None, "does not exist"),
    ("partitions: [oops", "not valid YAML"),
    ("partitions: {0: [http://x]}", "not a ZeroMQ endpoint"),
    ("parts: {}", "expected a mapping"),
])
def test_status_bad_cluster_file(tmp_path, capsys, content, says):
    cluster = tmp_path / "cluster.yaml"
    if content is not None:
        cluster.write_text(content)
    code, out, err = status_here(capsys, "--cluster", str(cluster))
    assert code == 2, (out, err)
    assert says in err and str(cluster) in err, err
    assert "Traceback" not in err and not out.strip()


@pytest.mark.timeout(60)
def test_status_bad_options(capsys):
    code, out, err = status_here(capsys, "--cluster", "c.yaml", "--timeout-s", "0")
    assert code == 2 and "--timeout-s must be > 0" in err, err
    code, out, err = status_here(capsys)
    assert code == 2 and "needs --cluster" in err, err


@pytest.mark.timeout(120)
def test_status_help_names_every_option():
    """The console script as a user runs it (a real process)."""
    out = subprocess.run([sys.executable, "-m", "deploy.status_cli", "--help"],
                         capture_output=True, text=True, timeout=CLI_TIMEOUT_S, cwd=REPO)
    assert out.returncode == 0, out.stderr
    for flag in ("--cluster", "--json", "--timeout-s", "--curve-secret-key", "Exit code"):
        assert flag in out.stdout, out.stdout


def test_windowed_tally_keeps_the_last_minute():
    now = [1000.25]
    tally = WindowedTally(ServerCounters(), seconds=60, clock=lambda: now[0])
    tally.add(requests=5)  # second 1000
    now[0] = 1030.5
    tally.add(ServerCounters(requests=2, seeds_served=64))
    window, span = tally.window()
    assert (window.requests, window.seeds_served) == (7, 64)
    assert span == pytest.approx(30.25)  # younger than the window: its age
    now[0] = 1060.5  # second 1000 left the window; 1030 is still in it
    window, span = tally.window()
    assert (window.requests, window.seeds_served) == (2, 64)
    assert span == pytest.approx(59.5)
    now[0] = 1095.0
    tally.add(requests=1)  # reuses second 1030's bucket slot (1095 % 60 == 1035 % 60)
    window, _ = tally.window()
    assert window.requests == 1 and tally.snapshot().requests == 8



@pytest.mark.timeout(60)
def test_a_frozen_listener_reads_frozen_even_if_the_caller_stalls_after_connecting():
    """The connection monitor is attached before the connect (make_socket's monitor_events):
    a caller preempted between connecting and reading events (a loaded machine) still sees
    the first CONNECTED event, so a listener that accepts but never answers (a SIGSTOPped
    server) reads "frozen", not "unreachable" (a CI run once lost that event when the
    monitor was attached after the connect)."""
    import socket

    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from common.rpc import RpcChannel
    from common.sockets import make_socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # the kernel completes handshakes; nobody ever accepts
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, endpoint, bind=False,
                           monitor_events=zmq.EVENT_CONNECTED)
        time.sleep(0.5)  # the stall: the IO thread connects meanwhile
        monitor = sock.get_monitor_socket()
        assert monitor.poll(5000), "the CONNECTED event was lost"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ch = RpcChannel(ctx, endpoint, timeout_s=1.0, setting="--timeout-s")
        try:
            time.sleep(0.5)
            assert ch.sock.get_monitor_socket() is ch.monitor
            assert "frozen" in ch.diagnose(0.5, dropped=False)
        finally:
            ch.close()
    finally:
        ctx.term()
        listener.close()
