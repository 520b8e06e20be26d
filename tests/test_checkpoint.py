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

from common.config import TrainerConfig, WorkerModeConfig
from common.errors import ConfigError
from deploy.worker_mode import with_run_dir
from trainer_client.checkpoint import (
    FORMAT,
    Checkpointer,
    check_compatible,
    list_checkpoints,
    load_bytes,
    result_config,
    save_atomic,
)
from trainer_client.run_dir import RunFiles, resume_location

# Same result-changing options in every run of a test; --epochs and --run-dir vary.
RESULT = ["--checkpoint-every", "1", "--lr-schedule", "step", "--lr-step-epochs", "2",
          "--eval-every", "2", "--seed", "3"]


def _wait_for(path: Path, procs: list, timeout: float) -> None:
    """Until ``path`` exists (fails if a process exits first or the deadline passes)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            assert p.poll() is None, f"exited with {p.returncode} before {path} existed:\n" \
                                     f"{p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{path} not written within {timeout}s"
        time.sleep(0.05)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"parameter {n}: {m}")
    torch.testing.assert_close(b["optimizer"]["state"], a["optimizer"]["state"], rtol=1e-5,
                               atol=1e-6)
    assert b["scheduler"] == a["scheduler"] and b["best"]["epoch"] == a["best"]["epoch"]
    torch.testing.assert_close(b["best_state"], a["best_state"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size,extra", [
    # One rank with a server-held learnable node embedding (its rows and Adam state are part
    # of the checkpoint). Two ranks without one: the servers apply each rank's embedding
    # update as it arrives, so two ranks' updates of one row land in either order.
    (1, ["--node-emb-dim", "4"]), (2, [])], ids=["1rank-emb", "2ranks"])
def test_killed_and_resumed_run_ends_like_an_uninterrupted_one(
        world_size, extra, synth_parts1, server_factory, tmp_path):
    server = server_factory(synth_parts1, 0)
    cluster = cluster_file(tmp_path, {0: [server.endpoint]})
    whole, parts = tmp_path / "whole", tmp_path / "interrupted"
    args = [*RESULT, *extra]
    # The interrupted run asks for far more epochs (--epochs is no result option): it is
    # certainly still training when killed right after its second checkpoint.
    reference = start_trainers(cluster, [*args, "--epochs", "4", "--run-dir", whole],
                               world_size)
    victims = start_trainers(cluster, [*args, "--epochs", "1000", "--run-dir", parts],
                             world_size)
    _wait_for(parts / "checkpoints" / "epoch-000002.pt", victims, 200)
    for victim in victims:
        victim.kill()
    for victim in victims:
        assert victim.wait(30) == -signal.SIGKILL
        victim.communicate()
    finish(reference, 200)
    summary = train(cluster, [*args, "--epochs", "4", "--run-dir", parts, "--resume"],
                    world_size)
    assert summary["resumed_from"].startswith(str(parts / "checkpoints" / "epoch-"))
    assert summary["epochs_done"] == 4 and summary["run_dir"] == str(parts)

    a = torch.load(whole / "checkpoints" / "epoch-000004.pt", weights_only=True)
    b = torch.load(parts / "checkpoints" / "epoch-000004.pt", weights_only=True)
    _assert_same_state(a, b)
    best_a, best_b = (torch.load(d / "best_model.pt", weights_only=True) for d in (whole, parts))
    assert best_b["epoch"] == best_a["epoch"] == a["best"]["epoch"]
    torch.testing.assert_close(best_b["state_dict"], best_a["state_dict"], rtol=1e-5, atol=1e-6)
    # The resumed run's metrics continue the file: each epoch once, losses as uninterrupted.
    ma, mb = metrics(whole), metrics(parts)
    assert [m["epoch"] for m in mb] == [0, 1, 2, 3] == [m["epoch"] for m in ma]
    assert [m["loss"] for m in mb] == pytest.approx([m["loss"] for m in ma], rel=1e-5)
    assert [m["lr"] for m in mb] == pytest.approx([3e-3, 3e-3, 1.5e-3, 1.5e-3])
    assert [p.name for p in list_checkpoints(parts / "checkpoints")] == [
        "epoch-000003.pt", "epoch-000004.pt"]
    if not extra:
        return
    # The embedding rows and their Adam state, read back from the server, match too.
    emb_a, emb_b = a["node_tensors"]["node_emb"], b["node_tensors"]["node_emb"]
    assert emb_a.keys() == emb_b.keys() and len(emb_a) > 1
    torch.testing.assert_close(emb_b, emb_a, rtol=1e-5, atol=1e-6)
    assert summary["node_embedding"]["dim"] == 4
    assert all(n > 0 for n in summary["node_embedding"]["bytes_per_server"].values())


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
        "reused": start_trainers(cluster, ["--epochs", "2", "--run-dir", run]),  # no --resume
    }
    errors = {k: finish(p, 200, codes=2)[0][1] for k, p in refused.items()}
    for err in errors.values():
        assert "Traceback" not in err, err[-3000:]
    assert "--hidden: checkpoint 8, this run 16" in errors["hidden"], errors["hidden"][-3000:]
    assert "partition set (set_id): checkpoint" in errors["set"], errors["set"][-3000:]
    assert "--hidden" not in errors["set"]
    assert "no checkpoint (epoch-*.pt) in" in errors["missing"], errors["missing"][-3000:]
    assert "metrics.jsonl exists: another run used this directory; continue it with " \
           "--resume" in errors["reused"], errors["reused"][-3000:]
    assert len(metrics(run)) == 1, "a refused run must not touch the run directory"


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
                 "this run [3, 3]", "--model: checkpoint 'auto', this run 'gcn'",
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


def _fake_run(root: Path, name: str, checkpoints: bool) -> Path:
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    if checkpoints:
        (run / "checkpoints" / "epoch-000005.pt").write_bytes(b"")
    return run


def test_resume_finds_the_newest_run_with_a_checkpoint(tmp_path):
    """--resume without --run-dir / --checkpoint-dir: the newest run (by name: start time)
    that holds a checkpoint, in ./runs for trainer-client, in <work_dir>/runs for
    worker-mode; an explicit directory is taken as given."""
    runs = tmp_path / "work" / "runs"
    _fake_run(runs, "20260101-000000-aaaaaa", True)
    newest = _fake_run(runs, "20260102-000000-bbbbbb", True)
    _fake_run(runs, "20260103-000000-cccccc", False)  # newer, but nothing to resume
    assert resume_location("", "", runs_root=str(runs)) == newest / "checkpoints"
    assert resume_location("r", "", runs_root=str(runs)) == Path("r") / "checkpoints"
    assert resume_location("r", "ck", runs_root=str(runs)) == Path("ck")
    assert resume_location("", "", runs_root=str(tmp_path / "none")) is None

    def wm(**trainer) -> WorkerModeConfig:
        return WorkerModeConfig(work_dir=str(tmp_path / "work"),
                                trainer=TrainerConfig(**trainer))

    assert with_run_dir(wm(resume=True)).trainer.run_dir == str(newest)
    fresh = with_run_dir(wm()).trainer.run_dir
    assert Path(fresh).parent == runs and Path(fresh).name not in os.listdir(runs)
    assert with_run_dir(wm(run_dir="mine", resume=True)).trainer.run_dir == "mine"
    with pytest.raises(ConfigError, match="--resume: no run under .* has a checkpoint"):
        with_run_dir(WorkerModeConfig(work_dir=str(tmp_path / "empty"),
                                      trainer=TrainerConfig(resume=True)))


def test_resumed_metrics_drop_epochs_after_the_checkpoint_and_torn_lines(tmp_path):
    files = RunFiles(tmp_path / "run")
    files.create()
    for epoch in range(4):
        files.append_metrics({"epoch": epoch, "loss": 1.0 / (epoch + 1)})
    with open(files.metrics, "a") as f:
        f.write('{"epoch": 4, "lo')  # killed in the middle of a line
    files.truncate_metrics(after_epoch=1)
    assert [m["epoch"] for m in metrics(tmp_path / "run")] == [0, 1]
