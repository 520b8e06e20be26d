"""Checkpoint and resume (issue #13): a run killed after a checkpoint and resumed ends with the
same parameters as an uninterrupted one; a checkpoint of another configuration or partition
set is refused (exit 2, the difference named); loading never unpickles objects.

Real servers and trainer-client processes on a 3,000-node synthetic graph, CPU.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from train_runs import cluster_file, finish, metrics, start_trainers, train

from common.config import TrainerConfig
from common.errors import ConfigError
from trainer_client.checkpoint import (
    FORMAT,
    Checkpointer,
    check_compatible,
    list_checkpoints,
    load_bytes,
    result_config,
    save_atomic,
)

# Same result-changing options in every run of a test; --epochs and --run-dir vary.
RESULT = ["--checkpoint-every", "1", "--lr-schedule", "step", "--lr-step-epochs", "2",
          "--eval-every", "2", "--seed", "3"]


def _wait_for(path: Path, proc, timeout: float) -> None:
    """Until ``path`` exists (fails if ``proc`` exits first or the deadline passes)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"exited with {proc.returncode} before {path} existed:\n" \
                                    f"{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{path} not written within {timeout}s"
        time.sleep(0.05)


@pytest.mark.timeout(400)
def test_killed_and_resumed_run_ends_like_an_uninterrupted_one(synth_parts1, server_factory,
                                                               tmp_path):
    server = server_factory(synth_parts1, 0)
    cluster = cluster_file(tmp_path, {0: [server.endpoint]})
    whole, parts = tmp_path / "whole", tmp_path / "interrupted"
    # The interrupted run asks for far more epochs (--epochs is no result option): it is
    # certainly still training when killed right after its second checkpoint.
    reference = start_trainers(cluster, [*RESULT, "--epochs", "4", "--run-dir", whole])
    victim = start_trainers(cluster, [*RESULT, "--epochs", "1000", "--run-dir", parts])[0]
    _wait_for(parts / "checkpoints" / "epoch-000002.pt", victim, 200)
    victim.kill()
    assert victim.wait(30) == -signal.SIGKILL
    victim.communicate()
    finish(reference, 200)
    summary = train(cluster, [*RESULT, "--epochs", "4", "--run-dir", parts, "--resume"])
    assert summary["resumed_from"].startswith(str(parts / "checkpoints" / "epoch-"))
    assert summary["epochs_done"] == 4 and summary["run_dir"] == str(parts)

    a = torch.load(whole / "checkpoints" / "epoch-000004.pt", weights_only=True)
    b = torch.load(parts / "checkpoints" / "epoch-000004.pt", weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"parameter {n}: {m}")
    torch.testing.assert_close(b["optimizer"]["state"], a["optimizer"]["state"], rtol=1e-5,
                               atol=1e-6)
    assert b["scheduler"] == a["scheduler"] and b["best"]["epoch"] == a["best"]["epoch"]
    # The resumed run's metrics continue the file: each epoch once, losses as uninterrupted.
    ma, mb = metrics(whole), metrics(parts)
    assert [m["epoch"] for m in mb] == [0, 1, 2, 3] == [m["epoch"] for m in ma]
    assert [m["loss"] for m in mb] == pytest.approx([m["loss"] for m in ma], rel=1e-5)
    assert [m["lr"] for m in mb] == pytest.approx([3e-3, 3e-3, 1.5e-3, 1.5e-3])
    assert [p.name for p in list_checkpoints(parts / "checkpoints")] == [
        "epoch-000003.pt", "epoch-000004.pt"]


def _other_set(synth_graph, tmp_path: Path) -> Path:
    """The same graph partitioned again: identical files, another partition set (set_id)."""
    from partition.partitioner import partition_graph

    out = tmp_path / "other-set"
    partition_graph(synth_graph, 1, str(out), method="metis", seed=0, progress=False)
    return out


