"""``--batch-locality part``: training batches of one part's seeds (DistDGL's local seeds).

The batching itself (every seed once per epoch, the same batch count on every rank, batches
of one part, reproducible per (seed, epoch)) and, end to end, a worker-mode run on Cora in 2
METIS parts: it trains to the usual accuracy bar and, since a batch's seeds and most of their
neighbours now live on the server that receives it, needs fewer server-to-server requests
than the same run with globally shuffled batches.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from procs import REPO, run_cli

from trainer_client.loader import shard_batches

OFFSETS = torch.tensor([0, 300, 650, 1000])


def _epoch(seeds, world_size, epoch=0, local=True, batch_size=32):
    return [shard_batches(seeds, batch_size, r, world_size, shuffle=True, seed=5, epoch=epoch,
                          part_offsets=OFFSETS if local else None) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 3])
def test_part_batches_cover_every_seed_once(world_size):
    seeds = torch.arange(0, 1000, 2)
    ranks = _epoch(seeds, world_size)
    assert len({len(b) for b in ranks}) == 1  # same number of batches on every rank
    got = torch.cat([torch.cat(b) for b in ranks])
    assert torch.equal(torch.sort(got).values, seeds)
    mixed = 0
    for batches in ranks:
        for b in batches:
            assert b.numel() > 0
            owners = torch.unique(torch.searchsorted(OFFSETS, b, right=True) - 1)
            mixed += owners.numel() > 1
    # only a batch straddling two parts' groups (or a rank's shard boundary) mixes parts
    assert mixed <= (OFFSETS.numel() - 2) + world_size


def test_part_batches_reproducible_and_shuffled():
    seeds = torch.arange(1000)
    a, b, c = _epoch(seeds, 1), _epoch(seeds, 1), _epoch(seeds, 1, epoch=1)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert not all(torch.equal(x, y) for x, y in zip(a[0], c[0]))
    # the batch order is shuffled: consecutive batches do not just walk the parts in order
    owners = [int(torch.searchsorted(OFFSETS, bt[0], right=True)) - 1 for bt in a[0]]
    changes = sum(o1 != o2 for o1, o2 in zip(owners, owners[1:]))
    assert changes > OFFSETS.numel() - 1


def test_global_batching_unchanged():
    """Without part_offsets the batches are exactly the shuffled split of before."""
    seeds = torch.arange(1000)
    g = torch.Generator().manual_seed(5 * 1_000_003 + 0)
    expected = torch.tensor_split(seeds[torch.randperm(1000, generator=g)], 32)
    got = _epoch(seeds, 1, local=False)[0]
    assert len(got) == 32 and all(torch.equal(x, y) for x, y in zip(got, expected))


def _worker(parts, locality: str, tmp_path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts), "--num-trainers",
         "1", "--epochs", "20", "--fanouts", "10,10", "--batch-size", "64", "--no-progress",
         "--batch-locality", locality, "--seed", "3"],
        capture_output=True, text=True, timeout=400, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_worker_mode_part_local_batches(cora_dir, tmp_path):
    parts = tmp_path / "parts"
    run_cli("partition.cli", ["--dataset-dir", cora_dir, "--num-parts", 2, "--out", parts],
            timeout=300)
    local = _worker(parts, "part", tmp_path)
    mixed = _worker(parts, "global", tmp_path)
    assert local["test_acc"] >= 0.75, local
    assert 0 < local["server_to_server_requests"] < mixed["server_to_server_requests"], (
        local["server_to_server_requests"], mixed["server_to_server_requests"])
