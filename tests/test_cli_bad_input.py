"""Every CLI answers the bad inputs of issue 9 with exit code 2, a message naming what failed
and what to change, no traceback, and no work started (no summary, nothing written)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from procs import REPO, clean_env

pytestmark = pytest.mark.timeout(120)


def _run(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=90, cwd=REPO, env=clean_env(), stdin=subprocess.DEVNULL)


CASES = {
    # name: (module, args (with {parts2}, {tmp} placeholders), words the error must contain)
    "worker-fanout-too-large": ("deploy.worker_mode", ["--fanouts", "1000000000", "--epochs",
                                "1", "--work-dir", "{tmp}/w"], ["--fanouts", "100000"]),
    "worker-eval-fanout-too-large": ("deploy.worker_mode", ["--fanouts", "10,10",
                                     "--eval-fanouts", "10,1000000000", "--work-dir",
                                     "{tmp}/w"], ["--eval-fanouts", "100000"]),
    "worker-too-many-layers": ("deploy.worker_mode", ["--fanouts", "2,2,2,2,2,2,2,2,2",
                               "--work-dir", "{tmp}/w"], ["--fanouts", "1..8"]),
    "trainer-fanout-too-large": ("deploy.trainer_cli", ["--cluster", "{tmp}/c.yaml",
                                 "--fanouts", "5,200000"], ["--fanouts", "100000"]),
    "server-multipart-without-cluster": ("sampler_server.main", ["--parts", "{parts2}",
                                         "--part-id", "0", "--bind", "ipc://{tmp}/s.sock"],
                                         ["--cluster", "2 parts"]),
    "server-missing-token-file": ("sampler_server.main", ["--parts", "{parts1}", "--bind",
                                  "ipc://{tmp}/s.sock", "--shutdown-token-file",
                                  "{tmp}/nope"], ["--shutdown-token-file", "nope"]),
    "server-short-token": ("sampler_server.main", ["--parts", "{parts1}", "--bind",
                           "ipc://{tmp}/s.sock", "--shutdown-token-file", "{tmp}/short"],
                           ["--shutdown-token-file", "16"]),
    "server-zero-backlog": ("sampler_server.main", ["--parts", "{parts1}", "--bind",
                            "ipc://{tmp}/s.sock", "--max-peer-backlog-mb", "0"],
                            ["--max-peer-backlog-mb"]),
    "server-missing-parts": ("sampler_server.main", ["--parts", "{tmp}/missing", "--bind",
                             "ipc://{tmp}/s.sock"], ["missing", "partition-ogbn"]),
    "server-node-missing-parts": ("deploy.server_node", ["--parts", "{tmp}/missing",
                                  "--cluster-out", "{tmp}/c.yaml"], ["missing",
                                                                     "partition-ogbn"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cli_bad_input_exit_2(name, tmp_path, synth_parts1, synth_parts2):
    module, args, words = CASES[name]
    (tmp_path / "short").write_text("abc")
    (tmp_path / "c.yaml").write_text("partitions: {0: [ipc:///nonexistent/s.sock]}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [a.format(tmp=tmp_path, parts1=synth_parts1, parts2=synth_parts2) for a in args]
    proc = _run(module, args, tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for w in words:
        assert w in proc.stderr, (w, proc.stderr[-3000:])
    assert not proc.stdout.strip(), "a refused run prints no summary"
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a refused run wrote files"
