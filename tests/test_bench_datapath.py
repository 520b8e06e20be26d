"""``python -m benchmarks.datapath`` and ``python -m benchmarks.limits`` end to end on a tiny
1-part set (20k nodes): they exit 0 and the last stdout line is JSON of the documented shape.
Timings are never asserted, only that they were measured (present and positive)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from procs import REPO


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A 1-part set of a 20k-node synthetic graph, as benchmarks/graphs.py writes one."""
    from benchmarks.graphs import synthetic_data
    from partition.partitioner import partition_graph

    args = argparse.Namespace(avg_degree=10.0, feat_dim=16, num_classes=5, seed=0,
                              train_frac=0.1, eval_frac=0.01)
    out = tmp_path_factory.mktemp("datapath") / "set"
    data = synthetic_data(20_000, args)
    partition_graph(data, 1, out, seed=0, progress=False, presample_batches=2)  # hot_rank.npy
    return out


def _run(argv: list[str], timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _positive(d: dict, *keys: str) -> None:
    for k in keys:
        assert d.get(k) is not None and d[k] > 0, (k, d.get(k))


@pytest.mark.timeout(120)
def test_datapath_small(parts):
    s = _run(["benchmarks.datapath", "--parts", str(parts), "--fanouts", "5,5",
              "--batch-size", "256", "--num-batches", "20", "--warmup", "1"], timeout=110)
    assert {"config", "results", "ratios", "errors"} <= s.keys()
    assert s["errors"] == {}
    r = s["results"]
    assert set(r) == {"datapath-mfgserve-1srv", "datapath-mfgserve-2srv", "datapath-dgl-w0",
                      "datapath-dgl-w1"}
    for n in (1, 2):
        m = r[f"datapath-mfgserve-{n}srv"]
        assert m["servers"] == n and m["parts"] == 1 and m["batches"] == 20
        _positive(m, "seeds_per_s", "batches_per_s", "server_cpu_s",
                  "seeds_per_sampler_cpu_s", "seeds_per_total_cpu_s", "configured_sampler_cores")
        assert m["exit_codes"] == [0] * n and m["clean_exit"] is True
        assert m["teardown"] in ("none", "polite")
        assert m["shm_ring"] is True and m["replies_in_ring"] > 0  # the ring was used
        for k in ("server_faults", "consumer_faults"):  # counted over the timed window
            assert set(m[k]) == {"minor", "major"} and min(m[k].values()) >= 0, m[k]
    for w in (0, 1):
        d = r[f"datapath-dgl-w{w}"]
        assert d["num_workers"] == w and d["batches"] == 20
        _positive(d, "seeds_per_s", "sampler_cpu_s", "seeds_per_sampler_cpu_s",
                  "seeds_per_total_cpu_s")
        assert set(d["sampler_faults"]) == {"minor", "major"}
        assert min(d["sampler_faults"].values()) >= 0
    _positive(s["ratios"], "per_core_1srv", "per_core_2srv", "per_total_cpu_1srv",
              "seeds_per_s_2srv")


@pytest.mark.timeout(120)
def test_datapath_with_trainer_cache(parts):
    """The extra row with the trainer's feature cache: the servers leave the cached rows out,
    the loader fills them in (features still summed by the consumer), its own ratios."""
    s = _run(["benchmarks.datapath", "--parts", str(parts), "--fanouts", "5,5",
              "--batch-size", "256", "--num-batches", "10", "--warmup", "1", "--servers", "1",
              "--dgl-workers", "0", "--datapath-cache-ratio", "0.3"], timeout=110)
    assert s["errors"] == {}
    r = s["results"]
    assert set(r) == {"datapath-mfgserve-1srv", "datapath-mfgserve-1srv-cache",
                      "datapath-dgl-w0"}
    plain, cached = r["datapath-mfgserve-1srv"], r["datapath-mfgserve-1srv-cache"]
    assert plain["cache_ratio"] == 0.0 and plain["cached_nodes"] == 0
    assert cached["cache_ratio"] == 0.3 and cached["clean_exit"] is True
    assert cached["cached_nodes"] == int(0.3 * 20_000)
    _positive(cached, "cache_rows_per_batch", "seeds_per_sampler_cpu_s")
    assert cached["cache_rows_per_batch"] < cached["input_nodes_per_batch"]
    _positive(s["ratios"], "per_core_1srv", "per_core_1srv_cache", "per_total_cpu_1srv_cache")


@pytest.mark.timeout(120)
def test_datapath_rounds(parts):
    """``--rounds 2``: every row twice (round 2's named ``_r2``, each result carrying its
    round), each ratio the median of the two rounds' ratios, which are listed."""
    s = _run(["benchmarks.datapath", "--parts", str(parts), "--fanouts", "5,5",
              "--batch-size", "256", "--num-batches", "5", "--warmup", "1", "--servers", "1",
              "--dgl-workers", "0", "--rounds", "2"], timeout=110)
    assert s["errors"] == {} and s["config"]["rounds"] == 2
    r = s["results"]
    assert set(r) == {"datapath-mfgserve-1srv", "datapath-dgl-w0",
                      "datapath-mfgserve-1srv_r2", "datapath-dgl-w0_r2"}
    assert [r[k]["round"] for k in sorted(r)] == [1, 2, 1, 2]
    assert all(v["clean_exit"] for k, v in r.items() if "mfgserve" in k)
    per = s["ratios"]["per_core_1srv_rounds"]
    assert len(per) == 2 and all(x > 0 for x in per)
    for k in ("per_core_1srv", "per_total_cpu_1srv", "seeds_per_s_1srv"):
        got = s["ratios"][f"{k}_rounds"]
        assert s["ratios"][k] == pytest.approx(sum(got) / 2, abs=1e-3)  # median of two
    for sfx, rnd in (("", 1), ("_r2", 2)):  # each round's ratio pairs its own rows
        ours, dgl = r[f"datapath-mfgserve-1srv{sfx}"], r[f"datapath-dgl-w0{sfx}"]
        assert per[rnd - 1] == pytest.approx(
            ours["seeds_per_sampler_cpu_s"] / dgl["seeds_per_sampler_cpu_s"], abs=1e-3)


def test_ratios_pair_each_round():
    """:func:`benchmarks.datapath.ratios` on made-up rows: a round's ratio is against that
    round's best DGL row, the figure is the median over rounds; one round: no lists."""
    from benchmarks.datapath import ratios

    def ours(rnd, per_core):
        return {"side": "mfgserve", "servers": 1, "round": rnd, "seeds_per_s": 1.0,
                "seeds_per_sampler_cpu_s": per_core, "seeds_per_total_cpu_s": 1.0}

    def dgl(rnd, w, per_core):
        return {"side": "dgl", "num_workers": w, "round": rnd, "seeds_per_s": 1.0,
                "seeds_per_sampler_cpu_s": per_core, "seeds_per_total_cpu_s": 1.0}

    rows = {"a": ours(1, 30.0), "b": dgl(1, 0, 10.0), "c": dgl(1, 1, 15.0),
            "d": ours(2, 20.0), "e": dgl(2, 0, 20.0), "f": ours(3, 50.0), "g": dgl(3, 1, 10.0)}
    got = ratios(rows)
    assert got["per_core_1srv_rounds"] == [2.0, 1.0, 5.0]
    assert got["per_core_1srv"] == 2.0  # the median, not the ratio of medians (30 / 15)
    assert got["dgl_best"]["seeds_per_sampler_cpu_s"] == 15.0
    one = ratios({"a": ours(1, 30.0), "b": dgl(1, 0, 10.0)})
    assert one["per_core_1srv"] == 3.0 and "per_core_1srv_rounds" not in one
    legacy = ratios({"a": {k: v for k, v in ours(1, 30.0).items() if k != "round"},
                     "b": dgl(1, 0, 10.0)})  # a result without "round" is round 1's
    assert legacy["per_core_1srv"] == 3.0
    assert ratios({})["dgl_best"]["seeds_per_sampler_cpu_s"] is None


@pytest.mark.timeout(60)
def test_limits_small(parts):
    s = _run(["benchmarks.limits", "--parts", str(parts), "--fanouts", "5,5",
              "--batch-size", "256", "--num-batches", "2", "--repeats", "1",
              "--mem-mib", "32", "--mem-repeats", "2"], timeout=55)
    r = s["results"]
    assert set(r) == {"limits-memory", "limits-gather", "limits-sampling", "limits-distance"}
    _positive(r["limits-memory"], "copy_gbps")
    g = r["limits-gather"]
    for k in ("ours_into_slot", "ours_new_tensor", "dgl_index_select", "index_select_into_out"):
        _positive(g[k], "payload_gbps", "of_copy")
    smp = r["limits-sampling"]
    assert smp["sampled_edges"] > 0
    for k in ("ours_seeded", "ours_unseeded", "dgl_sample_neighbors"):
        _positive(smp["per_hop"][k], "ns_per_edge_wall")
    for k in ("ours_seeded", "ours_unseeded", "dgl_sample_blocks"):
        _positive(smp["mfg"][k], "ns_per_edge_wall")
    d = r["limits-distance"]
    _positive(d, "copy_gbps", "gather_ours_into_slot_of_copy", "sample_ours_seeded_vs_dgl",
              "mfg_ours_seeded_vs_dgl")
    _positive(d["per_batch"], "input_rows", "sampled_edges", "seeds_per_core_s_ours")


def test_settings_from_run_namespace():
    """run_step reads benchmarks.run's Namespace (optional fields may be missing)."""
    from benchmarks import datapath, limits

    ns = argparse.Namespace(fanouts=[15, 10, 5], batch_size=1024, hidden=256, dropout=0.0,
                            seed=3, max_batches=None, server_workers=2, inflight=4,
                            shm_ring=True, num_threads=None)
    d = datapath.Settings.from_args(ns)
    assert (d.num_batches, d.servers, d.dgl_workers, d.seed) == (90, [1, 2], [0, 1], 3)
    assert d.rounds == 1
    ns.max_batches, ns.rounds = 7, 3  # benchmarks.run's --rounds
    assert (datapath.Settings.from_args(ns).num_batches, datapath.Settings.from_args(ns).rounds
            ) == (7, 3)
    lim = limits.Settings.from_args(ns)
    assert lim.fanouts == [15, 10, 5] and lim.mem_mib == 1024


@pytest.mark.timeout(180)
def test_step_small_with_dgl_under_autocast(parts):
    """``python -m benchmarks.step`` at matmul precision medium with DGL's step under
    torch.autocast (bfloat16): both sides timed, the setting recorded."""
    s = _run(["benchmarks.step", "--parts", str(parts), "--fanouts", "5,5",
              "--batch-size", "256", "--batches", "2", "--repeats", "2", "--hidden", "32",
              "--matmul-precision", "medium", "--dgl-autocast"], timeout=170)
    assert s["dgl_autocast"] is True and s["timed_steps"] == 2
    _positive(s, "mfgserve_ms", "dgl_ms", "ratio", "input_nodes_per_batch")


@pytest.mark.timeout(60)
def test_process_cpu_s_reads_another_process_to_the_nanosecond():
    """:func:`benchmarks.report.process_cpu_s` reads a child's CPU clock: after the child
    spun for 3 ms of its own CPU time (less than psutil's 10 ms tick), the reading is at
    least what the child's own clock said; a process that is gone raises psutil's error."""
    import psutil

    from benchmarks.report import process_cpu_s

    code = ("import sys, time\n"
            "t = time.process_time()\n"
            "while time.process_time() - t < 0.003: pass\n"
            "print(time.process_time(), flush=True)\n"
            "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    proc = psutil.Process(child.pid)
    try:
        own = float(child.stdout.readline())
        got = process_cpu_s(proc)
        assert got >= own > 0
        assert got != round(got, 2)  # not a count of 10 ms ticks
    finally:
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    with pytest.raises(psutil.Error):
        process_cpu_s(proc)


@pytest.mark.timeout(120)
def test_run_step_measures_in_a_fresh_process(parts):
    """benchmarks.run's datapath step runs ``python -m benchmarks.datapath`` with every
    setting (the child's command line parses back to the same Settings) and returns its
    rows and ratios; the rows measured there, in a process of their own."""
    from benchmarks import datapath

    ns = argparse.Namespace(fanouts=[5, 5], batch_size=256, seed=2, max_batches=4,
                            server_workers=1, inflight=3, shm_ring=True, num_threads=None,
                            dgl_workers=[0], datapath_servers=[1], warmup=1, rounds=1,
                            datapath_cache_ratio=0.0)
    s = datapath.Settings.from_args(ns)
    argv = datapath.child_argv(parts, s, "out.json")
    assert argv[1:3] == ["-m", "benchmarks.datapath"]
    assert datapath.Settings.from_cli(datapath.build_parser().parse_args(argv[3:])) == s
    got = datapath.run_step(parts, ns)
    assert set(got) == {"datapath-mfgserve-1srv", "datapath-dgl-w0", "datapath-ratios"}
    ours = got["datapath-mfgserve-1srv"]
    assert ours["batches"] == 4 and ours["server_workers"] == 1 and ours["clean_exit"]
    assert ours["inflight"] == 3
    _positive(got["datapath-ratios"], "per_core_1srv")
