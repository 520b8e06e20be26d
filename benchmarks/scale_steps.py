"""The child side of ``python -m benchmarks.scale``: one step (``--step``) run in its own
process, so that every peak RSS belongs to that step alone; see :mod:`benchmarks.scale`."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
import time
import warnings
from pathlib import Path

import psutil

from benchmarks.graphs import set_dir, synthetic_data, write_one_part
from benchmarks.report import logger
from partition.layout import PartitionFormatError, PartitionSetMeta

log = logger("scale")


# ------------------------------------------------------------------------------ helpers


def _prep_file(parts: Path) -> Path:
    return parts.parent / (parts.name + ".prep.json")


def self_peak_rss() -> int:
    """Peak RSS of this process in bytes (its own, not a parent's: see peak_rss_bytes)."""
    from partition.partitioner import peak_rss_bytes

    return peak_rss_bytes()


def children_peak_rss() -> int:
    """Largest peak RSS among this process's waited-for children, in bytes."""
    kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


class ChildRssPoller:
    """Polls the RSS of this process's descendants (the server) in a background thread."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.peak = {"rss": 0, "anon": 0, "file": 0, "processes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-poller")

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(self.interval_s):
            try:
                kids = me.children(recursive=True)
            except psutil.Error:
                continue
            rss = anon = file = 0
            self.peak["processes"] = max(self.peak["processes"], len(kids))
            for k in kids:
                try:
                    mi = k.memory_info()
                except psutil.Error:
                    continue
                shared = getattr(mi, "shared", 0)  # Linux: file-backed + shmem pages
                rss, anon, file = rss + mi.rss, anon + mi.rss - shared, file + shared
            for key, v in (("rss", rss), ("anon", anon), ("file", file)):
                self.peak[key] = max(self.peak[key], v)

    def __enter__(self) -> ChildRssPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ------------------------------------------------------------------------------ steps (child)


def step_generate(args: argparse.Namespace, n: int) -> dict:
    """Generate + partition the ``n``-node graph unless cached; timings and peak RSS."""
    out = set_dir(args, n)
    try:
        if PartitionSetMeta.load(out).num_parts == 1:
            log(f"using cached graph {out}")
            try:
                prep = json.loads(_prep_file(out).read_text())
            except (OSError, ValueError):
                prep = {}
            return {"parts_dir": str(out), "cached": True,
                    "generate_s": prep.get("generate_s"),
                    "partition_s": prep.get("partition_s"),
                    "prep_peak_rss_bytes": prep.get("prep_peak_rss_bytes")}
    except PartitionFormatError:
        pass
    log(f"generating {n:,} nodes, avg degree {args.avg_degree:.4g} "
        f"(~{round(n * args.avg_degree / 2):,} undirected edges), {args.feat_dim}-dim "
        f"features, {args.num_classes} classes")
    t0 = time.perf_counter()
    data = synthetic_data(n, args)
    generate_s = time.perf_counter() - t0
    log(f"generated in {generate_s:.1f}s; partitioning (1 part)")
    t1 = time.perf_counter()
    write_one_part(data, out, args.seed)
    partition_s = time.perf_counter() - t1
    del data
    res = {"parts_dir": str(out), "cached": False, "generate_s": round(generate_s, 2),
           "partition_s": round(partition_s, 2), "prep_peak_rss_bytes": self_peak_rss()}
    _prep_file(out).write_text(json.dumps(res) + "\n")
    log(f"wrote {out}: generate {generate_s:.1f}s, partition {partition_s:.1f}s, peak RSS "
        f"{res['prep_peak_rss_bytes'] / 2**30:.2f} GiB")
    return res


def step_server(args: argparse.Namespace, parts: Path) -> dict:
    """One mfgserve server alone; its peak RSS from RUSAGE_CHILDREN and a poller."""
    from benchmarks.server_only import measure_server

    before = children_peak_rss()  # 0 in a fresh step process
    with ChildRssPoller() as poll:
        res = measure_server(parts, args.fanouts, args.batch_size, args.batches,
                             inflight=args.inflight, server_workers=args.server_workers,
                             seed=args.seed, startup_timeout_s=600.0, request_timeout_s=600.0)
    peak = children_peak_rss()
    if "peak_rss_bytes" in res:  # measure_server measured the server's memory itself: use it
        res["peak_rss_source"] = "benchmarks.server_only.measure_server"
    else:
        res["peak_rss_bytes"] = peak
        res["peak_rss_source"] = ("getrusage(RUSAGE_CHILDREN)" if peak > before
                                  else "getrusage(RUSAGE_CHILDREN), includes an earlier child")
    res["rusage_children_peak_rss_bytes"] = peak
    res["sampled_peak_rss_bytes"] = poll.peak["rss"]
    res["sampled_peak_rss_anon_bytes"] = poll.peak["anon"]
    res["sampled_peak_rss_file_bytes"] = poll.peak["file"]
    res["sampled_server_processes"] = poll.peak["processes"]
    res["batch_ms"] = round(1000.0 / res["batches_per_s"], 2) if res.get("batches_per_s") \
        else None
    return res


def step_dgl(args: argparse.Namespace, parts: Path) -> dict:
    """DGL DataLoader sample + gather (num_workers 0) on the whole graph; this process's peak."""
    from benchmarks import dgl_pipeline

    fg = dgl_pipeline.load_full_graph(parts)
    log(f"DGL graph loaded in {fg.load_s:.1f}s")
    res = dgl_pipeline.sample_only_dgl(fg, args.fanouts, args.batch_size, args.batches,
                                       num_workers=0, seed=args.seed)
    res["load_s"] = round(fg.load_s, 2)
    res["peak_rss_bytes"] = self_peak_rss()
    res["peak_rss_source"] = "getrusage(RUSAGE_SELF) of the measuring process (load + sample)"
    res["batch_ms"] = round(1000.0 / res["batches_per_s"], 2) if res.get("batches_per_s") \
        else None
    return res


def run_step_here(args: argparse.Namespace) -> int:
    """``--step``: one step in this process; the JSON result is the last stdout line."""
    if args.nodes is None or args.nodes < 2:
        raise SystemExit("--step needs --nodes N (N >= 2)")
    warnings.filterwarnings("ignore", message=".*CPU affinity.*")
    if args.step == "generate":
        res = step_generate(args, args.nodes)
    else:
        parts = set_dir(args, args.nodes)
        PartitionSetMeta.load(parts)  # a clear error when the set is missing
        res = step_server(args, parts) if args.step == "server" else step_dgl(args, parts)
    print(json.dumps(res), flush=True)
    return 0
