"""What a server refuses (issue 9): requests for another partition set (servers of two
partitionings mixed in one cluster), a Shutdown without the launcher's token, and starting a
part of a multi-part set without a cluster file. Each refusal names what failed and what to
change; the server keeps serving everyone else."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from procs import REPO, clean_env, free_ports
from rpc_helpers import call

from common.cluster import ClusterSpec
from common.errors import RemoteError
from common.messages import Ack, MFGReply, Ping, Pong, SampleRequest, Shutdown
from partition.layout import PartitionSetMeta

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def random_parts2(tmp_path_factory, synth_graph) -> Path:
    """The same graph as synth_parts2, partitioned another way (random, not METIS)."""
    from partition.partitioner import partition_graph

    out = tmp_path_factory.mktemp("random2")
    partition_graph(synth_graph, 2, str(out), method="random", seed=0, progress=False)
    return out


def _mixed(server_factory, metis: Path, random: Path, tmp_path: Path):
    """Part 0 of the METIS set and part 1 of the random set, in one cluster file (TCP)."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    cluster = tmp_path / "cluster.yaml"
    ClusterSpec({0: [endpoints[0]], 1: [endpoints[1]]}).write(cluster)
    s0 = server_factory(metis, 0, cluster=cluster, endpoint=endpoints[0],
                        extra=["--peer-timeout-s", "5"])
    s1 = server_factory(random, 1, cluster=cluster, endpoint=endpoints[1],
                        extra=["--peer-timeout-s", "5"])
    return cluster, s0, s1


def test_mixed_partition_sets_refused_at_connect(server_factory, synth_parts2, random_parts2,
                                                 tmp_path):
    cluster, s0, s1 = _mixed(server_factory, synth_parts2, random_parts2, tmp_path)
    id_a = PartitionSetMeta.load(synth_parts2).set_id
    id_b = PartitionSetMeta.load(random_parts2).set_id
    assert id_a and id_b and id_a != id_b
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "deploy.trainer_cli", "--cluster", str(cluster),
                           "--epochs", "1", "--fanouts", "5,5", "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=clean_env(),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert id_a in proc.stderr and id_b in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not proc.stdout.strip()
    assert time.monotonic() - t0 < 60
    # servers checked each other too: part 0 samples across into part 1 and is refused
    seeds = torch.arange(0, 40, dtype=torch.int64)
    with pytest.raises(RemoteError) as err:
        call(s0.endpoint, SampleRequest(seeds=seeds, fanouts=[10, 10]), MFGReply)
    assert id_a in str(err.value) and id_b in str(err.value), str(err.value)
    # a request naming a set the server does not serve is refused up front
    with pytest.raises(RemoteError, match="wrong_partition_set"):
        call(s1.endpoint, SampleRequest(seeds=seeds + 2000, fanouts=[5], set_id=id_a))
    pong = call(s1.endpoint, Ping(), Pong)  # still serving
    assert pong.set_id == id_b


def test_shutdown_needs_the_token(server_factory, synth_parts1):
    server = server_factory(synth_parts1, 0)
    for token in ("", "f" * 32):
        with pytest.raises(RemoteError, match="forbidden"):
            call(server.endpoint, Shutdown(token=token))
    call(server.endpoint, Ping(), Pong)  # still serving
    call(server.endpoint, Shutdown(token=server.token), Ack)
    assert server.proc.wait(timeout=20) == 0
    server.stop_and_check()


def test_shutdown_refused_without_token_file(synth_parts1, tmp_path):
    ready = tmp_path / "ready"
    ep = f"ipc://{tmp_path}/s.sock"
    proc = subprocess.Popen([sys.executable, "-m", "sampler_server.main", "--parts",
                             str(synth_parts1), "--bind", ep, "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(RemoteError, match="SIGTERM"):
            call(ep, Shutdown(token="0" * 32))
        assert proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err[-2000:]


def test_server_of_multipart_set_needs_cluster(synth_parts2, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sampler_server.main", "--parts",
                           str(synth_parts2), "--part-id", "1", "--bind",
                           f"ipc://{tmp_path}/s.sock"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--cluster" in proc.stderr and "2 parts" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("ring", [True, False], ids=["ring-on", "ring-off"])
def test_reply_above_the_trainers_message_limit_is_a_clear_error(ring, tmp_path):
    """A batch whose reply exceeds the trainer's --max-message-mb: ZeroMQ would drop it and
    the connection with it (the trainer saw a server 'gone'); the server answers too_large
    instead and the run stops naming the options to change. Default path first: same host,
    shared-memory ring on (the features skip the message; the blocks alone exceed 1 MiB)."""
    args = ["--work-dir", str(tmp_path / "w"), "--synthetic-nodes", "20000", "--epochs", "1",
            "--fanouts", "25,25,25", "--batch-size", "1000", "--max-message-mb", "1",
            "--no-progress"] + ([] if ring else ["--no-shm-ring"])
    env = clean_env(TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "deploy.worker_mode", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=150,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the trainer's own error line (servers stopping afterwards may log peers going away)
    errors = [ln for ln in proc.stderr.splitlines() if "trainer-client (rank 0): error:" in ln]
    assert errors and "[too_large]" in errors[0] and "--max-message-mb" in errors[0], \
        proc.stderr[-3000:]
