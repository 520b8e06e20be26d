"""``python -m benchmarks.scalerun`` and ``python -m benchmarks.partcompare`` end to end on
tiny graphs (real partition-ogbn and worker-mode subprocesses): they exit 0 and print the
documented JSON as the last stdout line; a failing or overrunning step lands in ``errors``
with exit code 1, its processes stopped. The partition-set view they train on keeps the
same seeds whatever the partitioning. Timings are never asserted, only that they were
measured."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from procs import REPO

# a tiny products-like graph: generated, partitioned and trained in seconds
TINY = ["--avg-degree", "10", "--feat-dim", "8", "--num-classes", "5", "--train-frac", "0.2",
        "--valid-frac", "0.1", "--fanouts", "5,5", "--batch-size", "256", "--eval-seeds",
        "300", "--poll-s", "0.5", "--step-timeout-s", "120", "--train-timeout-s", "120"]


def _run(module: str, args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess,
                                                                 dict]:
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"no stdout (exit {proc.returncode}); stderr ends:\n{proc.stderr[-4000:]}"
    return proc, json.loads(lines[-1])


def _check_train(t: dict, parts: int) -> None:
    assert t["exit_code"] == 0
    for key in ("startup_s", "seeds_per_s", "train_s", "bytes_received", "bytes_per_batch",
                "server_rss_max_bytes", "server_pss_max_bytes", "server_rss_sum_bytes",
                "server_pss_sum_bytes", "trainer_peak_rss_bytes", "parts_bytes"):
        assert t[key] > 0, key
    assert t["batches"] >= 1 and t["batches_per_s"] > 0
    assert len(t["epochs"]) == t["epochs_done"] and t["train_bytes_received"] > 0
    assert t["bytes_per_batch_source"].startswith("metrics.jsonl")
    assert t["server_cpu_ms_per_batch"] > 0 and t["eval_batches"] >= 2
    assert 0 <= t["test_acc"] <= 1
    assert t["server_to_server_bytes"] >= 0 and t["server_to_server_requests"] >= 0
    assert {"server_sample_s", "server_gather_s", "forward_backward_s"} <= t["stages_s"].keys()
    assert sorted(s["part"] for s in t["servers"]) == list(range(parts))
    for s in t["servers"]:
        assert s["peak_rss_bytes"] >= s["peak_pss_bytes"] > 0 and s["cpu_s"] > 0
    assert t["server_rss_max_bytes"] <= t["server_rss_sum_bytes"]


def _no_process_using(path: Path) -> None:
    """No process left behind whose command line names ``path``."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(path) in a for a in (p.info["cmdline"] or [])):
            left.append((p.info["pid"], p.info["cmdline"]))
    assert not left, left


