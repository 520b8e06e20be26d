"""``python -m benchmarks.run``: mfgserve against the seed tutorial's DGL pipeline, one run.

Same machine, graph, model (GraphSAGE, mean aggregation), fanouts and batch size for both.
Measurements, in this order (each can be skipped with ``--skip``):

* ``dgl-train``: DGL DataLoader + NeighborSampler + dgl.nn GraphSAGE, for each
  ``--dgl-workers`` value (DataLoader ``num_workers``);
* ``dgl-sample``: the same DataLoader iterated without a model (sample + feature gather);
* ``server``: one mfgserve sampler server alone, sample + gather, requests kept in flight by
  this process (see :mod:`benchmarks.server_only`);
* ``worker``: ``deploy.worker_mode`` end to end (servers + trainers, a subprocess).

Output: progress and a human-readable table on stderr; the LAST stdout line is one JSON object
``{"machine", "graph", "config", "results", "ratios", "errors"}``. Ratios are mfgserve / DGL,
so > 1 means mfgserve is faster:

* ``train_seeds_per_s``: worker-mode ``seeds_per_s`` / best DGL training ``seeds_per_s``;
* ``sample_batches_per_s``: server-alone ``batches_per_s`` / best DGL sample+gather
  ``batches_per_s``.

Without ``--parts``, a synthetic graph (:func:`partition.synthetic.generate`) is generated and
written as a 1-part partition set, cached under ``--cache-dir``. Its train / valid / test
splits are random ``--train-frac`` / ``--eval-frac`` / ``--eval-frac`` subsets of the nodes
(like ogbn-products' small training split), so that one epoch plus evaluation stays short
while each batch's 3-hop neighbourhood is a realistic fraction of the graph.
Exit code: 0 when every measurement ran, 1 when some failed (their errors are in the JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

from benchmarks.graphs import set_dir, synthetic_data, write_one_part
from benchmarks.report import REPO, command_line, emit_summary, logger, machine_info, ratio
from partition.layout import PartitionFormatError, PartitionSetMeta

STEPS = ("dgl-train", "dgl-sample", "server", "worker", "wire")
log = logger("bench")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _skip_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in STEPS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown step(s) {bad}; choose from {', '.join(STEPS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Benchmark mfgserve against DGL's DataLoader + NeighborSampler pipeline "
                    "on the same graph, model, fanouts and batch size. The last stdout line is "
                    "a JSON summary; progress and a table go to stderr.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--parts", help="partition set directory (made by partition-ogbn); "
                     "default: a cached synthetic graph (see --synthetic-nodes)")
    src.add_argument("--synthetic-nodes", type=int, default=1_000_000,
                     help="nodes of the synthetic graph (default 1000000)")
    p.add_argument("--avg-degree", type=float, default=20.0,
                   help="synthetic: directed edges per node (default 20)")
    p.add_argument("--feat-dim", type=int, default=100, help="synthetic: feature size (100)")
    p.add_argument("--num-classes", type=int, default=47, help="synthetic: classes (47)")
    p.add_argument("--train-frac", type=float, default=0.025,
                   help="synthetic: fraction of nodes that are training seeds (0.025)")
    p.add_argument("--eval-frac", type=float, default=0.005,
                   help="synthetic: fraction of nodes in each of valid and test (0.005)")
    p.add_argument("--cache-dir", default="data/bench",
                   help="where synthetic partition sets are cached (default data/bench)")
    p.add_argument("--fanouts", type=_int_list, default=[15, 10, 5],
                   help="neighbours per layer, input layer first (default 15,10,5)")
    p.add_argument("--batch-size", type=int, default=1024, help="seeds per batch (1024)")
    p.add_argument("--hidden", type=int, default=256, help="GraphSAGE hidden size (256)")
    p.add_argument("--epochs", type=int, default=1, help="training epochs (default 1)")
    p.add_argument("--max-batches", type=int, default=None,
                   help="cap on DGL training batches per epoch and per evaluation pass, and "
                        "the batch count of the sample-only measurements (default: full "
                        "epochs; 30 sample-only batches). worker-mode always runs full epochs")
    p.add_argument("--dgl-workers", type=_int_list, default=[0, 1],
                   help="DGL DataLoader num_workers values to measure (default 0,1)")
    p.add_argument("--num-trainers", type=int, default=1, help="worker-mode trainers (1)")
    p.add_argument("--server-workers", type=int, default=2,
                   help="sampling threads per mfgserve server (default 2)")
    p.add_argument("--sampler-procs", type=_int_list, default=[0, 2],
                   help="server-alone: measure once per value of sampler-server "
                        "--sampler-procs (0: --server-workers threads; default 0,2)")
    p.add_argument("--worker-sampler-procs", type=int, default=0,
                   help="worker-mode servers' --sampler-procs (default 0: threads)")
    p.add_argument("--shm-ring", action=argparse.BooleanOptionalAction, default=True,
                   help="server-alone client and worker-mode trainers offer servers "
                        "shared-memory ring slots for the features (default: on)")
    p.add_argument("--inflight", type=int, default=4,
                   help="requests in flight: server-alone client and worker-mode trainers (4)")
    p.add_argument("--cache-ratio", type=float, default=0.0,
                   help="worker-mode trainers' feature cache ratio (0: no cache)")
    p.add_argument("--feat-transfer", default="", choices=["", "float16", "bfloat16"],
                   help="worker-mode feature dtype on the wire (default: as stored)")
    p.add_argument("--skip", type=_skip_list, default=[],
                   help=f"comma-separated steps to skip: {', '.join(STEPS)}")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--worker-timeout-s", type=float, default=1800.0,
                   help="stop worker-mode after this many seconds (1800)")
    p.add_argument("--out", help="also write the JSON summary to this file")
    return p


# ------------------------------------------------------------------------------ inputs


def synthetic_parts(args: argparse.Namespace) -> Path:
    """A cached 1-part partition set of the synthetic graph described by ``args``."""
    out = set_dir(args, args.synthetic_nodes)
    try:
        if PartitionSetMeta.load(out).num_parts == 1:
            log(f"using cached synthetic graph {out}")
            return out
    except PartitionFormatError:
        pass
    n = args.synthetic_nodes
    log(f"generating a synthetic graph: {n} nodes, avg degree {args.avg_degree:g}, "
        f"{args.feat_dim}-dim features, {args.num_classes} classes")
    t0 = time.perf_counter()
    write_one_part(synthetic_data(n, args), out, args.seed)
    log(f"wrote {out} in {time.perf_counter() - t0:.1f}s")
    return out


# ------------------------------------------------------------------------------ steps


def run_worker_mode(parts: Path, args: argparse.Namespace) -> dict:
    """``deploy.worker_mode`` in a subprocess; its last stdout line is the JSON summary."""
    argv = [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts),
            "--num-trainers", str(args.num_trainers), "--epochs", str(args.epochs),
            "--fanouts", ",".join(map(str, args.fanouts)), "--batch-size", str(args.batch_size),
            "--hidden", str(args.hidden), "--seed", str(args.seed),
            "--max-inflight", str(args.inflight), "--server-num-workers",
            str(args.server_workers), "--server-sampler-procs",
            str(args.worker_sampler_procs), "--no-progress",
            "--shm-ring" if args.shm_ring else "--no-shm-ring"]
    if args.cache_ratio:
        argv += ["--cache-ratio", str(args.cache_ratio)]
    if args.feat_transfer:
        argv += ["--feat-transfer", args.feat_transfer]
    log("worker-mode: " + " ".join(argv[1:]))
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=None, stdin=subprocess.DEVNULL,
                            text=True, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=args.worker_timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher tears its process tree down
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise RuntimeError(f"worker-mode did not finish within {args.worker_timeout_s:.0f}s "
                           "(raise --worker-timeout-s)") from None
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if proc.returncode != 0:
        raise RuntimeError(f"worker-mode exited with code {proc.returncode} (its stderr is "
                           f"above); last stdout line: {lines[-1] if lines else '<none>'}")
    try:
        summary = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise RuntimeError(f"worker-mode printed no JSON summary as its last line: {e}") from e
    keep = ("seeds_per_s", "train_s", "test_acc", "valid_acc", "best_epoch", "final_loss",
            "batches_per_epoch_per_trainer", "num_trainers", "bytes_received", "stages_s",
            "prepare_s", "startup_s", "launcher_wall_s", "teardown", "cache", "shm_ring")
    res = {k: summary[k] for k in keep if k in summary}
    batches = summary.get("batches_per_epoch_per_trainer", 0) * summary.get("epochs", 1) * \
        summary.get("num_trainers", 1)
    if summary.get("train_s"):
        res["batches_per_s"] = round(batches / summary["train_s"], 3)
        res["mb_per_s"] = round(summary.get("bytes_received", 0) / summary["train_s"] / 1e6, 2)
    res["exit_code"] = proc.returncode
    res["subprocess_wall_s"] = round(wall, 3)
    return res


class Steps:
    """The measurements of one run: each one's result, or its error (one failed measurement
    must not lose the others)."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}
        self.errors: dict[str, str] = {}

    def run(self, name: str, fn) -> None:
        log(f"{name}: start")
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        try:
            self.results[name] = fn()
            # Other processes on the machine distort every figure: keep the evidence.
            self.results[name]["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            log(f"{name}: done in {time.perf_counter() - t0:.1f}s: "
                f"{json.dumps(self.results[name])}")
        except Exception as e:  # one failed measurement must not lose the others
            self.errors[name] = f"{type(e).__name__}: {e}"
            log(f"{name}: FAILED after {time.perf_counter() - t0:.1f}s\n{traceback.format_exc()}")


