"""Real ``trainer-client`` processes against real servers, for the checkpoint and training
control tests: start one or several ranks, wait under a deadline, read the run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from procs import REPO, clean_env, communicate_all, free_ports

from common.cluster import ClusterSpec

# Small and quick: a 3,000-node graph, 8 hidden units, 2 layers of 5 neighbours.
BASE = ["--fanouts", "5,5", "--batch-size", "256", "--hidden", "8", "--no-progress",
        "--num-threads", "1", "--eval-batch-size", "4096"]


def cluster_file(tmp: Path, endpoints: dict[int, list[str]], name: str = "cluster.yaml") -> Path:
    path = tmp / name
    ClusterSpec(endpoints).write(path)
    return path


def start_trainers(cluster: Path, args: list[str], world_size: int = 1) -> list[subprocess.Popen]:
    """``world_size`` trainer-client ranks (DDP over a free loopback port when more than one),
    run from the repository root, output captured."""
    port = free_ports(1)[0]
    procs = []
    for rank in range(world_size):
        ddp = (["--rank", str(rank), "--world-size", str(world_size), "--local-rank", str(rank),
                "--master-port", str(port)] if world_size > 1 else [])
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "trainer_client.main", "--cluster", str(cluster), *BASE,
             *map(str, args), *ddp], cwd=REPO, env=clean_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float,
           codes: int | list[int] = 0) -> list[tuple[str, str]]:
    """Wait for every rank (killing the rest after a failure or the deadline) and assert each
    exit code (``codes``: one for all, or per rank)."""
    outs = communicate_all(procs, timeout)
    expected = codes if isinstance(codes, list) else [codes] * len(procs)
    for rank, (p, (_, err), code) in enumerate(zip(procs, outs, expected)):
        assert p.returncode == code, (f"rank {rank} exited with {p.returncode}, expected "
                                      f"{code}:\n{err[-4000:]}")
    return outs


def train(cluster: Path, args: list[str], world_size: int = 1, timeout: float = 240) -> dict:
    """Run to completion (every rank exits 0); rank 0's summary (its last stdout line)."""
    outs = finish(start_trainers(cluster, args, world_size), timeout)
    return json.loads(outs[0][0].strip().splitlines()[-1])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
