"""The task on the ping reply and in the best model (issue 11): a server's PONG names the
partition set's task from its metadata (binary / 112 / rocauc on a proteins-shaped set,
multiclass / 1 / acc on a homogeneous one), the trainer takes its task from it, and
best_model.pt keeps its validation score under the dataset's metric (valid_rocauc), across a
resume too; files and checkpoints that say valid_acc whatever the metric are still read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import REPO
from rpc_helpers import call

from common.errors import ConfigError, MfgServeError
from common.messages import Ping, Pong
from trainer_client.checkpoint import best_score, resumed_best, save_best_model
from trainer_client.metrics import Task, task_of

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def proteins_parts(tmp_path_factory) -> Path:
    """A proteins-shaped set (112 binary tasks, like ogbn-proteins), one part."""
    from partition.ogbn import load_ogb
    from partition.partitioner import partition_graph
    from partition.proteins import generate_proteins, write_proteins_raw

    tmp = tmp_path_factory.mktemp("task")
    raw = write_proteins_raw(generate_proteins(400, avg_degree=8, num_tasks=112, seed=2),
                             tmp / "raw")
    out = tmp / "parts"
    partition_graph(load_ogb(dataset_dir=str(raw)), 1, out, "random", progress=False,
                    presample_batches=2)
    return out


def _ping(server) -> Pong:
    return call(server.endpoint, Ping(), Pong, timeout_s=30)


def test_ping_names_the_binary_task(server_factory, proteins_parts):
    pong = _ping(server_factory(proteins_parts, 0))
    assert (pong.task_type, pong.num_tasks, pong.eval_metric) == ("binary", 112, "rocauc")
    assert task_of(pong) == Task("binary", 112, "rocauc")  # no request beyond the ping


def test_ping_names_the_multiclass_task(server_factory, synth_parts1):
    pong = _ping(server_factory(synth_parts1, 0))
    assert (pong.task_type, pong.num_tasks, pong.eval_metric) == ("multiclass", 1, "acc")
    assert task_of(pong) == Task()


def _pong(**task) -> Pong:
    return Pong(part_id=0, num_parts=1, num_nodes=10, feat_dim=4, num_classes=2,
                node_offsets=[0, 10], feat_dtype="float32", dataset="d", pid=1,
                server_id="s", set_id="0123456789abcdef", **task)


@pytest.mark.parametrize("task", [
    {},  # not said (the defaults)
    {"task_type": "regression", "num_tasks": 1, "eval_metric": "mae"},
    {"task_type": "binary", "num_tasks": 0, "eval_metric": "rocauc"},
    {"task_type": "binary", "num_tasks": 3, "eval_metric": "acc"},
    {"task_type": "multiclass", "num_tasks": 2, "eval_metric": "acc"},
])
def test_a_ping_without_a_known_task_is_refused(task):
    with pytest.raises(MfgServeError, match="this trainer knows"):
        task_of(_pong(**task))


def test_task_fields_survive_the_codec():
    from common import codec

    pong = _pong(task_type="binary", num_tasks=112, eval_metric="rocauc")
    frames = [bytes(f) for f in codec.encode(pong, 3)]
    back, rid = codec.decode(frames)
    assert rid == 3 and back == pong
    default = codec.decode([bytes(f) for f in codec.encode(_pong(), 4)])[0]
    assert (default.task_type, default.num_tasks, default.eval_metric) == ("", 0, "")


# --------------------------------------------------------------------------- best_model.pt
def test_best_model_keeps_the_metric_name(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = save_best_model(tmp_path / "b.pt", model, {"name": "x"}, 4, 0.81, "id", "d",
                           metric="rocauc")
    saved = torch.load(path, weights_only=True)
    assert saved["valid_rocauc"] == pytest.approx(0.81) and saved["eval_metric"] == "rocauc"
    assert "valid_acc" not in saved and saved["epoch"] == 4
    assert best_score(saved) == ("rocauc", pytest.approx(0.81))
    acc = torch.load(save_best_model(tmp_path / "a.pt", model, {}, 1, 0.5, "id", "d"),
                     weights_only=True)
    assert acc["valid_acc"] == 0.5 and acc["eval_metric"] == "acc"
    # a file written before eval_metric existed: valid_acc only
    old = {k: v for k, v in saved.items() if k not in ("valid_rocauc", "eval_metric")}
    assert best_score({**old, "valid_acc": 0.7}) == ("acc", 0.7)
    with pytest.raises(ConfigError, match="damaged"):
        best_score(old)


def test_resumed_best_reads_old_checkpoints():
    new = {"valid_rocauc": 0.8, "test_rocauc": 0.7, "epoch": 3}
    assert resumed_best(new, "rocauc") == new
    old = {"valid_acc": 0.8, "test_acc": 0.7, "epoch": 3}  # the metric's values under _acc
    assert resumed_best(old, "rocauc") == new
    assert resumed_best(old, "acc") == old
    with pytest.raises(ConfigError, match="valid_rocauc"):
        resumed_best({"epoch": 1}, "rocauc")


def _worker(args: list, tmp: Path) -> dict:
    (tmp / "t").mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "deploy.worker_mode", *map(str, args)],
                          capture_output=True, text=True, timeout=200, cwd=REPO,
                          env={**os.environ, "TMPDIR": str(tmp / "t")},
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_resume_keeps_the_rocauc_best_model(proteins_parts, tmp_path):
    """Two epochs, checkpointed; resumed to three: best_model.pt holds the best valid_rocauc
    of all three epochs (and its epoch), keyed by rocauc, as the summary reports it."""
    run = tmp_path / "run"
    common = ["--parts", proteins_parts, "--fanouts", "5,5", "--batch-size", 64, "--hidden",
              16, "--lr", 0.02, "--work-dir", tmp_path / "w", "--run-dir", run,
              "--checkpoint-every", 1, "--no-progress"]
    first = _worker([*common, "--epochs", 2], tmp_path)
    assert first["eval_metric"] == "rocauc"
    second = _worker([*common, "--epochs", 3, "--resume"], tmp_path)
    assert second["resumed_from"].endswith("epoch-000002.pt")
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1, 2]
    valid = [r["valid_rocauc"] for r in records]
    best_epoch = max(range(3), key=lambda e: (valid[e], -e))  # the first of the best
    saved = torch.load(run / "best_model.pt", weights_only=True)
    assert saved["eval_metric"] == "rocauc" and "valid_acc" not in saved
    assert saved["epoch"] == second["best_epoch"] == best_epoch
    assert saved["valid_rocauc"] == pytest.approx(valid[best_epoch], abs=1e-9)
    assert second["valid_rocauc"] == pytest.approx(valid[best_epoch], abs=1e-4)
    ckpt = torch.load(run / "checkpoints" / "epoch-000003.pt", weights_only=True)
    assert ckpt["best"]["epoch"] == best_epoch and "valid_rocauc" in ckpt["best"]

