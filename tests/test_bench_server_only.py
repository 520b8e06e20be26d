"""``python -m benchmarks.server_only`` end to end on a small partition set: a real server,
its exit code, the JSON line. Its requests carry sample seeds by default, as a trainer's do
(``--deterministic-sampling``), so two runs with the same ``--seed`` sample the same MFGs
whatever the server's threads do. The runs keep one request in flight: with more, replies may
arrive in another order, and which of them are the untimed warm-up (not counted in
``input_nodes_per_batch``) would differ between runs. Timings are never asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from procs import REPO


def _run(parts, *extra: str) -> dict:
    argv = [sys.executable, "-m", "benchmarks.server_only", "--parts", str(parts),
            "--num-batches", "4", "--batch-size", "64", "--fanouts", "5,5", "--inflight", "1",
            *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=110, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(360)
def test_server_only_sends_seeded_requests_by_default(synth_parts1):
    first, second = _run(synth_parts1), _run(synth_parts1)
    unseeded = _run(synth_parts1, "--sampling", "unseeded")
    for res in (first, second, unseeded):
        assert res["clean_exit"] is True
        assert res["batches"] == 4 and res["batches_per_s"] > 0
        assert res["server_stats"]["sample_requests"] == 4 + 2  # the 2 warm-up requests
    assert first["sampling"] == second["sampling"] == "seeded"
    assert unseeded["sampling"] == "unseeded"
    # seeded: the same batches sampled the same way, so the same input nodes
    assert first["input_nodes_per_batch"] == second["input_nodes_per_batch"]


@pytest.mark.timeout(60)
def test_server_only_rejects_an_unknown_sampling_mode(synth_parts1):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.server_only", "--parts",
                           str(synth_parts1), "--sampling", "random"], capture_output=True,
                          text=True, timeout=50, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "--sampling" in proc.stderr and "seeded" in proc.stderr
