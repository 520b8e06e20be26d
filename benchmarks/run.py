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
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import psutil
import torch

from partition.layout import PartitionFormatError, PartitionSetMeta

STEPS = ("dgl-train", "dgl-sample", "server", "worker", "wire")
REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def synthetic_data(n: int, args: argparse.Namespace):
    """A synthetic graph of ``n`` nodes shaped by ``args`` (avg_degree, feat_dim,
    num_classes, seed) with random train / valid / test splits (train_frac, eval_frac)."""
    from partition.synthetic import generate

    if not (0 < args.train_frac and 0 <= args.eval_frac
            and args.train_frac + 2 * args.eval_frac <= 1):
        raise ValueError("need 0 < --train-frac and train-frac + 2 * eval-frac <= 1")
    data = generate(n, avg_degree=args.avg_degree, feat_dim=args.feat_dim,
                    num_classes=args.num_classes, seed=args.seed, progress=True)
    perm = np.random.default_rng(args.seed + 1).permutation(n)
    n_train, n_eval = max(1, round(args.train_frac * n)), round(args.eval_frac * n)
    data.train = np.sort(perm[:n_train]).astype(np.int64)
    data.valid = np.sort(perm[n_train:n_train + n_eval]).astype(np.int64)
    data.test = np.sort(perm[n_train + n_eval:n_train + 2 * n_eval]).astype(np.int64)
    return data


def write_one_part(data, out: Path, seed: int) -> None:
    """Write ``data`` as a 1-part partition set at ``out``, moved into place when complete."""
    from partition.partitioner import partition_graph

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        partition_graph(data, 1, tmp / "set", seed=seed, progress=True)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "set", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def synthetic_parts(args: argparse.Namespace) -> Path:
    """A cached 1-part partition set of the synthetic graph described by ``args``."""
    tag = (f"synthetic-{args.synthetic_nodes}n-d{args.avg_degree:g}-f{args.feat_dim}"
           f"-c{args.num_classes}-tr{args.train_frac:g}-ev{args.eval_frac:g}-s{args.seed}-1part")
    out = Path(args.cache_dir) / tag
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


def machine_info() -> dict:
    from common.dgl_compat import import_dgl

    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                capture_output=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, text=True,
                                    capture_output=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": cpu_model,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dgl": import_dgl().__version__,
        "numpy": np.__version__,
        "os": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git": commit + ("-dirty" if dirty else ""),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


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


def command_line(module: str, argv: list[str] | None) -> str:
    return " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])


def emit_summary(summary: dict, out: str | None, table) -> None:
    """The readable table on stderr, then the JSON summary as the last stdout line (and in
    ``out`` if given)."""
    table(summary)
    line = json.dumps(summary)
    if out:
        Path(out).write_text(line + "\n")
    print(line, flush=True)


def _ratio(num: float | None, den: float | None) -> float | None:
    if not num or not den:
        return None
    return round(num / den, 3)


def _best(results: dict, prefix: str, key: str) -> tuple[str | None, float | None]:
    cands = [(k, v[key]) for k, v in results.items()
             if k.startswith(prefix) and isinstance(v, dict) and v.get(key)]
    return max(cands, key=lambda kv: kv[1]) if cands else (None, None)