def measure_dgl(steps: Steps, parts: Path, args: argparse.Namespace, sample_batches: int) -> None:
    """The DGL steps: training, then sample + gather, for each ``--dgl-workers`` value. The
    full graph is freed when this returns."""
    from benchmarks import dgl_pipeline

    log(f"loading the full graph for DGL from {parts}")
    fg = dgl_pipeline.load_full_graph(parts)
    log(f"loaded in {fg.load_s:.1f}s")
    if "dgl-train" not in args.skip:
        for w in args.dgl_workers:
            steps.run(f"dgl_train_w{w}", lambda w=w: dgl_pipeline.train_dgl(
                fg, args.fanouts, args.batch_size, args.epochs, hidden=args.hidden,
                num_workers=w, max_batches=args.max_batches, seed=args.seed))
    if "dgl-sample" not in args.skip:
        for w in args.dgl_workers:
            steps.run(f"dgl_sample_w{w}", lambda w=w: dgl_pipeline.sample_only_dgl(
                fg, args.fanouts, args.batch_size, sample_batches, num_workers=w,
                seed=args.seed))


def measure_mfgserve(steps: Steps, parts: Path, args: argparse.Namespace,
                     sample_batches: int) -> None:
    """The mfgserve steps not skipped: server alone (per ``--sampler-procs``), worker mode,
    wire."""
    if "server" not in args.skip:
        from benchmarks.server_only import measure_server

        for n in args.sampler_procs:
            steps.run("server_only" + (f"_procs{n}" if n else ""), lambda n=n: measure_server(
                parts, args.fanouts, args.batch_size, sample_batches, inflight=args.inflight,
                server_workers=args.server_workers, seed=args.seed, shm_ring=args.shm_ring,
                sampler_procs=n))
    if "worker" not in args.skip:
        steps.run("worker_mode", lambda: run_worker_mode(parts, args))
    if "wire" not in args.skip:
        from benchmarks.wire import measure_wire

        steps.run("wire", lambda: measure_wire())


