"""A split that ROC-AUC cannot score (no task with both labels) fails every rank of a DDP job,
not rank 0 alone while the others wait in the collective: rank 0 shares a NaN and its message
(trainer_client.metrics.rank0_rocauc / check_shared_score), two real gloo processes."""

from __future__ import annotations

import multiprocessing as mp
import queue

import numpy as np
import pytest
import torch
import torch.distributed as dist

from common.errors import MfgServeError
from trainer_client.metrics import check_shared_score, rank0_rocauc

pytestmark = pytest.mark.timeout(120)


def _rank(rank: int, init: str, labels: np.ndarray, out) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        pred = np.random.default_rng(rank).random(labels.shape, dtype=np.float32)
        score, error = rank0_rocauc(labels, pred, rank)
        t = torch.tensor([score], dtype=torch.float64)
        dist.all_reduce(t)
        try:
            out.put((rank, "ok", check_shared_score(float(t[0]), error, "valid ROC-AUC")))
        except MfgServeError as e:
            out.put((rank, "error", str(e)))
    finally:
        dist.destroy_process_group()


def _run(tmp_path, labels: np.ndarray) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path}/pg"
    procs = [ctx.Process(target=_rank, args=(r, init, labels, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, kind, value = out.get(timeout=60)
            results[rank] = (kind, value)
    except queue.Empty:
        pytest.fail(f"a rank did not finish: {results}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return results


def test_an_unscorable_split_fails_every_rank(tmp_path):
    labels = np.zeros((50, 3), dtype=np.float32)  # no positive label in any task
    results = _run(tmp_path, labels)
    assert results[0][0] == "error" and "positive or a negative label" in results[0][1]
    assert results[1][0] == "error" and "rank 0 could not compute" in results[1][1]


def test_a_scorable_split_gives_every_rank_the_score(tmp_path):
    labels = (np.random.default_rng(0).random((50, 3)) > 0.5).astype(np.float32)
    results = _run(tmp_path, labels)
    assert results[0][0] == results[1][0] == "ok"
    assert results[0][1] == results[1][1] and 0.0 <= results[0][1] <= 1.0
