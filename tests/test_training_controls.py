"""Training controls and the run directory (issue #13): early stopping at the same epoch on
every rank, the learning-rate schedule recorded in metrics.jsonl, gradient clipping, and the
files a run leaves (config.json, metrics.jsonl, summary.json, best_model.pt).

The end-to-end cases are real processes (servers, trainer-client ranks, worker-mode) on a
3,000-node synthetic graph, CPU.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from procs import REPO, clean_env
from train_runs import BASE, cluster_file, finish, metrics, start_trainers

from common.config import TrainerConfig, from_argv
from common.errors import ConfigError
from trainer_client.controls import (
    EarlyStopping,
    clip_gradients,
    make_scheduler,
    scheduled_lr,
)
from trainer_client.main import build_parser
from trainer_client.models import build_model


@pytest.mark.parametrize("schedule", ["none", "step", "cosine"])
def test_scheduler_follows_the_documented_curve(schedule):
    cfg = TrainerConfig(cluster="c", lr=0.1, epochs=7, lr_schedule=schedule, lr_step_epochs=3,
                        lr_gamma=0.2)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    sched = make_scheduler(opt, cfg)
    assert (sched is None) == (schedule == "none")
    for epoch in range(cfg.epochs):
        assert opt.param_groups[0]["lr"] == pytest.approx(scheduled_lr(cfg, epoch), abs=1e-12)
        opt.step()
        if sched is not None:
            sched.step()
    assert scheduled_lr(cfg, 6) == pytest.approx({"none": 0.1, "step": 0.1 * 0.2**2,
                                                  "cosine": 0.05 * (1 + math.cos(math.pi * 6 / 7))
                                                  }[schedule])


def test_clip_gradients_bounds_the_global_norm():
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    net(torch.randn(5, 6)).pow(2).sum().mul(100).backward()
    before = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    assert before > 1.0
    assert clip_gradients(net, 1.0) == pytest.approx(before, rel=1e-5)
    after = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    assert after == pytest.approx(1.0, rel=1e-4)
    assert clip_gradients(net, 10.0) == pytest.approx(after, rel=1e-5)  # below: unchanged
    assert torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item() == \
        pytest.approx(after, rel=1e-6)


def test_early_stopping_counts_evaluations_without_improvement():
    stop = EarlyStopping(patience=2)
    assert [stop.update(i) for i in (True, False, True, False, False)] == [
        False, False, False, False, True]
    assert stop.state() == {"bad_evals": 2, "stopped": True}
    never = EarlyStopping(patience=0)
    assert not any(never.update(False) for _ in range(50))


@pytest.mark.parametrize("argv,message", [
    (["--patience", "-1"], "--patience must be >= 0 (0: off), got -1"),
    (["--lr-gamma", "1.5"], "--lr-gamma must be in (0, 1], got 1.5"),
    (["--grad-clip", "-0.1"], "--grad-clip must be a finite number >= 0 (0: off), got -0.1"),
    (["--checkpoint-every", "-2"], "--checkpoint-every must be >= 0 (0: off), got -2"),
    (["--lr-step-epochs", "0"], "--lr-step-epochs must be >= 1, got 0"),
    (["--gat-heads", "0"], "--gat-heads must be >= 1, got 0"),
    (["--profile-steps", "-3"], "--profile-steps must be >= 0 (0: off), got -3"),
])
def test_bad_control_values_are_named(argv, message):
    with pytest.raises(ConfigError) as e:
        from_argv(TrainerConfig, ["--cluster", "c.yaml", *argv])
    assert message in str(e.value)


def test_unknown_choices_name_the_option_and_the_accepted_values(capsys):
    for option, bad in (("--lr-schedule", "linear"), ("--model", "gin"), ("--eval", "exact")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["--cluster", "c", option, bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {option}: invalid choice: '{bad}'" in err, err
    # The same values from a YAML file (no argparse) fail in validate(), named alike.
    with pytest.raises(ConfigError, match="--lr-schedule must be one of none, step, cosine"):
        TrainerConfig(cluster="c", lr_schedule="linear").validate()
    help_text = build_parser().format_help()
    for option in ("--patience", "--lr-schedule", "--lr-step-epochs", "--lr-gamma",
                   "--grad-clip", "--model", "--gat-heads", "--eval", "--checkpoint-dir",
                   "--checkpoint-every", "--resume", "--run-dir", "--profile-steps"):
        assert option in help_text


@pytest.mark.timeout(300)
def test_patience_stops_every_rank_at_the_same_epoch(synth_parts1, server_factory, tmp_path):
    """lr 0 and full-graph evaluation (--eval full: layer-wise inference, no sampling): the
    validation accuracy never changes after the first evaluation, so patience 2 stops after
    epoch 2 of 8, on both ranks."""
    server = server_factory(synth_parts1, 0)
    cluster = cluster_file(tmp_path, {0: [server.endpoint]})
    run = tmp_path / "run"
    outs = finish(start_trainers(cluster, ["--epochs", "8", "--lr", "0", "--patience", "2",
                                           "--eval", "full", "--checkpoint-every",
                                           "5", "--run-dir", run], world_size=2), 240)
    for rank, (_, err) in enumerate(outs):
        assert f"rank {rank}: early stopping after epoch 2" in err, err[-3000:]
    summary = json.loads(outs[0][0].strip().splitlines()[-1])
    assert summary["stopped_early"] and summary["epochs_done"] == 3, summary
    records = metrics(run)
    assert [m["epoch"] for m in records] == [0, 1, 2]
    assert all(m["eval"] == "full" and 0 < m["valid_acc"] <= 1 for m in records)
    assert len({m["valid_acc"] for m in records}) == 1
    # The early-stopped epoch is checkpointed (not only every 5th), with the stop recorded.
    ckpt = torch.load(run / "checkpoints" / "epoch-000003.pt", weights_only=True)
    assert ckpt["early_stop"] == {"bad_evals": 2, "stopped": True}
    assert summary["files"]["checkpoints"] == [str(run / "checkpoints" / "epoch-000003.pt")]


@pytest.mark.timeout(300)
def test_worker_mode_run_directory_schedule_and_clipping(synth_parts1, tmp_path):
    """worker-mode names its run directory under --work-dir in the final JSON line; the run
    leaves parseable config.json / metrics.jsonl / summary.json and a best_model.pt that
    loads with weights_only=True into the model its spec describes."""
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.worker_mode", "--parts", str(synth_parts1),
         "--work-dir", str(work), "--epochs", "3", *BASE, "--lr-schedule", "cosine",
         "--grad-clip", "0.001", "--checkpoint-every", "0"],
        capture_output=True, text=True, timeout=240, cwd=REPO, stdin=subprocess.DEVNULL,
        env={**clean_env(), "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    run = work / "runs" / summary["run_dir"].rsplit("/", 1)[-1]
    assert summary["run_dir"] == str(run) and run.is_dir()
    assert json.loads((run / "summary.json").read_text()) == summary
    config = json.loads((run / "config.json").read_text())
    assert config["trainer"]["lr_schedule"] == "cosine" and config["world_size"] == 1
    assert config["set_id"] and config["model_spec"]["name"] == "sage"

    records = metrics(run)
    cfg = TrainerConfig(cluster="c", epochs=3, lr_schedule="cosine")
    assert [r["lr"] for r in records] == pytest.approx([scheduled_lr(cfg, e) for e in range(3)])
    for r in records:  # a norm far above 0.001: every step was clipped, the norm recorded
        assert r["eval"] == "sampled" and "valid_acc" in r
        assert r["clipped_steps"] >= 1 and r["grad_norm_max"] > 0.001, r
        assert r["seeds_per_s"] > 0 and r["bytes_received"] > 0 and r["stages_s"]
    assert summary["files"]["checkpoints"] == [] and not (run / "checkpoints").exists()

    best = torch.load(run / "best_model.pt", weights_only=True)
    assert best["format"] == "mfgserve-model/1" and best["epoch"] == summary["best_epoch"]
    assert best["valid_acc"] == pytest.approx(summary["valid_acc"], abs=1e-4)
    build_model(best["model_spec"]).load_state_dict(best["state_dict"])


@pytest.mark.timeout(300)
def test_reading_the_loss_one_batch_late_trains_exactly_as_reading_it_at_once(
        synth_parts1, server_factory, tmp_path):
    """The trainer's default step reads each loss after fetching the next batch, the finite
    check riding on the device (``train.defers_loss_read``); ``--grad-clip`` reads it before
    the step. With a clip bound no gradient reaches (1e9: the gradients are multiplied by
    exactly 1), both runs are the same training: the same losses, every epoch's loss the mean
    of all its batches' (the last one included), and the same final parameters."""
    server = server_factory(synth_parts1, 0)
    cluster = cluster_file(tmp_path, {0: [server.endpoint]})
    args = ["--epochs", "2", "--seed", "5", "--checkpoint-every", "2"]
    late, checked = tmp_path / "late", tmp_path / "checked"
    procs = [*start_trainers(cluster, [*args, "--run-dir", late]),
             *start_trainers(cluster, [*args, "--grad-clip", "1e9", "--run-dir", checked])]
    finish(procs, 240)
    ml, mc = metrics(late), metrics(checked)
    assert [m["loss"] for m in ml] == [m["loss"] for m in mc]
    assert "clipped_steps" not in ml[0] and mc[0]["clipped_steps"] == 0
    for m in ml + mc:  # the time reading the losses is a part of the step's time (stages
        st = m["stages_s"]  # are rounded to 0.1 ms: a few CPU reads may round to 0)
        assert 0 <= st["loss_read_s"] <= st["forward_backward_s"], st
    a, b = (torch.load(d / "checkpoints" / "epoch-000002.pt", weights_only=True)
            for d in (late, checked))
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