# ------------------------------------------------------------------------------ summary


def _best(results: dict, prefix: str, key: str) -> tuple[str | None, float | None]:
    cands = [(k, v[key]) for k, v in results.items()
             if k.startswith(prefix) and isinstance(v, dict) and v.get(key)]
    return max(cands, key=lambda kv: kv[1]) if cands else (None, None)


def compute_ratios(results: dict) -> dict:
    ratios: dict = {}
    dgl_train_key, dgl_train = _best(results, "dgl_train", "seeds_per_s")
    wm = results.get("worker_mode", {}).get("seeds_per_s")
    ratios["train_seeds_per_s"] = ratio(wm, dgl_train)
    ratios["train_baseline"] = dgl_train_key
    for k, v in results.items():
        if k.startswith("dgl_train") and v.get("seeds_per_s"):
            ratios[f"train_seeds_per_s_vs_{k}"] = ratio(wm, v["seeds_per_s"])
    dgl_sample_key, dgl_sample = _best(results, "dgl_sample", "batches_per_s")
    srv_key, srv = _best(results, "server_only", "batches_per_s")
    ratios["sample_batches_per_s"] = ratio(srv, dgl_sample)
    ratios["sample_baseline"] = dgl_sample_key
    ratios["sample_mfgserve_config"] = srv_key
    for k, v in results.items():
        if k.startswith("dgl_sample") and v.get("batches_per_s"):
            ratios[f"sample_batches_per_s_vs_{k}"] = ratio(srv, v["batches_per_s"])
    dgl_acc = results.get(dgl_train_key, {}).get("test_acc") if dgl_train_key else None
    wm_acc = results.get("worker_mode", {}).get("test_acc")
    if dgl_acc is not None and wm_acc is not None:
        ratios["test_acc_diff"] = round(wm_acc - dgl_acc, 4)  # mfgserve minus DGL
    wire = results.get("wire", {})
    for transport in ("tcp", "ipc"):
        if f"{transport}_ratio" in wire:  # mfgserve codec vs raw zmq frames
            ratios[f"wire_{transport}_vs_raw_frames"] = wire[f"{transport}_ratio"]
    return ratios


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def print_table(summary: dict) -> None:
    rows = [("measurement", "batches/s", "seeds/s", "MB/s", "train_s", "test_acc")]
    for k, v in summary["results"].items():
        rows.append((k, _fmt(v.get("batches_per_s")), _fmt(v.get("seeds_per_s")),
                     _fmt(v.get("mb_per_s", v.get("feat_mb_per_s"))),
                     _fmt(v.get("train_s")), _fmt(v.get("test_acc"))))
    for k, e in summary["errors"].items():
        rows.append((k, "FAILED", e.splitlines()[0][:60] if e else "", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    g = summary["graph"]
    m = summary["machine"]
    print(f"\n{g.get('dataset')}: {g.get('num_nodes'):,} nodes, {g.get('num_edges'):,} edges, "
          f"{g.get('num_train'):,} train seeds; fanouts {summary['config']['fanouts']}, "
          f"batch {summary['config']['batch_size']}, hidden {summary['config']['hidden']}",
          file=sys.stderr)
    print(f"machine: {m['cores']} cores, {m['ram_gb']} GB, torch {m['torch']}, dgl {m['dgl']}, "
          f"python {m['python']}, load avg {m['loadavg_start']} -> {m.get('loadavg_end')}",
          file=sys.stderr)
    print("\n".join(lines), file=sys.stderr)
    r = summary["ratios"]
    print(f"ratios (mfgserve / DGL, >1 = mfgserve faster): training seeds/s "
          f"{_fmt(r.get('train_seeds_per_s'))} (vs {r.get('train_baseline')}), "
          f"sample+gather batches/s {_fmt(r.get('sample_batches_per_s'))} "
          f"(vs {r.get('sample_baseline')}), test_acc diff {_fmt(r.get('test_acc_diff'))}\n",
          file=sys.stderr, flush=True)


def graph_info(parts: Path, meta: PartitionSetMeta) -> dict:
    return {"parts_dir": str(parts), "dataset": meta.dataset, "num_parts": meta.num_parts,
            "num_nodes": meta.num_nodes, "num_edges": meta.num_edges,
            "feat_dim": meta.feat_dim, "num_classes": meta.num_classes,
            "num_train": sum(p.num_train for p in meta.parts),
            "num_valid": sum(p.num_valid for p in meta.parts),
            "num_test": sum(p.num_test for p in meta.parts)}


def run_config(args: argparse.Namespace, sample_batches: int) -> dict:
    return {"fanouts": args.fanouts, "batch_size": args.batch_size, "hidden": args.hidden,
            "epochs": args.epochs, "max_batches": args.max_batches,
            "sample_batches": sample_batches, "dgl_workers": args.dgl_workers,
            "num_trainers": args.num_trainers, "server_workers": args.server_workers,
            "inflight": args.inflight, "seed": args.seed, "skip": args.skip,
            "cache_ratio": args.cache_ratio, "feat_transfer": args.feat_transfer,
            "sampler_procs": args.sampler_procs,
            "worker_sampler_procs": args.worker_sampler_procs, "shm_ring": args.shm_ring}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*CPU affinity.*")
    t_start = time.perf_counter()
    machine = machine_info()
    parts = Path(args.parts) if args.parts else synthetic_parts(args)
    meta = PartitionSetMeta.load(parts)
    graph = graph_info(parts, meta)
    sample_batches = args.max_batches or 30
    config = run_config(args, sample_batches)
    steps = Steps()
    if "dgl-train" not in args.skip or "dgl-sample" not in args.skip:
        measure_dgl(steps, parts, args, sample_batches)
        gc.collect()
    measure_mfgserve(steps, parts, args, sample_batches)

    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = {"machine": machine, "graph": graph, "config": config, "results": steps.results,
               "ratios": compute_ratios(steps.results), "errors": steps.errors,
               "wall_s": round(time.perf_counter() - t_start, 1),
               "command": command_line("benchmarks.run", argv)}
    emit_summary(summary, args.out, print_table)
    return 1 if steps.errors else 0


if __name__ == "__main__":
    sys.exit(main())
