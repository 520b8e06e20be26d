"""``python -m benchmarks.scale``: how sample + gather time and memory grow with the graph.

An ogbn-products-sized synthetic graph (:func:`partition.synthetic.generate`) at several
scales: ``--base-nodes`` (default 2,449,029, products' node count) times each of ``--scales``
(default 1/4, 1/2, 1). Every scale keeps products' shape: the same average degree (default
2 * 61,859,140 / 2,449,029 ~ 50.5 directed edges per node, so the full scale has ~61.9M
undirected edges), 100-dim float32 features, 47 classes, ~8 % training seeds (products:
196,615 of 2,449,029) and small valid / test splits (0.5 % each).

For each scale, each step in its own subprocess (:mod:`benchmarks.scale_steps`; so every peak
RSS belongs to that step alone, and the big arrays are freed when it exits):

* ``generate``: generate the graph and write a 1-part partition set
  (:func:`partition.partitioner.partition_graph`), cached under ``--cache-dir`` like
  :func:`benchmarks.run.synthetic_parts` does (a ``<set>.prep.json`` beside the set keeps the
  timings of the run that made it). Figures: ``generate_s``, ``partition_s`` and
  ``prep_peak_rss_bytes`` (peak RSS of the step's process, ``getrusage(RUSAGE_SELF)``).
* ``server``: one real mfgserve sampler server alone,
  :func:`benchmarks.server_only.measure_server` (``--inflight`` requests kept in flight by
  the measuring process). Its ``peak_rss_bytes`` is the server process's own peak RSS
  (``getrusage(RUSAGE_CHILDREN)`` of the measuring process, whose only child is the server;
  if the server starts processes of its own, the peak of the largest single process);
  ``sampled_peak_rss_*`` are the peaks of the server's RSS polled every 0.2 s (summed over
  the server and any processes it starts, ``sampled_server_processes``), split into anonymous
  memory and file-backed pages (the memory-mapped partition arrays, shared with the page
  cache).
* ``dgl`` (unless ``--skip-dgl``): DGL's DataLoader + NeighborSampler sample + gather with
  ``num_workers=0``, :func:`benchmarks.dgl_pipeline.sample_only_dgl`, on the whole graph
  loaded in memory (:func:`benchmarks.dgl_pipeline.load_full_graph`). ``peak_rss_bytes`` is
  the measuring process's peak (graph load + sampling).

``batch_ms`` = 1000 / ``batches_per_s`` over ``--batches`` timed batches (2 warm-up batches
untimed), the time per sampled + gathered batch (pipelined for the server). ``graph_bytes``
is the size of the part's ``.npy`` files (what a server maps).

Output: progress and a table on stderr; the LAST stdout line is one JSON object
``{"machine", "config", "scales": [{"scale", "nodes", "edges", "directed_edges",
"graph_bytes", "generate_s", "partition_s", "prep_peak_rss_bytes", "server", "dgl", ...}],
"ratios", "errors", "wall_s", "command"}``. ``ratios`` compare the largest scale with the
smallest (``*_growth``) or the slowest with the fastest (``*_max_over_min``); e.g.
``server_mem_growth_vs_graph_growth`` = (server peak RSS at the largest / at the smallest
scale) / (graph bytes at the largest / at the smallest scale): ~1 means memory grows with the
graph, < 1 a fixed overhead on top. Exit code: 0 when every step ran, 1 when one failed (its
error is in ``errors``; the other steps still run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from benchmarks.graphs import graph_bytes
from benchmarks.report import (
    REPO,
    command_line,
    emit_summary,
    int_list,
    logger,
    machine_info,
    ratio,
)
from benchmarks.scale_steps import run_step_here
from partition.layout import PartitionSetMeta

PRODUCTS_NODES = 2_449_029
PRODUCTS_EDGES = 61_859_140  # undirected
PRODUCTS_TRAIN = 196_615
PRODUCTS_AVG_DEGREE = 2 * PRODUCTS_EDGES / PRODUCTS_NODES  # directed edges per node
STEPS = ("generate", "server", "dgl")
log = logger("scale")


def _scale_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e
    if not vals or any(not 0 < v <= 64 for v in vals):
        raise argparse.ArgumentTypeError(f"scales must be in (0, 64], got {text!r}")
    return sorted(set(vals))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scale",
        description="Scaling benchmark on an ogbn-products-sized synthetic graph: for each "
                    "scale, generate + partition it (timed, peak memory), then measure one "
                    "mfgserve sampler server's and DGL's per-batch sample + gather time and "
                    "peak memory. The last stdout line is a JSON summary; progress and a table "
                    "go to stderr. Each step runs in its own subprocess.")
    p.add_argument("--scales", type=_scale_list, default=[0.25, 0.5, 1.0],
                   help="comma-separated fractions of --base-nodes to measure (default "
                        "0.25,0.5,1); the average degree is the same at every scale")
    p.add_argument("--base-nodes", type=int, default=PRODUCTS_NODES,
                   help=f"nodes at scale 1 (default {PRODUCTS_NODES}, ogbn-products)")
    p.add_argument("--avg-degree", type=float, default=PRODUCTS_AVG_DEGREE,
                   help="directed edges per node, i.e. 2 x undirected edges / nodes (default "
                        f"{PRODUCTS_AVG_DEGREE:.4f}: ogbn-products' {PRODUCTS_EDGES:,} "
                        f"undirected edges over {PRODUCTS_NODES:,} nodes)")
    p.add_argument("--feat-dim", type=int, default=100, help="feature size (default 100)")
    p.add_argument("--num-classes", type=int, default=47, help="classes (default 47)")
    p.add_argument("--train-frac", type=float, default=round(PRODUCTS_TRAIN / PRODUCTS_NODES, 5),
                   help="fraction of nodes that are training seeds (default "
                        f"{PRODUCTS_TRAIN / PRODUCTS_NODES:.5f}, products' "
                        f"{PRODUCTS_TRAIN:,} train nodes)")
    p.add_argument("--eval-frac", type=float, default=0.005,
                   help="fraction of nodes in each of valid and test (default 0.005)")
    p.add_argument("--cache-dir", default="data/bench-scale",
                   help="where the generated partition sets are cached, one per scale "
                        "(default data/bench-scale; ~2 GB at full scale, ~3.5 GB for the default "
                        "three scales)")
    p.add_argument("--fanouts", type=int_list, default=[15, 10, 5],
                   help="neighbours per layer, input layer first (default 15,10,5)")
    p.add_argument("--batch-size", type=int, default=1024, help="seeds per batch (1024)")
    p.add_argument("--batches", type=int, default=100,
                   help="timed batches per measurement, after 2 untimed warm-up batches "
                        "(default 100: 30 gave run-to-run swings of 1.5x on 2 cores)")
    p.add_argument("--inflight", type=int, default=4,
                   help="requests the server measurement keeps in flight (default 4)")
    p.add_argument("--server-workers", type=int, default=2,
                   help="sampling threads of the mfgserve server (default 2)")
    p.add_argument("--skip-dgl", action="store_true",
                   help="do not measure DGL's DataLoader (mfgserve server only)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the graphs, splits and batches (default 0)")
    p.add_argument("--step-timeout-s", type=float, default=3600.0,
                   help="stop a step's subprocess after this many seconds (default 3600)")
    p.add_argument("--out", help="also write the JSON summary to this file")
    p.add_argument("--step", choices=STEPS,
                   help="internal: run this one step for --nodes nodes in this process and "
                        "print its JSON (the parent runs every step this way)")
    p.add_argument("--nodes", type=int, help="internal: node count of the --step graph")
    return p


# ------------------------------------------------------------------------------ parent


def _step_argv(args: argparse.Namespace, step: str, n: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.scale", "--step", step, "--nodes", str(n),
            "--avg-degree", repr(args.avg_degree), "--feat-dim", str(args.feat_dim),
            "--num-classes", str(args.num_classes), "--train-frac", repr(args.train_frac),
            "--eval-frac", repr(args.eval_frac), "--cache-dir", str(args.cache_dir),
            "--fanouts", ",".join(map(str, args.fanouts)), "--batch-size", str(args.batch_size),
            "--batches", str(args.batches), "--inflight", str(args.inflight),
            "--server-workers", str(args.server_workers), "--seed", str(args.seed)]


def _stderr_tail(text: str, lines: int = 8) -> str:
    """The last full lines of a child's stderr, progress-bar updates dropped."""
    kept = [ln.rsplit("\r", 1)[-1] for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


def run_step(args: argparse.Namespace, step: str, n: int) -> dict:
    """Run one step in a subprocess, its stderr echoed to ours; its last stdout line is JSON."""
    argv = _step_argv(args, step, n)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=REPO)
    tail, out = bytearray(), bytearray()

    def pump(src, keep: bytearray, echo: bool) -> None:
        # stderr: echoed as it comes (progress), its end kept for errors; stdout: kept whole
        while chunk := os.read(src.fileno(), 65536):
            if echo:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
                keep.extend(chunk)
                del keep[:-16384]
            else:
                keep.extend(chunk)

    readers = [threading.Thread(target=pump, args=(proc.stderr, tail, True), daemon=True),
               threading.Thread(target=pump, args=(proc.stdout, out, False), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=args.step_timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # a server child dies with it (PDEATHSIG)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise RuntimeError(f"step {step} ({n} nodes) did not finish within "
                           f"{args.step_timeout_s:.0f}s (raise --step-timeout-s)") from None
    finally:
        for t in readers:
            t.join(timeout=10)
    out_b = bytes(out)
    lines = [ln for ln in out_b.decode(errors="replace").splitlines() if ln.strip()]
    if proc.returncode != 0:
        raise RuntimeError(f"step {step} ({n} nodes) exited with code {proc.returncode}; "
                           f"last stdout line: {lines[-1] if lines else '<none>'}; stderr "
                           f"ends:\n{_stderr_tail(tail.decode(errors='replace'))}")
    try:
        res = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise RuntimeError(f"step {step} printed no JSON as its last stdout line: {e}") from e
    res["step_wall_s"] = round(time.perf_counter() - t0, 2)
    return res


def compute_ratios(scales: list[dict]) -> dict:
    """Growth from the smallest to the largest measured scale; slowest over fastest batch."""
    ok = [s for s in scales if s.get("graph_bytes")]
    r: dict = {}
    if not ok:
        return r
    lo, hi = min(ok, key=lambda s: s["scale"]), max(ok, key=lambda s: s["scale"])
    r["from_scale"], r["to_scale"] = lo["scale"], hi["scale"]
    r["node_growth"] = ratio(hi["nodes"], lo["nodes"])
    r["graph_growth"] = ratio(hi["graph_bytes"], lo["graph_bytes"])
    for sys_name in ("server", "dgl"):
        times = [s[sys_name]["batch_ms"] for s in scales
                 if isinstance(s.get(sys_name), dict) and s[sys_name].get("batch_ms")]
        r[f"{sys_name}_batch_time_max_over_min"] = (ratio(max(times), min(times))
                                                    if len(times) > 1 else None)
        # Batches of a larger graph have more distinct input nodes (fewer repeats among the
        # sampled neighbours): time per input node separates that from slower operations.
        per_node = [s[sys_name]["batch_ms"] / s[sys_name]["input_nodes_per_batch"]
                    for s in scales if isinstance(s.get(sys_name), dict)
                    and s[sys_name].get("batch_ms") and s[sys_name].get("input_nodes_per_batch")]
        r[f"{sys_name}_time_per_input_node_max_over_min"] = (
            ratio(max(per_node), min(per_node)) if len(per_node) > 1 else None)
        mem_lo = (lo.get(sys_name) or {}).get("peak_rss_bytes")
        mem_hi = (hi.get(sys_name) or {}).get("peak_rss_bytes")
        t_lo = (lo.get(sys_name) or {}).get("batch_ms")
        t_hi = (hi.get(sys_name) or {}).get("batch_ms")
        r[f"{sys_name}_batch_time_growth"] = ratio(t_hi, t_lo)
        r[f"{sys_name}_mem_growth"] = ratio(mem_hi, mem_lo)
        r[f"{sys_name}_mem_growth_vs_graph_growth"] = ratio(r[f"{sys_name}_mem_growth"],
                                                             r["graph_growth"])
    r["prep_peak_rss_growth"] = ratio(hi.get("prep_peak_rss_bytes"),
                                       lo.get("prep_peak_rss_bytes"))
    r["server_over_dgl_batch_time"] = {
        str(s["scale"]): ratio((s.get("server") or {}).get("batch_ms"),
                                (s.get("dgl") or {}).get("batch_ms")) for s in scales}
    return r


def _mb(v) -> str:
    return "-" if not v else f"{v / 1e6:,.0f}"


def _num(v, fmt: str = ",.1f") -> str:
    return "-" if v is None else format(v, fmt)


def print_table(summary: dict) -> None:
    rows = [("scale", "nodes", "edges", "graph MB", "gen s", "part s", "prep peak MB",
             "server ms/batch", "server peak MB", "dgl ms/batch", "dgl peak MB")]
    for s in summary["scales"]:
        srv, dgl = s.get("server") or {}, s.get("dgl") or {}
        rows.append((f"{s['scale']:g}", _num(s.get("nodes"), ","), _num(s.get("edges"), ","),
                     _mb(s.get("graph_bytes")), _num(s.get("generate_s")),
                     _num(s.get("partition_s")), _mb(s.get("prep_peak_rss_bytes")),
                     _num(srv.get("batch_ms")), _mb(srv.get("peak_rss_bytes")),
                     _num(dgl.get("batch_ms")), _mb(dgl.get("peak_rss_bytes"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    m, c = summary["machine"], summary["config"]
    print(f"\nproducts-scale synthetic graphs: avg degree {c['avg_degree']:.4g}, "
          f"{c['feat_dim']}-dim features; fanouts {c['fanouts']}, batch {c['batch_size']}, "
          f"{c['batches']} timed batches", file=sys.stderr)
    print(f"machine: {m.get('cores')} cores, {m.get('ram_gb')} GB, torch {m.get('torch')}, "
          f"dgl {m.get('dgl')}, load avg {m.get('loadavg_start')} -> {m.get('loadavg_end')}",
          file=sys.stderr)
    print("\n".join(lines), file=sys.stderr)
    r = summary["ratios"]
    print(f"ratios ({r.get('from_scale')} -> {r.get('to_scale')}): graph x"
          f"{r.get('graph_growth')}, server memory x{r.get('server_mem_growth')} "
          f"(vs graph {r.get('server_mem_growth_vs_graph_growth')}), DGL memory "
          f"x{r.get('dgl_mem_growth')} (vs graph {r.get('dgl_mem_growth_vs_graph_growth')}); "
          f"batch time max/min: server {r.get('server_batch_time_max_over_min')}, DGL "
          f"{r.get('dgl_batch_time_max_over_min')}", file=sys.stderr)
    for k, e in summary["errors"].items():
        print(f"FAILED {k}: {e.splitlines()[0][:200] if e else ''}", file=sys.stderr)
    print(file=sys.stderr, flush=True)


def scale_config(args: argparse.Namespace) -> dict:
    return {"scales": args.scales, "base_nodes": args.base_nodes,
            "avg_degree": args.avg_degree, "feat_dim": args.feat_dim,
            "num_classes": args.num_classes, "train_frac": args.train_frac,
            "eval_frac": args.eval_frac, "fanouts": args.fanouts,
            "batch_size": args.batch_size, "batches": args.batches, "warmup_batches": 2,
            "inflight": args.inflight, "server_workers": args.server_workers,
            "dgl_num_workers": 0, "skip_dgl": args.skip_dgl, "seed": args.seed,
            "cache_dir": str(args.cache_dir)}


def logged_step(args: argparse.Namespace, name: str, n: int, scale: float,
                errors: dict[str, str]) -> dict | None:
    """:func:`run_step` with progress lines; on failure the error goes to ``errors`` (under
    ``"<scale>:<step>"``) and the result is None."""
    key = f"{scale:g}:{name}"
    log(f"scale {scale:g} ({n:,} nodes): {name}")
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    try:
        res = run_step(args, name, n)
        res["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        log(f"{key}: done in {time.perf_counter() - t0:.1f}s: {json.dumps(res)}")
        return res
    except Exception as e:  # one failed step must not lose the others
        errors[key] = f"{type(e).__name__}: {e}"
        log(f"{key}: FAILED after {time.perf_counter() - t0:.1f}s\n"
            f"{traceback.format_exc()}")
        return None


def measure_scale(args: argparse.Namespace, entry: dict, errors: dict[str, str]) -> None:
    """Every step at one scale, filling ``entry`` (``{"scale", "nodes"}``); the server and
    DGL steps run only when the graph could be made."""
    scale, n = entry["scale"], entry["nodes"]
    prep = logged_step(args, "generate", n, scale, errors)
    if prep is None:
        return
    parts = Path(prep["parts_dir"])
    meta = PartitionSetMeta.load(parts)
    entry.update({"nodes": meta.num_nodes, "edges": meta.num_edges // 2,
                  "directed_edges": meta.num_edges,
                  "num_train": sum(p.num_train for p in meta.parts),
                  **graph_bytes(parts), "parts_dir": str(parts),
                  "cached": prep["cached"], "generate_s": prep["generate_s"],
                  "partition_s": prep["partition_s"],
                  "prep_peak_rss_bytes": prep["prep_peak_rss_bytes"]})
    entry["server"] = logged_step(args, "server", n, scale, errors)
    entry["dgl"] = None if args.skip_dgl else logged_step(args, "dgl", n, scale, errors)
    srv, dgl = entry["server"] or {}, entry["dgl"] or {}
    entry["server_over_dgl_batch_time"] = ratio(srv.get("batch_ms"), dgl.get("batch_ms"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.step:
        return run_step_here(args)
    t_start = time.perf_counter()
    machine = machine_info()
    config = scale_config(args)
    scales: list[dict] = []
    errors: dict[str, str] = {}
    for scale in args.scales:
        entry: dict = {"scale": scale, "nodes": max(2, round(scale * args.base_nodes))}
        scales.append(entry)
        measure_scale(args, entry, errors)

    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = {"machine": machine, "config": config, "scales": scales,
               "ratios": compute_ratios(scales), "errors": errors,
               "wall_s": round(time.perf_counter() - t_start, 1),
               "command": command_line("benchmarks.scale", argv)}
    emit_summary(summary, args.out, print_table)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
