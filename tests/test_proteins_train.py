"""Issue 11, multi-label (ogbn-proteins-shaped) datasets, serving and training side: servers
gather 2-D float labels (owned and halo), the wire carries them, the trainer's ROC-AUC is
ogb's, its loss ignores unknown labels, and worker-mode trains on 1, 2 and 4 parts with the
summary keyed by the dataset's metric."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import REPO

from common import codec
from common.messages import MFGReply, NodeDataReply
from common.sampled_mfg import Features, Layer, SampledMFG
from partition.ogbn import load_ogb
from partition.partitioner import partition_graph
from partition.proteins import generate_proteins, write_proteins_raw
from trainer_client.metrics import Task, loss_fn, rocauc

pytestmark = pytest.mark.timeout(240)


def _set(tmp: Path, parts: int, tasks: int, halo: int = 0, nodes: int = 400) -> Path:
    raw = tmp / f"raw-{tasks}"
    if not (raw / "meta.json").is_file():
        write_proteins_raw(generate_proteins(nodes, avg_degree=8, num_tasks=tasks, seed=2),
                           raw)
    out = tmp / f"parts-{parts}-{tasks}-{halo}"
    if (out / "metadata.json").is_file():  # made by an earlier test of this module
        return out
    partition_graph(load_ogb(dataset_dir=str(raw)), parts, out, "random", progress=False,
                    halo_hops=halo, presample_batches=2)
    return out


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("protsets")
    return {"halo2": _set(tmp, 2, 6, halo=1), "root": tmp}


def test_rocauc_is_ogbs_on_random_data():
    from ogb.nodeproppred import Evaluator

    rng = np.random.default_rng(0)
    for tasks in (112, 7):
        y = (rng.random((300, tasks)) < 0.3).astype(np.float32)
        y[rng.random(y.shape) < 0.1] = np.nan  # unknown entries
        y[:, 0] = 0  # a task without positives is skipped, as ogb skips it
        pred = rng.standard_normal((300, tasks)).astype(np.float32) + np.nan_to_num(y)
        ev = Evaluator("ogbn-proteins")
        want = (ev.eval({"y_true": y, "y_pred": pred})["rocauc"] if tasks == 112
                else ev._eval_rocauc(y, pred)["rocauc"])
        assert rocauc(y, pred) == pytest.approx(want, abs=1e-12)
        assert 0.5 < rocauc(y, pred) <= 1.0


def test_loss_ignores_unknown_labels():
    task = Task("binary", 3, "rocauc")
    logits = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.1, -1.0]])
    y = torch.tensor([[1.0, float("nan"), 0.0], [float("nan"), 1.0, 0.0]])
    known = ~torch.isnan(y)
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits[known], y[known])
    assert torch.allclose(loss_fn(task, logits, y), want)
    assert float(loss_fn(task, logits, torch.full_like(y, float("nan")))) == 0.0


def test_store_gathers_2d_labels_owned_and_halo(sets):
    from sampler_server.partition_store import PartitionStore

    parts = sets["halo2"]
    store = PartitionStore(str(parts), 0)
    part = store.part
    owned = torch.arange(store.start, store.start + 5)
    _, lab = store.gather(owned, False, True)
    assert lab.dtype == torch.float32 and lab.shape == (5, 6)
    assert torch.equal(lab, torch.from_numpy(np.array(part.label[:5])))
    halo = torch.from_numpy(np.array(part.halo_nodes[:3]))
    mixed = torch.cat([owned[:2], halo])
    feat, lab = store.gather(mixed, True, True)
    assert lab.shape == (5, 6) and feat.shape == (5, 8)
    assert torch.equal(lab[2:], torch.from_numpy(np.array(part.halo_label[:3])))
    _, none = store.gather(owned, False, False)
    assert none.shape == (0, 6) and none.dtype == torch.float32


def test_2d_float_labels_travel_over_the_wire():
    label = torch.tensor([[0.0, 1.0, float("nan")], [1.0, 0.0, 0.0]])
    layer = Layer.homogeneous(3, 2, torch.tensor([0, 1, 2]), torch.tensor([2, 0]))
    mfg = SampledMFG.homogeneous(torch.tensor([5, 7, 9]), [layer],
                                 Features.frames(torch.ones(3, 4)), label)
    for msg in (MFGReply(mfg=mfg), NodeDataReply(feat=torch.empty(0, 4), label=label)):
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in codec.encode(msg, 1)]
        back, rid = codec.decode(frames)
        assert rid == 1
        got = back.mfg.only.label if isinstance(back, MFGReply) else back.label
        assert got.dtype == torch.float32 and got.shape == (2, 3)
        assert torch.equal(torch.nan_to_num(got, -1.0), torch.nan_to_num(label, -1.0))


def _worker(args: list[str], tmp: Path, timeout: float = 200) -> subprocess.CompletedProcess:
    (tmp / "t").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "deploy.worker_mode", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "TMPDIR": str(tmp / "t")},
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("num_parts,tasks,extra", [
    (1, 112, []), (2, 6, ["--cache-ratio", "0.5"]), (4, 6, ["--feat-transfer", "float16"])])
def test_worker_mode_trains_multilabel(sets, tmp_path, num_parts, tasks, extra):
    """Read in place from the one part's features (worker mode's default there,
    --local-features auto), through the shared-memory ring (the default with more parts),
    the feature cache and fp16 feature transfer: labels are unaffected by how features
    travel."""
    parts = _set(sets["root"], num_parts, tasks)
    proc = _worker(["--parts", str(parts), "--num-trainers", "2", "--epochs", "1",
                    "--fanouts", "5,5", "--batch-size", "64", "--hidden", "16",
                    "--work-dir", str(tmp_path / "w"), "--no-progress", *extra], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["eval_metric"] == "rocauc" and summary["num_tasks"] == tasks
    assert 0.0 <= summary["test_rocauc"] <= 1.0 and 0.0 <= summary["valid_rocauc"] <= 1.0
    assert "test_acc" not in summary and summary["num_parts"] == num_parts
    metrics = [json.loads(ln) for ln in
               Path(summary["files"]["metrics"]).read_text().splitlines()]
    assert "test_rocauc" in metrics[-1] and np.isfinite(metrics[-1]["loss"])
    if num_parts == 1:
        assert summary["local_features"]["used"] and summary["shm_ring"] is None, summary
    else:
        assert summary["shm_ring"]["used"] and not summary["local_features"]["used"]
    if "--cache-ratio" in extra:
        assert summary["cache"]["rows_from_cache"] > 0


def test_full_eval_measures_rocauc_on_a_halo_set(sets, tmp_path):
    """--eval full (layer-wise inference) on a multi-label set with a halo: ROC-AUC, keyed
    as sampled evaluation keys it (tests/test_hetero_inference.py checks its value)."""
    proc = _worker(["--parts", str(sets["halo2"]), "--epochs", "1", "--eval", "full",
                    "--fanouts", "5,5", "--hidden", "16", "--work-dir", str(tmp_path / "w"),
                    "--no-progress"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["eval_metric"] == "rocauc" and "test_acc" not in summary
    assert 0.0 <= summary["test_rocauc"] <= 1.0 and 0.0 <= summary["valid_rocauc"] <= 1.0


def test_resume_keeps_the_rocauc_best(sets, tmp_path):
    """A checkpoint of a multi-label run resumes: best and history keyed by rocauc."""
    parts = _set(sets["root"], 1, 6)
    common = ["--parts", str(parts), "--fanouts", "5,5", "--batch-size", "64", "--hidden",
              "16", "--work-dir", str(tmp_path / "w"), "--run-dir", str(tmp_path / "run"),
              "--checkpoint-every", "1", "--no-progress"]
    first = _worker([*common, "--epochs", "1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _worker([*common, "--epochs", "2", "--resume"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["resumed_from"].endswith("epoch-000001.pt")
    assert summary["epochs_done"] == 2 and 0.0 <= summary["test_rocauc"] <= 1.0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["epoch"] for ln in lines] == [0, 1]


def test_full_graph_inference_is_refused_for_multilabel(sets, tmp_path):
    """worker-mode --infer (mfgserve-infer after training, which writes class predictions):
    refused before any layer runs, naming --eval full (layer-wise ROC-AUC) instead."""
    parts = _set(sets["root"], 1, 6)
    proc = _worker(["--parts", str(parts), "--epochs", "1", "--fanouts", "5,5", "--hidden",
                    "16", "--infer", "--work-dir", str(tmp_path / "w"), "--no-progress"],
                   tmp_path)
    assert proc.returncode != 0
    assert "ROC-AUC" in proc.stderr and "--eval full" in proc.stderr