@pytest.mark.timeout(300)
def test_mismatched_or_missing_checkpoint_is_refused(synth_graph, synth_parts1, server_factory,
                                                     tmp_path):
    server = server_factory(synth_parts1, 0)
    other = server_factory(_other_set(synth_graph, tmp_path), 0)
    cluster = cluster_file(tmp_path, {0: [server.endpoint]})
    cluster_other = cluster_file(tmp_path, {0: [other.endpoint]}, "other.yaml")
    run = tmp_path / "run"
    train(cluster, ["--epochs", "1", "--checkpoint-every", "1", "--run-dir", run])
    assert list_checkpoints(run / "checkpoints")
    refused = {
        "hidden": start_trainers(cluster, ["--epochs", "2", "--run-dir", run, "--resume",
                                           "--hidden", "16"]),
        "set": start_trainers(cluster_other, ["--epochs", "2", "--run-dir", run, "--resume"]),
        "missing": start_trainers(cluster, ["--epochs", "2", "--run-dir", tmp_path / "none",
                                            "--resume"]),
    }
    errors = {k: finish(p, 200, codes=2)[0][1] for k, p in refused.items()}
    for err in errors.values():
        assert "Traceback" not in err, err[-3000:]
    assert "--hidden: checkpoint 8, this run 16" in errors["hidden"], errors["hidden"][-3000:]
    assert "partition set (set_id): checkpoint" in errors["set"], errors["set"][-3000:]
    assert "--hidden" not in errors["set"]
    assert "no checkpoint (epoch-*.pt) in" in errors["missing"], errors["missing"][-3000:]
    assert len(metrics(run)) == 1, "a refused resume must not touch the run directory"


def _expected(cfg: TrainerConfig) -> dict:
    return {"config": result_config(cfg), "set_id": "s1", "dataset": "d", "world_size": 1}


def test_compatibility_ignores_run_only_options_and_names_each_difference():
    cfg = TrainerConfig(cluster="c.yaml", epochs=5)
    ckpt = {**_expected(cfg), "format": FORMAT}
    # Where and how long a run goes does not change its result: accepted.
    check_compatible(ckpt, _expected(TrainerConfig(cluster="x.yaml", epochs=50, run_dir="r",
                                                   max_inflight=9, progress=False)), "c.pt")
    changed = TrainerConfig(cluster="c.yaml", hidden=64, fanouts=[3, 3], model="gcn")
    with pytest.raises(ConfigError) as e:
        check_compatible({**ckpt, "set_id": "s0"}, _expected(changed), "c.pt")
    text = str(e.value)
    for part in ("--hidden: checkpoint 256, this run 64", "--fanouts: checkpoint [10, 10], "
                 "this run [3, 3]", "--model: checkpoint 'sage', this run 'gcn'",
                 "partition set (set_id): checkpoint 's0', this run 's1'"):
        assert part in text, text
    assert "--epochs" not in text
    # The cosine schedule's curve depends on --epochs: then it must match too.
    cos = TrainerConfig(cluster="c.yaml", lr_schedule="cosine", epochs=5)
    with pytest.raises(ConfigError, match="--epochs: checkpoint 5, this run 6"):
        check_compatible({**_expected(cos), "format": FORMAT},
                         _expected(TrainerConfig(cluster="c.yaml", lr_schedule="cosine",
                                                 epochs=6)), "c.pt")


class _Payload:
    """Anything but plain data: weights_only loading must refuse it, never run it."""

    def __reduce__(self):
        return (os.system, ("echo should-not-run",))


def test_loading_refuses_objects_and_other_formats(tmp_path):
    path = save_atomic({"format": FORMAT, "x": _Payload()}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError, match="cannot read checkpoint"):
        load_bytes(path.read_bytes(), str(path))
    other = save_atomic({"format": "something/9"}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="not an mfgserve checkpoint"):
        load_bytes(other.read_bytes(), str(other))
    assert not list(tmp_path.glob(".*tmp")), "temporary files left behind"


def test_checkpointer_keeps_the_newest_two(tmp_path):
    ck = Checkpointer(tmp_path / "ck", every=2, writer=True)
    assert [ck.due(e, final=False) for e in (1, 2, 3, 4)] == [False, True, False, True]
    assert ck.due(3, final=True) and not Checkpointer(tmp_path, 0, True).due(3, final=True)
    for epoch in (2, 4, 6, 7):
        ck.save({"format": FORMAT, "epoch": epoch, "t": torch.ones(2) * epoch}, epoch)
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["epoch-000006.pt",
                                                                    "epoch-000007.pt"]
    assert ck.kept == [str(tmp_path / "ck" / "epoch-000006.pt"),
                       str(tmp_path / "ck" / "epoch-000007.pt")]
    newest = load_bytes((tmp_path / "ck" / "epoch-000007.pt").read_bytes(), "newest")
    assert newest["epoch"] == 7 and torch.equal(newest["t"], torch.full((2,), 7.0))