@pytest.mark.timeout(240)
def test_scalerun_small(tmp_path):
    work = tmp_path / "w"
    proc, s = _run("benchmarks.scalerun", [
        "--scales", "0.5,1", "--base-nodes", "6000", "--parts", "2", "--method", "fennel",
        "--max-memory-gb", "2", "--train-batches", "3", "--work-dir", str(work), *TINY,
        "--out", str(tmp_path / "out.json")], timeout=230)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert s["errors"] == {}
    assert {"machine", "config", "scales", "growth", "errors", "wall_s", "command"} <= s.keys()
    assert json.loads((tmp_path / "out.json").read_text()) == s
    assert s["config"]["method"] == "fennel" and s["config"]["parts"] == 2
    assert s["config"]["train_scales"] == [1.0]
    assert [x["scale"] for x in s["scales"]] == [0.5, 1.0]
    assert [x["nodes"] for x in s["scales"]] == [3000, 6000]
    for x in s["scales"]:
        g, p = x["generate"], x["partition"]
        assert g["exit_code"] == 0 and g["wall_s"] > 0 and g["raw_bytes"] > 0
        assert g["peak_rss_bytes"] > 0
        assert p["exit_code"] == 0 and p["num_nodes"] == x["nodes"]
        assert p["num_edges"] > 0 and 0 <= p["edge_cut_frac"] <= 1
        assert p["node_balance"] >= 1 and p["train_balance"] >= 1
        assert p["wall_s"] > 0 and p["peak_rss_bytes"] > 0 and p["peak_rss_polled_bytes"] > 0
        assert p["parts_bytes"] > 0 and p["max_memory_bytes"] == 2 * 2**30
        assert p["method"] == "fennel"
    assert s["scales"][0]["train"] is None
    t = s["scales"][1]["train"]
    _check_train(t, parts=2)
    # the view: 3 batches of 256 training seeds, 300 valid / test seeds
    assert t["view"]["splits"]["train"] == 3 * 256 and t["batches"] == 3
    assert t["view"]["splits"]["test"] == 300
    assert s["growth"]["nodes"] == 2.0
    # raw and partition directories are removed without --keep
    assert not any(work.rglob("*.npy")) and not any(work.rglob("*.npz"))
    # benchmarks.capacity check reads this summary (when its flattening exists)
    cap = pytest.importorskip("benchmarks.capacity")
    if hasattr(cap, "runs_from_scalerun"):
        runs = cap.runs_from_scalerun(s)
        assert len(runs) == 2 and runs[1]["server_rss_bytes"] == t["server_rss_max_bytes"]


@pytest.mark.timeout(240)
def test_partcompare_small(tmp_path):
    """Two methods train end to end under both batch localities, on the same seeds; a method
    partition-ogbn refuses is reported in ``errors`` (exit 1) while the others still run."""
    proc, s = _run("benchmarks.partcompare", [
        "--nodes", "5000", "--parts", "2", "--methods", "fennel,random,nosuch", "--epochs",
        "1", "--train-batches", "2", "--work-dir", str(tmp_path / "w"), *TINY], timeout=230)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert list(s["errors"]) == ["nosuch:partition"], s["errors"]
    assert "exited with code 2" in s["errors"]["nosuch:partition"]
    assert s["config"]["methods"] == ["fennel", "random", "nosuch"]
    assert s["config"]["batch_locality"] == ["global", "part"]
    assert s["generate"]["exit_code"] == 0
    assert s["methods"]["nosuch"] == {"partition": None, "train": None}
    for m in ("fennel", "random"):
        p, runs = s["methods"][m]["partition"], s["methods"][m]["train"]
        assert p["method"] == m and p["num_nodes"] == 5000 and p["peak_rss_bytes"] > 0
        assert list(runs) == ["global", "part"]
        for loc, t in runs.items():
            _check_train(t, parts=2)
            assert t["batch_locality"] == loc and t["epochs_done"] == 1
            assert t["server_to_server_bytes_per_epoch"] == t["server_to_server_bytes"]
            assert t["server_to_server_requests_per_batch"] is not None
            assert 0 < t["bytes_received_per_epoch"] <= t["bytes_received"]
            # every method and locality trains and is evaluated on the same (capped) seeds
            assert t["view"] == runs["global"]["view"]
            assert t["view"]["splits"]["train"] == 2 * 256
            assert t["view"]["splits"]["valid"] == t["view"]["splits"]["test"] == 300
        # global: 2 batches of 256; part: each part's seeds in batches of their own
        assert runs["global"]["batches"] == 2 and 2 <= runs["part"]["batches"] <= 2 + 1
    c = s["comparison"]
    assert c["baseline"] == "fennel" and c["fennel"]["edge_cut_vs_baseline"] == 1.0
    assert c["random"]["edge_cut_frac"] > c["fennel"]["edge_cut_frac"]
    for loc in ("global", "part"):
        assert c["fennel"][loc]["s2s_bytes_per_epoch"] >= 0
        assert c["random"][loc]["seeds_per_s_vs_baseline"] > 0
    assert set(c["part_vs_global"]) == {"fennel", "random"}
    assert "global: s2s MB/ep" in proc.stderr and "part: s2s MB/ep" in proc.stderr
    assert not any((tmp_path / "w").rglob("*.npy"))


