"""``partition-ogbn --max-memory-gb`` (issue 12): a budget below what the method needs fails up
front (exit 2, the minimum named, nothing written); one that suffices is honoured (peak RSS,
sampled with psutil and the kernel's own peak, below it, and reported); a worker-mode run
trains on a set written by the streaming pipeline. Real CLI processes, real files."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import REPO, run_cli

from partition import memplan
from partition.layout import PartitionSetMeta

pytestmark = pytest.mark.timeout(90)
GIB = 1 << 30


def _cli(args: list, check: bool = True) -> subprocess.CompletedProcess:
    return run_cli("partition.cli", [*args, "--no-progress"], timeout=80, check=check)


def _summary(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw") / "syn"
    _cli(["--dataset", "synthetic", "--raw-format", "binary", "--num-nodes", "20000",
          "--avg-degree", "16", "--feat-dim", "32", "--num-classes", "8", "--raw-out", raw])
    return raw


def test_min_bytes_is_linear_in_nodes_for_streaming_and_in_edges_for_metis():
    n, e, d = 10_000_000, 500_000_000, 100
    for method in ("random", "fennel", "ldg"):
        base = memplan.min_bytes(method, n, e, d, 4, 4)
        # ten times the edges or the feature width: at most a few per cent more (fennel's
        # adjacency bucket is 1/1024 of the edges); n more nodes: tens of bytes per node more
        assert memplan.min_bytes(method, n, 10 * e, d, 4, 4) < 1.1 * base + (64 << 20)
        assert memplan.min_bytes(method, n, e, 10 * d, 4, 4) < base + (64 << 20)
        assert 30 * n < memplan.min_bytes(method, 2 * n, e, d, 4, 4) - base < 100 * n
    metis = memplan.min_bytes("metis", n, e, d, 4, 4)
    assert memplan.min_bytes("metis", n, 2 * e, d, 4, 4) > 1.6 * metis
    # the in-memory path's measured peaks: products (2.45M nodes, 124M directed edges in
    # ogb's inverse pairs, 100-dim) 7.1-7.6 GiB; 1M nodes / 50M directed edges with reverses
    # appended 4.82 GiB: the estimate covers both without being far above
    products = memplan.min_bytes("metis", 2_449_029, 123_718_280, 100, 4, 4, paired=True)
    assert 7.6 * GIB <= products <= 9 * GIB
    assert 4.82 * GIB <= memplan.min_bytes("metis", 10**6, 5 * 10**7, 100, 4, 4) <= 6 * GIB
    # papers100M-class streaming fits an ordinary 64 GB node
    assert memplan.min_bytes("fennel", 111_059_956, 3_231_371_744, 128, 4, 8) < 16 * GIB


def test_check_budget_names_the_minimum_and_the_way_out():
    need = memplan.min_bytes("fennel", 10_000_000, 500_000_000, 100, 4, 4)
    with pytest.raises(memplan.MemoryBudgetError) as e:
        memplan.check_budget("fennel", 10_000_000, 500_000_000, 100, 4, 4, 0.5)
    msg = str(e.value)
    assert "--max-memory-gb 0.5 is below the ~" in msg and "--method fennel" in msg
    assert "10,000,000 nodes" in msg and "raise it to at least" in msg
    at_least = float(msg.split("raise it to at least ")[1].split(",")[0].split(" ")[0])
    assert at_least * GIB >= need
    assert memplan.check_budget("fennel", 10_000_000, 500_000_000, 100, 4, 4,
                                at_least) == int(at_least * GIB)
    with pytest.raises(memplan.MemoryBudgetError, match="use --method fennel"):
        memplan.check_budget("metis", 2_449_029, 123_718_280, 100, 4, 4, 4.0)
    assert memplan.check_budget("metis", 10, 10, 1, 4, 1, None) is None


def test_rss_monitor_sees_an_allocation():
    with memplan.RssMonitor(interval_s=0.01) as mon:
        before = mon.sample()
        # 200 MiB of fresh pages, touched: mapped directly, so that no allocator setting of
        # this process (a test that ran --malloc-retain-mb in it) can hand back pages that
        # are resident already
        block = mmap.mmap(-1, 200 << 20)
        view = np.frombuffer(block, dtype=np.uint8)
        view[:] = 1
        mon.sample()
        del view
        block.close()
    assert mon.peak >= before + (150 << 20) and mon.samples >= 2


def _no_leftovers(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")], \
        list(parent.iterdir())


@pytest.mark.parametrize("method", ["fennel", "random", "metis"])
def test_too_small_budget_fails_up_front_and_writes_nothing(raw_dir, tmp_path, method):
    proc = _cli(["--dataset-dir", raw_dir, "--add-reverse-edges", "--method", method,
                 "--num-parts", "4", "--max-memory-gb", "0.05", "--out", tmp_path / "out"],
                check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert "Traceback" not in err
    assert "--max-memory-gb 0.05 is below the ~" in err and f"--method {method} needs" in err
    assert "20,000 nodes" in err and "raise it to at least" in err and "Nothing was done" in err
    assert "streaming" not in err.split("error:")[0]  # no work started before the check
    _no_leftovers(tmp_path, "out")


def test_too_small_budget_fails_before_generating(tmp_path):
    proc = _cli(["--dataset", "synthetic", "--raw-format", "binary", "--num-nodes", "3000000",
                 "--method", "random", "--max-memory-gb", "0.2", "--raw-out", tmp_path / "raw",
                 "--out", tmp_path / "out"], check=False)
    assert proc.returncode == 2 and "raise it to at least" in proc.stderr, proc.stderr[-2000:]
    _no_leftovers(tmp_path, "raw")
    _no_leftovers(tmp_path, "out")


@pytest.mark.parametrize("args,needle", [
    (["--dataset", "synthetic", "--max-memory-gb", "4"], "needs --raw-format binary"),
    (["--dataset", "rmat", "--max-memory-gb", "4"], "does not apply to --dataset rmat"),
    (["--dataset", "synthetic", "--raw-format", "binary", "--max-memory-gb", "0"], "must be > 0"),
    (["--dataset", "synthetic", "--labeled-frac", "0.5"], "only apply to --raw-format binary"),
    (["--dataset", "synthetic", "--method", "ldg", "--stream-passes", "0"],
     "--stream-passes 0 must be >= 1"),
])
def test_bad_memory_options_are_clear_errors(tmp_path, args, needle):
    proc = _cli([*args, "--out", tmp_path / "o"], check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("method", ["random", "fennel"])
def test_enough_budget_passes_and_reports_peak_below_the_limit(raw_dir, tmp_path, method):
    out = tmp_path / "parts"
    proc = _cli(["--dataset-dir", raw_dir, "--add-reverse-edges", "--method", method,
                 "--num-parts", "3", "--max-memory-gb", "1", "--out", out])
    s = _summary(proc)
    assert s["streamed"] and s["method"] == method and s["max_memory_bytes"] == GIB
    assert 0 < s["peak_rss_sampled_bytes"] < s["max_memory_bytes"]
    assert 0 < s["peak_rss_bytes"] < s["max_memory_bytes"]
    assert "of the 1.00 GiB limit (--max-memory-gb 1" in proc.stderr
    assert "within:" in proc.stderr
    meta = PartitionSetMeta.load(out)
    assert meta.stats["max_memory_bytes"] == GIB and meta.num_nodes == 20000
    assert sum(meta.stats["part_nodes"]) == 20000


@pytest.mark.timeout(120)
def test_worker_mode_trains_on_a_streamed_set(tmp_path):
    """Generated in the binary layout (float16 features, NaN labels), streamed by fennel
    under a budget, trained by worker-mode: exit 0, a summary with accuracy."""
    parts = tmp_path / "parts"
    _cli(["--dataset", "synthetic", "--raw-format", "binary", "--num-nodes", "3000",
          "--avg-degree", "10", "--feat-dim", "16", "--num-classes", "5", "--feat-dtype",
          "float16", "--labeled-frac", "0.5", "--method", "fennel", "--num-parts", "2",
          "--max-memory-gb", "1", "--out", parts])
    (tmp_path / "t").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts), "--num-trainers",
         "1", "--epochs", "2", "--batch-size", "128", "--fanouts", "5,5", "--run-dir",
         str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True, timeout=110,
        cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path / "t")}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["epochs"] == 2 and summary["num_parts"] == 2
    assert summary["test_acc"] > 0.2, summary  # 5 classes: above chance
