"""``python -m benchmarks.capacity``: the model's arithmetic on a hand-written calibration
(real numbers, checked against sums done here), ``measure`` end to end on a tiny graph (real
partition-ogbn runs and real sampler servers), ``check`` flagging a run off by more than 25 %,
and bad input exiting 2 with a message naming what to change. No timing is asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from procs import REPO

from benchmarks import capacity as cap

GIB = 1 << 30


def hand_calibration() -> dict:
    """Round numbers. alpha is huge (no sampled node repeats), so a batch is exactly
    seeds x (1 + phi) per hop; every CPU cost but the per-edge one is zero."""
    return {
        "format": cap.CALIBRATION_FORMAT, "version": cap.CALIBRATION_VERSION,
        "graph": {"nodes": 1000, "avg_degree": 10.0, "feat_dim": 100, "train_frac": 0.1},
        "sampling": {"batch_size": 1000, "fanouts": [2, 2, 2], "phi": [2.0, 2.0, 2.0],
                     "neff_coef": 1e6, "neff_exp": 1.0, "reply_overhead": 1.0, "remote_overhead": 1.0},
        "server_cpu": {"ms_per_sampled_edge": 0.001, "ms_per_feature_byte": 0.0,
                       "ms_per_reply_byte": 0.0, "ms_per_remote_byte": 0.0},
        "server_memory": {"fixed_anon_bytes": 300e6, "threads": 2, "inflight": 4},
        "partition": {"bytes": {"per_node_nonfeat": 40.0, "per_edge": 8.0},
                      "fit": {m: {"time": [2.0, 1e-9], "peak": [100e6, 0.0, 15.0]}
                              for m in ("fennel", "random", "metis")},
                      "plan": {"base_bytes": 100e6, "chunk_factor": 1.0}},
        "cut_by_parts": {},
        "gpu_ref_input_nodes": 27_000,
    }


def graph(**kw) -> dict:
    t = {"dataset": "custom", "nodes": 1_000_000, "directed_edges": 20_000_000,
         "feat_dim": 100, "feat_bytes": 4, "train_nodes": 100_000}
    t.update(kw)
    return t


@pytest.mark.timeout(30)
def test_predict_arithmetic():
    from partition import memplan

    cal = hand_calibration()
    n, e, d = 1_000_000, 20_000_000, 100
    # the batch: 1000 seeds -> 3000 -> 9000 -> 27000 nodes; 2000 + 6000 + 18000 edges
    walk = [(1000, 2000, 3000), (3000, 6000, 9000), (9000, 18000, 27000)]
    reply = 27000 * (8 + 400) + sum(8 * (dst + 1) + 8 * ed for dst, ed, _ in walk) + 16 * 1000
    graph_bytes = n * (40 + 400) + e * 8
    for k in (1, 2, 4):
        p = cap.predict(cal, graph(), servers=k, trainers=k, bandwidth_gbps=10.0,
                        gpu_step_ms=5.0, server_cores=16)
        layers = p["batch"]["layers"]
        assert [(h["dst"], h["edges"], h["src"]) for h in layers] == walk
        assert p["batch"]["input_nodes"] == 27000
        assert p["batch"]["reply_bytes"] == pytest.approx(reply, rel=1e-6)
        assert p["graph_bytes"] == pytest.approx(graph_bytes, rel=1e-9)
        # memory per server = graph bytes / K + fixed + relabel scratch + batches in flight
        # (each: its features, its reply and what peers sent it)
        remote = p["batch"]["remote_bytes"]
        assert (remote == 0) == (k == 1)
        mem = (graph_bytes / k + 300e6 + 2 * 4 * n
               + 4 * (27000 * d * 4 + reply + remote))
        assert p["server_memory_bytes"] == pytest.approx(mem, rel=1e-6)
        ep = p["epoch"]
        assert ep["batches"] == 100 and ep["batches_per_trainer"] == math.ceil(100 / k)
        # sampling: 100 batches x 26000 edges x 1 us over K x 16 cores
        assert ep["bounds_s"]["sampling_cores"] == pytest.approx(100 * 26.0 / 1000 / (16 * k),
                                                                 abs=0.01)
        assert ep["bounds_s"]["gpu"] == pytest.approx(math.ceil(100 / k) * 5.0 / 1000, abs=0.01)
        # partitioning: 2 s + 1 ns per input byte (16 per edge + 400 MB of features);
        # peak: the streaming pipeline's plan (largest phase, 100 MB of base); metis: the
        # fitted line, 100 MB + 15 B per directed edge
        assert p["partition"]["wall_s"] == pytest.approx(2 + 0.32 + 0.4, abs=0.05)
        plan = cap.plan_peak("fennel", n, e, d, 4, k, None, 100e6, 1.0)
        assert p["partition"]["peak_model"] == "plan"
        assert p["partition"]["peak_rss_bytes"] == pytest.approx(plan["peak"], rel=1e-9)
        assert plan["peak"] == max(plan["phases"].values())
        assert min(plan["phases"].values()) > 100e6
        metis = cap.predict(cal, graph(), servers=k, trainers=k, bandwidth_gbps=10.0,
                            method="metis")
        assert metis["partition"]["peak_model"] == "fit"
        need = memplan.min_bytes("metis", n, e, d, 4, k)  # never below memplan's own figure
        assert metis["partition"]["peak_rss_bytes"] == pytest.approx(max(100e6 + 15 * e, need),
                                                                      rel=1e-6)
    # K = 1: nothing crosses between servers; K = 2 with random assignment: some does
    assert cap.predict(cal, graph(), servers=1, trainers=1,
                       bandwidth_gbps=10)["batch"]["remote_bytes"] == 0
    two = cap.predict(cal, graph(), servers=2, trainers=2, bandwidth_gbps=10, method="random")
    assert two["edge_cut"] == 0.5 and two["batch"]["remote_bytes"] > 0
    assert 0.5 <= two["batch"]["local_fraction"][0] < 0.55  # the majority part's seeds


@pytest.mark.timeout(30)
def test_ring_cpu_fit_and_prediction():
    """The worker-mode (ring) coefficients: the 1-part run's CPU split by its stage times over
    the model's edges and feature bytes, the 4-part run's extra per server-to-server byte;
    predict uses them only for a run with the ring."""
    walk = [{"dst": 1000, "edges": 2000, "src": 3000}, {"dst": 3000, "edges": 6000, "src": 9000},
            {"dst": 9000, "edges": 18000, "src": 27000}]
    runs = {1: {"server_cpu_ms_per_batch": 100.0,
                "stage_ms_per_batch": {"server_sample": 30.0, "server_gather": 10.0}},
            4: {"server_cpu_ms_per_batch": 300.0, "server_to_server_bytes_per_batch": 4e7}}
    ring = cap.fit_ring_cpu(runs, walk, 100, 4)
    assert ring["ms_per_sampled_edge"] == pytest.approx(75.0 / 26000)
    assert ring["ms_per_feature_byte"] == pytest.approx(25.0 / (27000 * 400))
    assert ring["ms_per_remote_byte"] == pytest.approx(200.0 / 4e7)
    cal = hand_calibration()
    cal["server_cpu"]["ring"] = ring
    sock = cap.predict(cal, graph(), servers=1, trainers=1, bandwidth_gbps=10)
    assert sock["batch"]["server_cpu_model"] == "socket"
    assert sock["batch"]["server_cpu_ms"] == pytest.approx(26.0, abs=0.01)  # 1 us per edge
    one = cap.predict(cal, graph(), servers=1, trainers=1, bandwidth_gbps=10, shm_ring=True)
    assert one["batch"]["server_cpu_model"] == "ring (worker mode)"
    assert one["batch"]["server_cpu_ms"] == pytest.approx(100.0, abs=0.01)  # the same batch
    four = cap.predict(cal, graph(), servers=4, trainers=1, bandwidth_gbps=10, shm_ring=True)
    x = four["batch"]["remote_bytes"]
    assert four["batch"]["server_cpu_ms"] == pytest.approx(100.0 + 200.0 * x / 4e7, abs=0.01)


@pytest.mark.timeout(30)
def test_predict_bounds_and_budget():
    cal = hand_calibration()
    slow_net = cap.predict(cal, graph(), servers=1, trainers=1, bandwidth_gbps=0.001,
                           gpu_step_ms=1.0)
    assert slow_net["epoch"]["binds"] == "network"
    # network: 100 replies out of one server at 1 Mbit/s
    reply = slow_net["batch"]["reply_bytes"]
    assert slow_net["epoch"]["bounds_s"]["network"] == pytest.approx(
        100 * reply / (0.001e9 / 8), rel=1e-3)
    assert cap.predict(cal, graph(), servers=1, trainers=1, bandwidth_gbps=100,
                       gpu_step_ms=1000.0)["epoch"]["binds"] == "gpu"
    # no --gpu-step-ms: the published reference scaled by input nodes (27000 / 27000 here)
    ref = cap.predict(cal, graph(), servers=1, trainers=1, bandwidth_gbps=100)
    assert ref["epoch"]["gpu_step_ms"] == pytest.approx(cap.GPU_REF["step_ms"], abs=0.01)
    assert "SALIENT" in ref["epoch"]["gpu_step_source"]
    # a streaming method's planned peak stays within the budget it plans for
    big = graph(nodes=50_000_000, directed_edges=1_000_000_000)
    low = cap.predict(cal, big, servers=4, trainers=4, bandwidth_gbps=10, max_memory_gb=12,
                      method="random")
    assert low["partition"]["fits_budget"] is True
    assert low["partition"]["peak_rss_bytes"] <= 12 * GIB
    high = cap.predict(cal, graph(), servers=4, trainers=4, bandwidth_gbps=10,
                       max_memory_gb=64)
    assert high["partition"]["fits_budget"] is True


@pytest.mark.timeout(30)
def test_plan_peak_follows_the_budget():
    """The peak is planned from partition.memplan's buffers for the budget: a smaller budget
    never predicts a higher peak, the peak stays under the budget, and past the budget where
    every buffer reaches its cap (or holds all the edges) it stops growing."""
    from partition import memplan

    for method in ("fennel", "ldg", "random"):
        for n, e, k in ((2_449_029, 123_675_964, 4), (9_796_116, 494_703_858, 4),
                        (500_000, 25_250_000, 2)):
            need = memplan.min_bytes(method, n, e, 100, 4, k)
            budgets = sorted({int(need * f) for f in (1.0, 1.1, 1.5, 2, 3, 5)}
                             | {g * GIB for g in (2, 4, 8, 12, 24, 64, 256)
                                if g * GIB >= need})
            peaks = [cap.plan_peak(method, n, e, 100, 4, k, b, 50e6, 0.8)["peak"]
                     for b in budgets]
            assert all(a <= b for a, b in zip(peaks, peaks[1:])), (method, n, peaks)
            for b, pk in zip(budgets, peaks):
                assert pk <= b, (method, n, b, pk)
            assert peaks[-1] == peaks[-2]  # 64 vs 256 GiB: nothing more to buy
    # the phases that set the 1x and 4x products-scale peaks at 12 GiB (docs/scaling.md)
    one = cap.plan_peak("fennel", 2_449_029, 123_675_964, 100, 4, 4, 12 * GIB, 0.0, 1.0)
    four = cap.plan_peak("fennel", 9_796_116, 494_703_858, 100, 4, 4, 12 * GIB, 0.0, 1.0)
    assert one["phase"] == "assign: bucket edges" and four["phase"] == "assign: passes"
    # the assigner's passes hold every edge key at 4x (8 bytes per directed edge)
    assert four["peak"] >= 8 * 494_703_858


@pytest.mark.timeout(30)
def test_fit_plan_recovers_its_terms():
    """fit_plan on runs made by the plan itself (base 60 MB, chunk factor 0.7) returns them."""
    runs = [{"method": "fennel", "nodes": n, "directed_edges": int(50.5 * n), "feat_dim": 100,
             "num_parts": 4, "max_memory_gb": gb} for n in (100_000, 500_000, 1_000_000)
            for gb in (1.0, 2.0, 12.0)]
    for r in runs:
        r["peak_rss_bytes"] = cap._plan_run_peak(r, 60e6, 0.7)
    fit = cap.fit_plan(runs)
    assert fit["chunk_factor"] == pytest.approx(0.7)
    assert fit["base_bytes"] == pytest.approx(60e6, rel=1e-6)
    assert fit["max_abs_error_pct"] < 0.1


def _run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.capacity", *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          stdin=subprocess.DEVNULL)


@pytest.mark.timeout(60)
def test_predict_cli_named_datasets(tmp_path):
    f = tmp_path / "cal.json"
    f.write_text(json.dumps(hand_calibration()) + "\n")
    proc = _run("predict", "--dataset", "ogbn-papers100M", "--servers", "1,2,4,8",
                "--bandwidth-gbps", "10,100", "--calibration", str(f), "--max-memory-gb", "64")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    preds = out["predictions"]
    assert [(p["servers"], p["bandwidth_gbps"]) for p in preds] == [
        (k, b) for k in (1, 2, 4, 8) for b in (10.0, 100.0)]
    assert all(p["nodes"] == 111_059_956 and p["feat_dim"] == 128 for p in preds)
    # memory per server falls with K; every bound is positive and one of them binds
    mems = [p["server_memory_bytes"] for p in preds[::2]]
    assert mems == sorted(mems, reverse=True)
    for p in preds:
        assert p["epoch"]["binds"] in p["epoch"]["bounds_s"]
        assert all(v > 0 for v in p["epoch"]["bounds_s"].values())
    assert "mem/server" in proc.stderr and "binds" in proc.stderr
    # no --calibration: the committed default, measured here
    default = _run("predict", "--dataset", "ogbn-products", "--servers", "4",
                   "--bandwidth-gbps", "10", "--max-memory-gb", "12")
    assert default.returncode == 0, default.stderr
    d = json.loads(default.stdout.strip().splitlines()[-1])
    assert d["calibration"].endswith("benchmarks/calibration/default.json")
    assert d["predictions"][0]["partition"]["peak_model"] == "plan"
    assert cap.load_calibration(None)["format"] == cap.CALIBRATION_FORMAT
    custom = _run("predict", "--dataset", "custom", "--nodes", "1000000", "--edges", "10000000",
                  "--feat-dim", "100", "--train-nodes", "100000", "--servers", "2",
                  "--bandwidth-gbps", "10", "--calibration", str(f))
    assert custom.returncode == 0, custom.stderr
    p = json.loads(custom.stdout.strip().splitlines()[-1])["predictions"][0]
    assert p["directed_edges"] == 20_000_000 and p["graph_bytes"] == 1_000_000 * 440 + 160e6


@pytest.mark.timeout(60)
def test_check_flags_runs_off_by_more_than_25_percent(tmp_path):
    cal = hand_calibration()
    t = graph()
    p = cap.predict(cal, t, servers=2, trainers=1, bandwidth_gbps=10.0)
    good = {"name": "good", "nodes": t["nodes"], "directed_edges": t["directed_edges"],
            "feat_dim": 100, "num_parts": 2, "method": "fennel", "train_nodes": 100_000,
            "graph_bytes": p["graph_bytes"] * 1.1,
            "partition_wall_s": p["partition"]["wall_s"] * 0.9}
    bad = dict(good, name="bad", graph_bytes=p["graph_bytes"] / 2)
    rows = cap.check(cal, [good, bad])
    by = {(r["run"], r["figure"]): r for r in rows}
    assert by[("good", "partition set bytes")]["flag"] is False
    assert by[("good", "partition set bytes")]["error_pct"] == pytest.approx(-9.1, abs=0.1)
    assert by[("good", "partition wall s")]["flag"] is False
    assert by[("bad", "partition set bytes")]["flag"] is True
    assert by[("bad", "partition set bytes")]["error_pct"] == pytest.approx(100.0, abs=0.1)

    # the CLI reads benchmarks.scalerun's summary as it writes it
    summary = {"config": {"feat_dim": 100, "parts": 2, "method": "fennel",
                          "max_memory_gb": 12, "train_frac": 0.1, "feat_dtype": "float32"},
               "scales": [{"scale": 1.0, "nodes": t["nodes"],
                           "partition": {"num_nodes": t["nodes"],
                                         "num_edges": t["directed_edges"],
                                         "wall_s": p["partition"]["wall_s"],
                                         "peak_rss_polled_bytes":
                                             p["partition"]["peak_rss_bytes"] * 2,
                                         "parts_bytes": p["graph_bytes"], "method": "fennel"},
                           "train": None}]}
    runs = tmp_path / "runs.json"
    runs.write_text("progress\n" + json.dumps(summary) + "\n")
    f = tmp_path / "cal.json"
    f.write_text(json.dumps(cal) + "\n")
    proc = _run("check", "--calibration", str(f), "--runs", str(runs))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    flagged = {r["figure"] for r in out["rows"] if r["flag"]}
    assert flagged == {"partition peak RSS"}  # predicted half of the measured peak
    assert out["flagged"] == 1 and out["compared"] == 3
    assert "FLAG" in proc.stderr


@pytest.mark.timeout(60)
def test_bad_input_exits_2_naming_the_fix(tmp_path):
    missing = _run("predict", "--dataset", "ogbn-products", "--servers", "2",
                   "--bandwidth-gbps", "10", "--calibration", str(tmp_path / "nope.json"))
    assert missing.returncode == 2
    assert "--calibration" in missing.stderr and "measure --out" in missing.stderr
    assert "Traceback" not in missing.stderr
    f = tmp_path / "cal.json"
    f.write_text(json.dumps(hand_calibration()) + "\n")
    unknown = _run("predict", "--dataset", "ogbn-nope", "--servers", "2", "--bandwidth-gbps",
                   "10", "--calibration", str(f))
    assert unknown.returncode == 2
    assert "--dataset 'ogbn-nope' is unknown" in unknown.stderr
    assert "ogbn-papers100M" in unknown.stderr and "Traceback" not in unknown.stderr
    custom = _run("predict", "--dataset", "custom", "--nodes", "1000", "--servers", "2",
                  "--bandwidth-gbps", "10", "--calibration", str(f))
    assert custom.returncode == 2 and "--edges" in custom.stderr
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json\n")
    bad = _run("check", "--calibration", str(garbled), "--runs", str(f))
    assert bad.returncode == 2 and "re-make it" in bad.stderr
    noruns = _run("check", "--calibration", str(f), "--runs", str(tmp_path / "none.json"))
    assert noruns.returncode == 2 and "benchmarks.scalerun" in noruns.stderr


@pytest.mark.timeout(420)
def test_measure_tiny_graph_end_to_end(tmp_path):
    out = tmp_path / "cal.json"
    proc = _run("measure", "--out", str(out), "--nodes", "3000", "--batches", "3",
                "--layer-batches", "2", "--shape-nodes", "2000,3000", "--methods", "fennel",
                "--max-memory-gb", "2", "--partition-nodes", "6000", "--plan-budgets", "1",
                "--ring-batches", "2", "--ring-eval-seeds", "200",
                "--work-dir", str(tmp_path), timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cal = cap.load_calibration(str(out))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == cal
    assert list(cal["partition"]["fit"]) == ["fennel"]
    # 1, 2 and 4 parts at N; 4 parts at N/2 twice; 1 and 4 parts of the 6000-node graph;
    # 4 parts at N with a 1 GB budget
    assert len(cal["partition"]["runs"]) == 8
    assert cal["partition"]["plan"]["runs"] == 8 and cal["partition"]["plan"]["base_bytes"] >= 0
    # the worker-mode runs (ring on) on the 6000-node graph's 1- and 4-part sets
    ring = cal["server_cpu"]["ring"]
    assert ring["nodes"] == 6000 and set(ring["runs"]) == {"1", "4"}
    assert all(r["shm_ring"]["used"] and r["server_cpu_ms_per_batch"] > 0
               for r in ring["runs"].values())
    assert ring["runs"]["4"]["server_to_server_bytes_per_batch"] > 0
    assert ring["ms_per_sampled_edge"] > 0 and ring["ms_per_feature_byte"] > 0
    assert ring["ms_per_remote_byte"] >= 0
    assert all(r["peak_rss_bytes"] > 0 and r["wall_s"] > 0 for r in cal["partition"]["runs"])
    s = cal["sampling"]
    assert s["fanouts"] == [15, 10, 5] and len(s["phi"]) == 3 and s["neff_coef"] > 0
    assert [pt["nodes"] for pt in s["ladder"]] == [2000, 3000]
    assert 0 < s["layers"]["full"]["input_nodes"] <= 3000
    assert s["reply_bytes_measured"] > 0 and 0.5 < s["reply_overhead"] < 2
    assert s["remote_bytes_measured_2parts"] > 0
    assert cal["server_cpu"]["cpu_ms_per_batch"] > 0
    assert cal["server_memory"]["peak_rss_bytes"] > 0
    assert cal["partition"]["bytes"]["per_edge"] == pytest.approx(8.0, rel=0.01)
    # the file it wrote feeds predict
    p = cap.predict(cal, dict(cap.DATASETS["ogbn-products"], dataset="ogbn-products"),
                    servers=2, trainers=2, bandwidth_gbps=10)
    assert p["server_memory_bytes"] > p["graph_bytes"] / 2
    assert p["batch"]["server_cpu_model"] == "socket"
    pr = cap.predict(cal, dict(cap.DATASETS["ogbn-products"], dataset="ogbn-products"),
                     servers=2, trainers=2, bandwidth_gbps=10, shm_ring=True)
    assert pr["batch"]["server_cpu_model"] == "ring (worker mode)"
    assert pr["batch"]["server_cpu_ms"] > 0
    assert not list(tmp_path.glob("mfgserve-capacity-*"))  # its temporary graphs are gone
