"""Shared fixtures: small real partition sets, and real server processes on real sockets."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATASETS = REPO.parent / "shared" / "datasets"
sys.path.insert(0, str(REPO / "tests"))

from procs import ServerProcess, stop_all  # noqa: E402


def shared_dataset(name: str) -> Path:
    path = SHARED_DATASETS / name
    if not (path / "meta.json").is_file():
        pytest.skip(f"{path} is missing: the real datasets live in ../shared/datasets beside "
                    "the repository checkout")
    return path


@pytest.fixture(scope="session")
def cora_dir(tmp_path_factory) -> Path:
    """A writable copy of ../shared/datasets/cora (ogb writes processed/ next to raw/)."""
    dst = tmp_path_factory.mktemp("datasets") / "cora"
    shutil.copytree(shared_dataset("cora"), dst)
    return dst


@pytest.fixture(scope="session")
def citeseer_dir(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("datasets") / "citeseer"
    shutil.copytree(shared_dataset("citeseer"), dst)
    return dst


@pytest.fixture(scope="session")
def synth_graph():
    """A small synthetic graph (GraphData) with power-law degrees."""
    from partition.synthetic import generate

    return generate(3000, avg_degree=12, feat_dim=16, num_classes=5, seed=1, progress=False)


def _parts(tmp_path_factory, graph, num_parts: int, halo_hops: int = 0) -> Path:
    from partition.partitioner import partition_graph

    out = tmp_path_factory.mktemp(f"parts{num_parts}h{halo_hops}")
    partition_graph(graph, num_parts, str(out), method="metis", seed=0, progress=False,
                    halo_hops=halo_hops)
    return out


@pytest.fixture(scope="session")
def synth_parts1(tmp_path_factory, synth_graph) -> Path:
    return _parts(tmp_path_factory, synth_graph, 1)


@pytest.fixture(scope="session")
def synth_parts2(tmp_path_factory, synth_graph) -> Path:
    return _parts(tmp_path_factory, synth_graph, 2)


@pytest.fixture(scope="session")
def synth_parts2_halo(tmp_path_factory, synth_graph) -> Path:
    """Two parts, each with a 1-hop halo."""
    return _parts(tmp_path_factory, synth_graph, 2, halo_hops=1)


@pytest.fixture(scope="session")
def synth_parts4(tmp_path_factory, synth_graph) -> Path:
    return _parts(tmp_path_factory, synth_graph, 4)


@pytest.fixture
def server_factory(tmp_path):
    """Start real ``sampler-server`` processes; each is stopped and its exit code checked."""
    started: list[ServerProcess] = []

    def start(parts: Path, part_id: int = 0, cluster: Path | None = None,
              endpoint: str | None = None, extra: list[str] | None = None,
              prefix: list[str] | None = None) -> ServerProcess:
        ep = endpoint or f"ipc://{tmp_path}/s{part_id}-{len(started)}.sock"
        proc = ServerProcess(parts, part_id, ep, cluster, tmp_path, extra or [], prefix)
        started.append(proc)
        proc.wait_ready()
        return proc

    yield start
    stop_all(started)  # every server, then the first failure


@pytest.fixture
def pool2(server_factory, synth_parts2, tmp_path):
    """A trainer's ServerPool over real servers of the 2-part synthetic set (one per part)."""
    from tests.test_mfg_oracle import start_cluster
    from trainer_client.server_pool import ServerPool

    cluster = start_cluster(server_factory, synth_parts2, tmp_path, 2)
    pool = ServerPool(cluster, timeout_s=30, max_message_bytes=64 << 20)
    yield pool
    pool.close()
