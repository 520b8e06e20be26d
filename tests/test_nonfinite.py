"""Non-finite numbers never pass silently (issue #9).

* Features with NaN: training stops at the first batch whose loss is not finite, on every rank
  (no rank left waiting in a collective), naming the epoch and batch, whether the loss is
  read before the step or one fetch later with the step skipped on a device flag; worker-mode exits 1
  (a child failed), trainer-client ranks exit 2 (an mfgserve error), no traceback.
* Every JSON line mfgserve prints is strict JSON: non-finite floats become ``null``.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import REPO, clean_env, communicate_all, free_ports

from common.cluster import ClusterSpec
from common.jsonout import dumps_strict, finite_or_none


def test_dumps_strict_writes_null_for_non_finite_floats():
    obj = {"loss": math.nan, "acc": 0.5, "hist": [1.0, math.inf, -math.inf, 2],
           "nested": {"t": (math.nan, "x"), "ok": None, "flag": True}, "n": 3}
    text = dumps_strict(obj)
    assert json.loads(text) == {"loss": None, "acc": 0.5, "hist": [1.0, None, None, 2],
                                "nested": {"t": [None, "x"], "ok": None, "flag": True}, "n": 3}
    assert "NaN" not in text and "Infinity" not in text
    assert dumps_strict({"a": 1}, separators=(",", ":")) == '{"a":1}'
    assert finite_or_none(np.float64("nan")) is None  # numpy floats are floats too
    with pytest.raises(TypeError):
        dumps_strict({"x": object()})  # anything else that is not JSON still fails


def _nan_parts(src: Path, dst: Path) -> Path:
    """A copy of the partition set ``src`` whose every third feature row is NaN (same
    dtype and shape: the files stay valid, only the numbers are bad)."""
    shutil.copytree(src, dst)
    for feat_file in dst.glob("part-*/feat.npy"):
        feat = np.load(feat_file, mmap_mode="r+")
        feat[::3] = np.nan
        feat.flush()
        del feat
    return dst


def _assert_stopped_on_nan(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-4000:]
    assert "not finite" in stderr and "epoch 0, batch 0" in stderr, stderr[-4000:]
    assert "--lr" in stderr and "feat.npy" in stderr, stderr[-4000:]


@pytest.mark.timeout(240)
def test_worker_mode_stops_on_nan_features(synth_parts1, tmp_path):
    parts = _nan_parts(synth_parts1, tmp_path / "nan-parts")
    run_tmp = tmp_path / "t"
    run_tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts), "--num-trainers",
         "2", "--epochs", "3", "--fanouts", "5,5", "--batch-size", "64", "--hidden", "16",
         "--no-progress"],
        capture_output=True, text=True, timeout=200, cwd=REPO, stdin=subprocess.DEVNULL,
        env={**clean_env(), "TMPDIR": str(run_tmp)})
    assert proc.returncode == 1, proc.stderr[-4000:]
    _assert_stopped_on_nan(proc.stderr)
    assert "trainer rank" in proc.stderr and "exited with code 2" in proc.stderr
    assert not proc.stdout.strip(), f"no summary may be printed: {proc.stdout[-2000:]}"
    assert not list(run_tmp.glob("mfgserve-*")), "run directory was not removed"


@pytest.mark.timeout(240)
def test_every_trainer_client_rank_stops_on_nan_features(synth_parts1, server_factory,
                                                         tmp_path):
    """server-client mode, two ranks launched the torchrun way: both stop at the same batch
    with exit code 2; neither waits in a collective for the other."""
    parts = _nan_parts(synth_parts1, tmp_path / "nan-parts")
    server = server_factory(parts, 0)
    cluster = tmp_path / "cluster.yaml"
    ClusterSpec({0: [server.endpoint]}).write(cluster)
    port = free_ports(1)[0]
    procs = []
    for rank in range(2):
        env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "deploy.trainer_cli", "--cluster", str(cluster), "--epochs",
             "3", "--fanouts", "5,5", "--batch-size", "64", "--hidden", "16", "--no-progress",
             "--num-threads", "1"], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = communicate_all(procs, timeout=180)
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 2, f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}"
        assert f"trainer-client (rank {rank}): error:" in err, err[-3000:]
        _assert_stopped_on_nan(err)
        assert not out.strip(), f"rank {rank} printed a summary: {out[-2000:]}"


ONE_BAD_RANK = r"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_client.models import build_optimizer, guarded_step
from trainer_client.train import DDPSetup, NonFiniteLossError, PendingStep, check_finite, settle

rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=timedelta(seconds=60))
torch.manual_seed(0)
net = DDP(torch.nn.Linear(4, 3))
opt = build_optimizer(net.parameters(), 0.01, 0.0)
ddp = DDPSetup(rank=rank, world_size=2)
pending = None
try:
    for batch in range(5):
        x = torch.randn(8, 4)  # the next batch is fetched, then the last step is read
        if pending is not None:
            settle(pending, ddp, epoch=0, num_batches=5)
        if rank == 0 and batch == 2:
            x[3, 1] = float("nan")  # only rank 0 sees a bad input, only at batch 2
        loss = torch.nn.functional.cross_entropy(net(x), torch.zeros(8, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        if mode == "deferred":  # the trainer's step with the fused Adam (train._step)
            pending = PendingStep(loss.detach(), guarded_step(opt, net.parameters(), loss),
                                  batch)
        else:  # with --grad-clip or a node embedding
            check_finite(float(loss), net, ddp, epoch=0, batch=batch, num_batches=5)
            opt.step()
    if pending is not None:
        settle(pending, ddp, epoch=0, num_batches=5)
    code = 0
except NonFiniteLossError as e:
    print(e, flush=True)
    code = 3
weights = torch.cat([q.detach().flatten() for q in net.parameters()])
print("finite weights" if bool(torch.isfinite(weights).all()) else "NaN weights", flush=True)
dist.destroy_process_group()
os._exit(code)  # as trainer-client does: gloo can abort a normal interpreter exit
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["deferred", "checked"])
def test_one_rank_with_a_nan_loss_stops_every_rank_at_the_same_batch(tmp_path, mode):
    """Only rank 0's loss is NaN; rank 1's own loss is finite, yet it stops at the same batch
    (the all-reduced gradients carry the NaN) instead of waiting for rank 0 in a collective.
    Both ways the trainer steps: the loss read one fetch late with the step skipped on a
    device flag (the default), and read before the step (``--grad-clip``). Neither lets the
    NaN into the weights."""
    script = tmp_path / "one_bad_rank.py"
    script.write_text(ONE_BAD_RANK)
    port = str(free_ports(1)[0])
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, mode], cwd=REPO,
                              env=clean_env(PYTHONPATH=str(REPO)), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = communicate_all(procs, timeout=100)
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 3, f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}"
        assert "epoch 0, batch 2 of 5" in out, out
        assert "finite weights" in out, out
    assert "training loss is not finite (nan)" in outs[0][0], outs[0][0]
    assert "not finite on another rank" in outs[1][0], outs[1][0]