def compute_ratios(results: dict) -> dict:
    ratios: dict = {}
    dgl_train_key, dgl_train = _best(results, "dgl_train", "seeds_per_s")
    wm = results.get("worker_mode", {}).get("seeds_per_s")
    ratios["train_seeds_per_s"] = _ratio(wm, dgl_train)
    ratios["train_baseline"] = dgl_train_key
    for k, v in results.items():
        if k.startswith("dgl_train") and v.get("seeds_per_s"):
            ratios[f"train_seeds_per_s_vs_{k}"] = _ratio(wm, v["seeds_per_s"])
    dgl_sample_key, dgl_sample = _best(results, "dgl_sample", "batches_per_s")
    srv_key, srv = _best(results, "server_only", "batches_per_s")
    ratios["sample_batches_per_s"] = _ratio(srv, dgl_sample)
    ratios["sample_baseline"] = dgl_sample_key
    ratios["sample_mfgserve_config"] = srv_key
    for k, v in results.items():
        if k.startswith("dgl_sample") and v.get("batches_per_s"):
            ratios[f"sample_batches_per_s_vs_{k}"] = _ratio(srv, v["batches_per_s"])
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*CPU affinity.*")
    t_start = time.perf_counter()
    machine = machine_info()
    parts = Path(args.parts) if args.parts else synthetic_parts(args)
    meta = PartitionSetMeta.load(parts)
    graph = {"parts_dir": str(parts), "dataset": meta.dataset, "num_parts": meta.num_parts,
             "num_nodes": meta.num_nodes, "num_edges": meta.num_edges,
             "feat_dim": meta.feat_dim, "num_classes": meta.num_classes,
             "num_train": sum(p.num_train for p in meta.parts),
             "num_valid": sum(p.num_valid for p in meta.parts),
             "num_test": sum(p.num_test for p in meta.parts)}
    sample_batches = args.max_batches or 30
    config = {"fanouts": args.fanouts, "batch_size": args.batch_size, "hidden": args.hidden,
              "epochs": args.epochs, "max_batches": args.max_batches,
              "sample_batches": sample_batches, "dgl_workers": args.dgl_workers,
              "num_trainers": args.num_trainers, "server_workers": args.server_workers,
              "inflight": args.inflight, "seed": args.seed, "skip": args.skip,
              "cache_ratio": args.cache_ratio, "feat_transfer": args.feat_transfer,
              "sampler_procs": args.sampler_procs,
              "worker_sampler_procs": args.worker_sampler_procs, "shm_ring": args.shm_ring}
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}

    def step(name: str, fn) -> None:
        log(f"{name}: start")
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        try:
            results[name] = fn()
            # Other processes on the machine distort every figure: keep the evidence.
            results[name]["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            log(f"{name}: done in {time.perf_counter() - t0:.1f}s: {json.dumps(results[name])}")
        except Exception as e:  # one failed measurement must not lose the others
            errors[name] = f"{type(e).__name__}: {e}"
            log(f"{name}: FAILED after {time.perf_counter() - t0:.1f}s\n{traceback.format_exc()}")

    if "dgl-train" not in args.skip or "dgl-sample" not in args.skip:
        from benchmarks import dgl_pipeline

        log(f"loading the full graph for DGL from {parts}")
        fg = dgl_pipeline.load_full_graph(parts)
        log(f"loaded in {fg.load_s:.1f}s")
        if "dgl-train" not in args.skip:
            for w in args.dgl_workers:
                step(f"dgl_train_w{w}", lambda w=w: dgl_pipeline.train_dgl(
                    fg, args.fanouts, args.batch_size, args.epochs, hidden=args.hidden,
                    num_workers=w, max_batches=args.max_batches, seed=args.seed))
        if "dgl-sample" not in args.skip:
            for w in args.dgl_workers:
                step(f"dgl_sample_w{w}", lambda w=w: dgl_pipeline.sample_only_dgl(
                    fg, args.fanouts, args.batch_size, sample_batches, num_workers=w,
                    seed=args.seed))
        del fg
        gc.collect()
    if "server" not in args.skip:
        from benchmarks.server_only import measure_server

        for n in args.sampler_procs:
            step("server_only" + (f"_procs{n}" if n else ""), lambda n=n: measure_server(
                parts, args.fanouts, args.batch_size, sample_batches, inflight=args.inflight,
                server_workers=args.server_workers, seed=args.seed, shm_ring=args.shm_ring,
                sampler_procs=n))
    if "worker" not in args.skip:
        step("worker_mode", lambda: run_worker_mode(parts, args))
    if "wire" not in args.skip:
        from benchmarks.wire import measure_wire

        step("wire", lambda: measure_wire())

    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = {"machine": machine, "graph": graph, "config": config, "results": results,
               "ratios": compute_ratios(results), "errors": errors,
               "wall_s": round(time.perf_counter() - t_start, 1),
               "command": command_line("benchmarks.run", argv)}
    emit_summary(summary, args.out, print_table)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