@pytest.mark.timeout(300)
def test_profile_steps_writes_the_profile_of_that_many_steps(synth_parts1, server_factory,
                                                            tmp_path):
    """--profile-steps 3: rank 0 writes profile.txt (torch.profiler's operator table of 3
    steps after 5 of warm-up) into the run directory and names it in the summary; training
    is otherwise the run it would be. Without the option there is no file and no entry."""
    server = server_factory(synth_parts1, 0)
    cluster = cluster_file(tmp_path, {0: [server.endpoint]})
    runs = {n: tmp_path / n for n in ("profiled", "plain")}
    procs = [*start_trainers(cluster, ["--epochs", "1", "--profile-steps", "3", "--run-dir",
                                       runs["profiled"]]),
             *start_trainers(cluster, ["--epochs", "1", "--run-dir", runs["plain"]])]
    outs = finish(procs, 240)
    profiled, plain = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    path = runs["profiled"] / "profile.txt"
    assert profiled["files"]["profile"] == str(path)
    text = path.read_text()
    assert text.startswith("# torch.profiler: 3 training steps from step 5 of the first epoch, "
                           "device cpu"), text[:300]
    assert "_LinearSum" in text, text[:3000]  # SAGEConv's products, forward and backward
    # their kernels: torch's mm, or oneDNN's where --cpu-gemm took it (auto: an AMD CPU with
    # AVX-512), the weights' gradients by its inner-product backward
    if profiled["cpu_gemm"]["library"] == "onednn":
        assert "mkldnn::_linear_pointwise" in text, text[:3000]
        assert "aten::mkldnn_linear_backward_weights" in text, text[:3000]
    else:
        assert "aten::mm" in text, text[:3000]
    assert "profile" not in plain["files"] and not (runs["plain"] / "profile.txt").exists()
    assert metrics(runs["profiled"])[0]["loss"] == metrics(runs["plain"])[0]["loss"]
    # no result option: a checkpoint resumes with or without it
    from trainer_client.checkpoint import result_config
    assert (result_config(TrainerConfig(cluster="c", profile_steps=3))
            == result_config(TrainerConfig(cluster="c")))
