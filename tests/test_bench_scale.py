"""``python -m benchmarks.scale`` end to end on a tiny graph: it runs, exits 0, and its last
stdout line is the JSON summary. Timings are never asserted, only that they were measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from procs import REPO


@pytest.mark.timeout(180)
def test_scale_benchmark_small(tmp_path):
    argv = [sys.executable, "-m", "benchmarks.scale", "--base-nodes", "20000", "--scales",
            "0.5,1", "--batches", "3", "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=170, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"machine", "config", "scales", "ratios", "errors"} <= summary.keys()
    assert summary["errors"] == {}
    assert summary["config"]["base_nodes"] == 20000
    scales = summary["scales"]
    assert [s["scale"] for s in scales] == [0.5, 1.0]
    assert [s["nodes"] for s in scales] == [10000, 20000]
    for s in scales:
        for key in ("edges", "graph_bytes", "generate_s", "partition_s", "prep_peak_rss_bytes",
                    "server", "dgl"):
            assert key in s, key
        assert s["edges"] > 0 and s["graph_bytes"] > 0 and s["prep_peak_rss_bytes"] > 0
        for sys_name in ("server", "dgl"):
            m = s[sys_name]
            assert m["batches"] == 3
            assert m["batch_ms"] > 0 and m["batches_per_s"] > 0
            assert m["peak_rss_bytes"] > 0
        assert s["server"]["clean_exit"] is True
    # the same average degree at every scale: edges double with the nodes
    assert 1.8 < scales[1]["edges"] / scales[0]["edges"] < 2.2
    ratios = summary["ratios"]
    for key in ("server_batch_time_max_over_min", "dgl_batch_time_max_over_min",
                "server_mem_growth_vs_graph_growth", "graph_growth"):
        assert ratios[key] is not None and ratios[key] > 0, key