@pytest.mark.timeout(90)
def test_timeouts_stop_the_step(tmp_path):
    """A worker-mode run past --train-timeout-s is stopped, its servers and trainer with it
    (no process left behind), and reported; exit code 1, the JSON still printed."""
    work = tmp_path / "w"
    proc, s = _run("benchmarks.scalerun", [
        "--scales", "1", "--base-nodes", "3000", "--parts", "2", "--method", "random",
        "--train-batches", "2", "--work-dir", str(work), *TINY, "--train-timeout-s", "3"],
        timeout=80)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert list(s["errors"]) == ["1:train"], s["errors"]
    assert "did not finish within 3s" in s["errors"]["1:train"]
    assert s["scales"][0]["partition"]["exit_code"] == 0 and s["scales"][0]["train"] is None
    _no_process_using(work)


@pytest.mark.timeout(60)
def test_view_keeps_the_same_seeds(tmp_path, synth_graph):
    """make_view on two partitionings of one graph: capped splits hold the same original
    nodes; the arrays are links to the set's own; load_partition reads the view."""
    from benchmarks.scalerun import make_view
    from partition.layout import PartitionSetMeta, load_partition
    from partition.partitioner import partition_graph

    chosen = {}
    for method, k in (("metis", 2), ("random", 3)):
        parts = tmp_path / f"p-{method}"
        partition_graph(synth_graph, k, str(parts), method=method, seed=0, progress=False,
                        presample_batches=0)
        caps = {"train": 100, "valid": None, "test": 50}
        v = make_view(parts, tmp_path / f"v-{method}", caps, salt=7)
        assert v["splits"] == {"train": 100, "valid": len(synth_graph.valid), "test": 50}
        meta = PartitionSetMeta.load(tmp_path / f"v-{method}")
        assert meta.set_id != PartitionSetMeta.load(parts).set_id
        got = {s: [] for s in ("train", "valid", "test")}
        for p in range(k):
            part = load_partition(tmp_path / f"v-{method}", p)
            assert (tmp_path / f"v-{method}" / f"part-{p}" / "indices.npy").is_symlink()
            for s in got:
                gids = np.asarray(getattr(part, s))
                assert np.all(np.diff(gids) > 0)
                got[s].append(np.asarray(part.orig_ids)[gids - meta.node_offsets[p]])
        chosen[method] = {s: np.sort(np.concatenate(a)) for s, a in got.items()}
    for s in ("train", "valid", "test"):
        assert np.array_equal(chosen["metis"][s], chosen["random"][s]), s
    assert set(chosen["metis"]["train"]) <= set(synth_graph.train.tolist())


@pytest.mark.timeout(120)
def test_sigterm_stops_the_running_step(tmp_path):
    """SIGTERM while worker-mode runs: its servers and trainer are stopped, the directories
    removed, the summary of what ran printed, exit code 143."""
    work = tmp_path / "w"
    argv = [sys.executable, "-m", "benchmarks.scalerun", "--scales", "1", "--base-nodes",
            "3000", "--parts", "2", "--method", "random", "--train-batches", "2",
            "--work-dir", str(work), *TINY]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        seen = []
        for line in proc.stderr:  # wait until the servers are up
            seen.append(line)
            if "[train] [server p" in line:
                break
        else:
            pytest.fail("worker-mode never started a server:\n" + "".join(seen[-20:]))
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    s = json.loads(out.strip().splitlines()[-1])
    assert "SIGTERM" in s["errors"]["interrupted"]
    assert s["scales"][0]["partition"]["exit_code"] == 0 and s["scales"][0]["train"] is None
    _no_process_using(work)
    assert not any(work.rglob("*.npy"))
