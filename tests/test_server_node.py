"""server-node: one command starts a host's servers on free ports, writes the cluster file,
serves consecutive training jobs, and stops everything on SIGTERM or when a server dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from procs import REPO, run_cli

pytestmark = pytest.mark.timeout(240)


def _start_node(parts, cluster_out, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "deploy.server_node", "--parts", str(parts),
                             "--cluster-out", str(cluster_out), "--host", "127.0.0.1",
                             "--num-workers", "1"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env)
    line = proc.stdout.readline()  # the "ready" line; the node's servers answer pings
    if not line:
        proc.kill()
        raise AssertionError(f"server-node exited early:\n{proc.stderr.read()[-3000:]}")
    return proc, json.loads(line)


def test_node_serves_jobs_and_stops_on_sigterm(synth_parts2, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    proc, ready = _start_node(synth_parts2, cluster)
    try:
        assert ready["event"] == "ready" and len(ready["servers"]) == 2
        assert all(ep.startswith("tcp://127.0.0.1:") for ep in ready["servers"])
        kids = psutil.Process(proc.pid).children()
        assert len(kids) == 2
        for _ in range(2):  # two jobs against the same servers
            out = run_cli("deploy.trainer_cli", ["--cluster", cluster, "--epochs", "1",
                                                 "--batch-size", "256", "--fanouts", "4,4",
                                                 "--no-progress"], timeout=120)
            assert json.loads(out.stdout.strip().splitlines()[-1])["num_parts"] == 2
        assert all(k.is_running() for k in kids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-3000:]
        _, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive
    finally:
        proc.kill()


def test_node_stops_all_when_a_server_dies(synth_parts2, tmp_path):
    proc, _ = _start_node(synth_parts2, tmp_path / "cluster.yaml")
    try:
        kids = psutil.Process(proc.pid).children()
        kids[0].kill()
        t0 = time.monotonic()
        code = proc.wait(timeout=30)
        err = proc.stderr.read()
        assert code == 1 and "exited with code" in err and "server p" in err, err[-3000:]
        assert time.monotonic() - t0 < 20
        _, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive
    finally:
        proc.kill()


def test_next_node_removes_a_killed_nodes_directory(synth_parts2, tmp_path):
    """server-node keeps its shutdown token and ready files in a private directory; killed
    with SIGKILL (its servers die with it) it leaves it behind, and the next server-node
    removes it and says so."""
    tmp = tmp_path / "t"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc, _ = _start_node(synth_parts2, tmp_path / "cluster.yaml", env)
    kids = psutil.Process(proc.pid).children()
    (left,) = tmp.glob("mfgserve-node-*")
    proc.kill()
    proc.communicate(timeout=30)
    _, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive and left.is_dir()
    again, _ = _start_node(synth_parts2, tmp_path / "cluster2.yaml", env)
    try:
        assert not left.exists()
        again.send_signal(signal.SIGTERM)
        _, err = again.communicate(timeout=30)
        assert again.returncode == 0 and f"removed {left}" in err, err[-3000:]
        assert not list(tmp.glob("mfgserve-node-*"))  # the second removed its own on exit
    finally:
        again.kill()
