"""``python -m benchmarks.run``: mfgserve against the seed tutorial's DGL pipeline, one run.

Same machine, graph, model, initialisation, optimizer, fanouts and batch size for both sides.
The model is GraphSAGE (``SAGEConv`` mean aggregation, ReLU between layers, nothing after the
last), Adam lr 3e-3 weight decay 5e-4; each ``--dropout`` value runs on BOTH sides, and
dropout 0 is the seed tutorial's model: the **headline** row and ratio. Each ``--family`` of
graphs (``products``: the products-shaped synthetic generator; ``rmat``: an RMAT graph with
skewed degrees, written in OGB's binary layout and read by partition-ogbn) is measured in the
same run, with its own ratios; ``--parts DIR`` benchmarks one given partition set instead
(family ``given``). ``--matmul-precision highest,medium`` runs every training row at each
float32 matmul precision on both sides (``medium``: bfloat16 products on a CPU with AMX);
a row at ``medium`` (``d0_medium``) is compared with DGL's best at that dropout over
``medium`` and ``highest``.

Measurements per family, in this order (each can be skipped with ``--skip``):

* ``dgl-train``: DGL DataLoader + NeighborSampler + dgl.nn GraphSAGE, for each
  ``--dgl-workers`` value (DataLoader ``num_workers``) and each dropout;
* ``dgl-sample``: the same DataLoader iterated without a model (sample + feature gather);
* ``server``: one mfgserve sampler server alone, sample + gather, requests kept in flight by
  this process, each with a sample seed as a trainer's (see :mod:`benchmarks.server_only`);
* ``worker``: ``deploy.worker_mode`` end to end (servers + trainers, a subprocess), each dropout;
* ``ddp``: two trainers on one node at the headline dropout: DGL with ``--ddp-procs``
  DistributedDataParallel processes over gloo (each half the seeds and half the batch) vs
  worker mode with as many trainers (each half the batch): the same total batch;
* ``step`` (each dropout), ``datapath``, ``limits``: ``benchmarks.<name>.run_step(parts,
  args)``, their figures as they return them (``datapath`` measures in a child process of
  its own, ``python -m benchmarks.datapath``);

and once per run ``wire`` (the codec against raw zmq frames, no graph), ``hetero`` (a
mag-shaped typed graph, :mod:`benchmarks.hetero`) and ``multilabel`` (an ogbn-proteins-shaped
graph with 112 binary tasks, the seed model on both sides, ``--rounds`` pairs:
:mod:`benchmarks.multilabel`).

``--rounds N`` (N > 1) measures the end-to-end training rows (``dgl-train`` and ``worker``,
each dropout) N times per family, alternating which side goes first: round 1 is the order
above (DGL first), round 2 runs worker mode first, round 3 DGL first again, and so on. Round
r > 1 stores its results as ``<name>_r<r>`` (``dgl_train_w0_d0_r2``, ``worker_mode_d0_r2``).
Each round's ratio pairs the two sides measured next to each other, against that round's
best DGL configuration; a row's ratio is the **median of its rounds' ratios** (the list is
``train_seeds_per_s_<d>_rounds``), and its seeds/s per side the median over rounds. On a
shared machine whose speed drifts by tens of percent within minutes, a single round's ratio
moves with the drift; pairs measured back to back move together.
The ``datapath`` step takes the same ``--rounds``: every row of it per round, mfgserve's
first in odd rounds and DGL's first in even ones, each ratio the median of the rounds'
(:func:`benchmarks.datapath.ratios`).

Output: progress and a human-readable table on stderr; the LAST stdout line is one JSON object
``{"machine", "config", "families", "graphs", "results", "ratios", "headline", "comparison",
"wire", "errors", "wall_s", "command"}``; ``results`` and ``ratios`` are keyed by family.
Ratios are mfgserve / DGL, so > 1 means mfgserve is faster (the ``step`` module's ``ratio``
is a time ratio: < 1 is faster). Exit code: 0 when every measurement ran, 1 when some failed
(their errors are in the JSON), 2 on bad options.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

from benchmarks.report import (
    REPO,
    add_malloc_arg,
    apply_malloc,
    at_least,
    command_line,
    cpu_times,
    emit_summary,
    int_list,
    logger,
    machine_info,
    ratio,
    steal_share,
)
from common.config import CPU_GEMMS, LOCAL_FEATURE_MODES, MATMUL_PRECISIONS, PREFETCH_MODES
from partition.layout import PartitionSetMeta

STEPS = ("dgl-train", "dgl-sample", "server", "worker", "ddp", "step", "datapath", "limits",
         "wire", "hetero", "multilabel")
FAMILIES = ("products", "rmat")
MODULE_STEPS = ("step", "datapath", "limits")  # benchmarks.<name>.run_step(parts, args)
LR, WEIGHT_DECAY = 3e-3, 5e-4  # Adam, both sides (mfgserve trainer's defaults)
DGL_WARMUP_BATCHES = 2  # untimed DGL training batches before the timed DGL runs
log = logger("bench")


def _skip_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in STEPS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown step(s) {bad}; choose from {', '.join(STEPS)}")
    return names


def _precision_list(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in vals if x not in MATMUL_PRECISIONS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give comma-separated values of {', '.join(MATMUL_PRECISIONS)}, e.g. "
            "highest,medium")
    return list(dict.fromkeys(vals))


def _dropout_list(text: str) -> list[float]:
    vals: list[float] = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            v = float(x)
        except ValueError:
            v = float("nan")
        if not 0.0 <= v < 1.0:
            raise argparse.ArgumentTypeError(
                f"{x!r} is not a dropout probability: give comma-separated numbers in [0, 1), "
                "e.g. 0,0.5 (0 is the seed tutorial's model)")
        if v not in vals:
            vals.append(v)
    if not vals:
        raise argparse.ArgumentTypeError("give at least one dropout value, e.g. 0,0.5")
    return vals


def _family_list(text: str) -> list[str]:
    names: list[str] = []
    for x in (x.strip() for x in text.split(",")):
        if x and x not in names:
            names.append(x)
    bad = [n for n in names if n not in FAMILIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown graph family {', '.join(map(repr, bad)) or repr(text)}; choose from "
            f"{', '.join(FAMILIES)} (comma-separated), or benchmark a partition set of your "
            "own with --parts DIR")
    return names


_positive_int = at_least(1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Benchmark mfgserve against DGL's DataLoader + NeighborSampler pipeline "
                    "on the same graphs, model, initialisation, optimizer, fanouts and batch "
                    "size. The last stdout line is a JSON summary; progress and a table go "
                    "to stderr. Exit code 0: every measurement ran; 1: some failed (errors "
                    "in the JSON); 2: bad options.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--parts", help="benchmark this partition set (made by partition-ogbn), "
                     "reported as family 'given'; default: the graphs of --family")
    src.add_argument("--synthetic-nodes", type=int, default=1_000_000,
                     help="nodes of each generated graph (default 1000000)")
    p.add_argument("--family", type=_family_list, default=None,
                   help="comma-separated graph families, each generated (cached under "
                        "--cache-dir) and measured in this run with its own ratios: products "
                        "(the products-shaped synthetic generator), rmat (RMAT graph, skewed "
                        "degrees, OGB binary layout read by partition-ogbn). Default "
                        "products,rmat; not with --parts")
    p.add_argument("--dropout", type=_dropout_list, default=[0.0, 0.5],
                   help="comma-separated dropout values, each run on both sides with the same "
                        "model; 0 is the seed tutorial's model (SAGEConv mean, ReLU, no "
                        "dropout): the headline row (default 0,0.5)")
    p.add_argument("--avg-degree", type=float, default=20.0,
                   help="generated graphs: directed edges per node (default 20)")
    p.add_argument("--feat-dim", type=int, default=100,
                   help="generated graphs: feature size (100)")
    p.add_argument("--num-classes", type=int, default=47, help="generated graphs: classes (47)")
    p.add_argument("--train-frac", type=float, default=0.025,
                   help="generated graphs: fraction of nodes that are training seeds (0.025)")
    p.add_argument("--eval-frac", type=float, default=0.005,
                   help="generated graphs: fraction of nodes in each of valid and test (0.005)")
    for q, what in (("a", "quadrant probability a"), ("b", "quadrant probability b"),
                    ("c", "quadrant probability c"), ("noise", "per-level noise")):
        p.add_argument(f"--rmat-{q}", type=float, default=None,
                       help=f"rmat family: the generator's {what} (default: partition.rmat's, "
                            "Graph500 a,b,c = 0.57,0.19,0.19, noise 0.1)")
    p.add_argument("--cache-dir", default="data/bench",
                   help="where generated partition sets are cached (default data/bench)")
    p.add_argument("--fanouts", type=int_list, default=[15, 10, 5],
                   help="neighbours per layer, input layer first (default 15,10,5)")
    p.add_argument("--batch-size", type=int, default=1024, help="seeds per batch (1024)")
    p.add_argument("--hidden", type=int, default=256, help="GraphSAGE hidden size (256)")
    p.add_argument("--epochs", type=int, default=1, help="training epochs (default 1)")
    p.add_argument("--rounds", type=_positive_int, default=1,
                   help="measure the end-to-end training rows (DGL and worker mode, each "
                        "dropout) this many times per family, alternating which side goes "
                        "first; a row's ratio is then the median of the rounds' ratios, each "
                        "pairing two runs made back to back, so that a machine whose speed "
                        "drifts moves both sides of a round alike; the datapath step is "
                        "measured as many rounds the same way (default 1; 3 on a shared "
                        "machine)")
    p.add_argument("--max-batches", type=int, default=None,
                   help="cap on DGL training batches per epoch (per process under DDP) and "
                        "per evaluation pass, and the batch count of the sample-only "
                        "measurements (default: full epochs; 30 sample-only batches, 90 in the "
                        "datapath step). "
                        "worker-mode always runs full epochs")
    p.add_argument("--dgl-workers", type=int_list, default=[0, 1],
                   help="DGL DataLoader num_workers values to measure (default 0,1)")
    p.add_argument("--num-trainers", type=int, default=1,
                   help="worker-mode trainers of the worker step (1); each takes --batch-size")
    p.add_argument("--ddp-procs", type=_positive_int, default=2,
                   help="ddp step: DGL DDP processes and worker-mode trainers, each with "
                        "--batch-size / this many seeds per batch (default 2)")
    p.add_argument("--local-features", choices=list(LOCAL_FEATURE_MODES), default="auto",
                   help="worker-mode's --local-features: its CPU trainer reads the input "
                        "features from the parts' memory-mapped feature files instead of "
                        "the servers gathering them into the ring (default auto: where it "
                        "applies; off: the servers' gather, as before session 53)")
    p.add_argument("--cpu-gemm", choices=list(CPU_GEMMS), default="auto",
                   help="mfgserve's --cpu-gemm: the library of its model's float32 products "
                        "on the CPU (worker mode, and mfgserve's side of the step module): "
                        "auto (default: oneDNN on an AMD Zen 5 or later, cpu family >= 26, "
                        "with AVX-512, else MKL), mkl (torch's own, as DGL's side multiplies) "
                        "or onednn. DGL's side always multiplies as its pipeline does (torch's "
                        "nn.Linear: MKL)")
    p.add_argument("--num-threads", type=_positive_int, default=None,
                   help="torch (and DGL) threads of each training process on both sides: the "
                        "DGL process / each DDP process, each worker-mode trainer, and the "
                        "step/datapath/limits modules (default: each side's default: torch's "
                        "for DGL, cores / trainers for worker-mode and DDP on the CPU, 1 for a "
                        "worker-mode trainer on a GPU)")
    p.add_argument("--matmul-precision", type=_precision_list, default=["highest"],
                   help="comma-separated float32 matrix-product precisions "
                        "(torch.set_float32_matmul_precision), each training row run at each "
                        "on both sides (DGL in this process, worker mode by its "
                        "--matmul-precision): highest (default): float32, the seed "
                        "tutorial's; medium: bfloat16 products on a CPU with bfloat16 "
                        "instructions (docs/tuning.md), DGL also run under torch.autocast "
                        "(cpu, bfloat16) there; high: TF32 on an NVIDIA GPU. A row at another precision "
                        "than highest is compared with DGL's best at that dropout over that "
                        "precision, autocast and highest (DGL's shapes change every batch, and oneDNN "
                        "builds a kernel per shape: bfloat16 can be slower for it). The first "
                        "value is the precision of the ddp row and the step / datapath / "
                        "limits modules")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both sides' models compute: cpu (default), or cuda: worker-mode "
                        "trainers get --device cuda and DGL's side runs its GPU recipe (DGL "
                        "samples on the CPU; its PyPI wheels have no CUDA kernels, so the same "
                        "plain-torch GraphSAGE computes on the GPU, see "
                        "benchmarks/dgl_pipeline.py); the ddp step then needs a GPU per process")
    p.add_argument("--worker-servers", type=_positive_int, default=1,
                   help="worker-mode's --servers-per-part: sampler servers of the one part "
                        "(default 1)")
    p.add_argument("--server-workers", type=int, default=2,
                   help="sampling threads per mfgserve server (default 2)")
    p.add_argument("--sampler-procs", type=int_list, default=[0, 2],
                   help="server-alone: measure once per value of sampler-server "
                        "--sampler-procs (0: --server-workers threads; default 0,2)")
    p.add_argument("--worker-sampler-procs", type=int, default=0,
                   help="worker-mode servers' --sampler-procs (default 0: threads)")
    p.add_argument("--shm-ring", action=argparse.BooleanOptionalAction, default=True,
                   help="server-alone client and worker-mode trainers offer servers "
                        "shared-memory ring slots for the features (default: on)")
    p.add_argument("--inflight", type=int, default=4,
                   help="requests in flight: server-alone client and worker-mode trainers (4)")
    p.add_argument("--prefetch", choices=list(PREFETCH_MODES), default="auto",
                   help="worker-mode trainers' --prefetch (default auto: one trainer with "
                        "every core alternates sampling and compute; see docs/configuration.md)")
    p.add_argument("--cache-ratio", type=float, default=0.0,
                   help="worker-mode trainers' feature cache ratio (0: no cache)")
    p.add_argument("--datapath-cache-ratio", type=float, default=0.2,
                   help="datapath step: one more 1-server row with the trainer's feature "
                        "cache holding this share of the hottest nodes (what a GPU trainer "
                        "keeps in GPU memory); its ratios are suffixed _cache and are not the "
                        "headline (default 0.2; 0: no such row)")
    p.add_argument("--feat-transfer", default="", choices=["", "float16", "bfloat16"],
                   help="worker-mode feature dtype on the wire (default: as stored)")
    from benchmarks.hetero import add_args as hetero_args

    hetero_args(p)
    from benchmarks.multilabel import add_args as multilabel_args

    multilabel_args(p)
    p.add_argument("--skip", type=_skip_list, default=[],
                   help=f"comma-separated steps to skip: {', '.join(STEPS)}")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--worker-timeout-s", type=float, default=1800.0,
                   help="stop a worker-mode run or the DGL DDP processes after this many "
                        "seconds (1800)")
    p.add_argument("--worker-work-dir", default=None,
                   help="worker-mode's --work-dir: where its run directories go (default: "
                        "worker-mode's own, data/worker-mode)")
    p.add_argument("--out", help="also write the JSON summary to this file")
    add_malloc_arg(p)
    return p


def dlabel(p: float, precision: str = "highest") -> str:
    """The suffix of a per-dropout result name: ``d0``, ``d0.5``; at a matmul precision
    other than highest, ``d0_medium``."""
    return f"d{p:g}" if precision == "highest" else f"d{p:g}_{precision}"


def variants(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(dropout, matmul precision) of every end-to-end training row, the headline first."""
    h = headline_dropout(args.dropout)
    ps = [h] + [x for x in args.dropout if x != h]
    return [(p, q) for q in args.matmul_precision for p in ps]


@contextmanager
def matmul_precision(precision: str):
    """``torch.set_float32_matmul_precision(precision)`` inside the block (DGL's side)."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def headline_dropout(dropouts: list[float]) -> float:
    """0 (the seed tutorial's model) when measured, else the first value."""
    return 0.0 if 0.0 in dropouts else dropouts[0]


def row_label(p: float, precision: str = "highest") -> str:
    label = "seed model (no dropout)" if p == 0 else f"dropout {p:g}"
    return label if precision == "highest" else f"{label}, matmul {precision}"


# ------------------------------------------------------------------------------ inputs


def family_parts(family: str, args: argparse.Namespace) -> Path:
    """The cached 1-part partition set of ``family`` (benchmarks.graphs.family_parts)."""
    from benchmarks import graphs

    fn = getattr(graphs, "family_parts", None)
    if fn is None:
        raise RuntimeError("benchmarks.graphs has no family_parts(family, args): cannot make "
                           f"the {family!r} graph; benchmark a partition set with --parts DIR")
    return Path(fn(family, args))


def synthetic_parts(args: argparse.Namespace) -> Path:
    """The products-family graph described by ``args`` (kept for older callers)."""
    return family_parts("products", args)


# ------------------------------------------------------------------------------ steps


def run_worker_mode(parts: Path, args: argparse.Namespace, dropout: float,
                    num_trainers: int | None = None, batch_size: int | None = None,
                    precision: str | None = None) -> dict:
    """``deploy.worker_mode`` in a subprocess; its last stdout line is the JSON summary.
    ``batch_size`` is per trainer (default ``--batch-size``), ``precision`` its
    ``--matmul-precision`` (default the first of ``--matmul-precision``)."""
    precision = precision or args.matmul_precision[0]
    num_trainers = num_trainers or args.num_trainers
    batch_size = batch_size or args.batch_size
    argv = [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts),
            "--num-trainers", str(num_trainers), "--epochs", str(args.epochs),
            "--fanouts", ",".join(map(str, args.fanouts)), "--batch-size", str(batch_size),
            "--hidden", str(args.hidden), "--seed", str(args.seed), "--model", "sage",
            "--dropout", str(dropout), "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY),
            "--max-inflight", str(args.inflight), "--prefetch", args.prefetch,
            "--device", args.device, "--servers-per-part", str(args.worker_servers),
            "--server-num-workers",
            str(args.server_workers), "--server-sampler-procs",
            str(args.worker_sampler_procs), "--no-progress",
            "--shm-ring" if args.shm_ring else "--no-shm-ring",
            "--malloc-retain-mb", str(args.malloc_retain_mb),
            "--server-malloc-retain-mb", str(args.malloc_retain_mb),
            "--matmul-precision", precision, "--cpu-gemm", args.cpu_gemm,
            "--local-features", args.local_features]
    if args.num_threads:
        argv += ["--num-threads", str(args.num_threads)]
    if args.cache_ratio:
        argv += ["--cache-ratio", str(args.cache_ratio)]
    if args.feat_transfer:
        argv += ["--feat-transfer", args.feat_transfer]
    if args.worker_work_dir:
        argv += ["--work-dir", args.worker_work_dir]
    release_memory()
    log("worker-mode: " + " ".join(argv[1:]))
    parent_rss = _rss_mb()
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
    keep = ("seeds_per_s", "train_s", "test_acc", "valid_acc", "test_rocauc", "valid_rocauc",
            "best_epoch", "final_loss", "batches_per_epoch_per_trainer", "num_trainers",
            "bytes_received", "stages_s", "prepare_s", "startup_s", "launcher_wall_s",
            "teardown", "cache", "shm_ring", "prefetch", "core_turns", "omp_wait_policy", "device",
            "h2d_hidden_share")
    res = {k: summary[k] for k in keep if k in summary}
    batches = summary.get("batches_per_epoch_per_trainer", 0) * summary.get("epochs", 1) * \
        summary.get("num_trainers", 1)
    if summary.get("train_s"):
        res["batches_per_s"] = round(batches / summary["train_s"], 3)
        res["mb_per_s"] = round(summary.get("bytes_received", 0) / summary["train_s"] / 1e6, 2)
    res.update(dropout=dropout, matmul_precision=precision, batch_size_per_trainer=batch_size,
               total_batch_size=batch_size * num_trainers,
               num_threads_arg=args.num_threads, exit_code=proc.returncode,
               subprocess_wall_s=round(wall, 3), bench_process_rss_mb=parent_rss)
    return res


def _rss_mb() -> float | None:
    """This process's resident memory (MB), beside which a worker-mode run ran."""
    try:
        import psutil

        return round(psutil.Process().memory_info().rss / 1e6, 1)
    except Exception:  # noqa: BLE001 - evidence only
        return None


#: what each measurement records of the machine around it, beside its figures: the 1-minute
#: load average before and after, and the share of the machine's CPU time its hypervisor gave
#: other guests meanwhile (steal; :func:`benchmarks.report.steal_share`)
EVIDENCE_KEYS = ("loadavg_1m", "cpu_steal_share")


class Steps:
    """The measurements of one run, per family: each one's result, or its error (one failed
    measurement must not lose the others)."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, dict]] = {}
        self.errors: dict[str, str] = {}
        self.module_results: dict[str, list[str]] = {}  # family -> names step modules returned

    def _attempt(self, where: str, fn):
        log(f"{where}: start")
        t0 = time.perf_counter()
        load0, times0 = os.getloadavg()[0], cpu_times()
        try:
            out = fn()
        except Exception as e:  # one failed measurement must not lose the others
            self.errors[where] = f"{type(e).__name__}: {e}"
            log(f"{where}: FAILED after {time.perf_counter() - t0:.1f}s\n"
                f"{traceback.format_exc()}")
            return None
        # Other processes on the machine, and other guests on its host, distort every figure:
        # keep the evidence (EVIDENCE_KEYS).
        seen = {"loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                "cpu_steal_share": steal_share(times0, cpu_times())}
        log(f"{where}: done in {time.perf_counter() - t0:.1f}s: {json.dumps(out)}")
        return out, seen

    def run(self, family: str, name: str, fn) -> None:
        got = self._attempt(f"{family}/{name}", fn)
        if got is not None:
            res, seen = got
            res.update(seen)
            self.results.setdefault(family, {})[name] = res

    def run_many(self, family: str, name: str, fn) -> None:
        """``fn`` returns {result_name: figures}, each stored under the family."""
        def checked():
            out = fn()
            if not isinstance(out, dict) or not all(isinstance(v, dict) for v in out.values()):
                raise TypeError(f"{name}: run_step returned {type(out).__name__}, expected "
                                "{result_name: figures_dict}")
            return out

        got = self._attempt(f"{family}/{name}", checked)
        if got is not None:
            out, seen = got
            for k, v in out.items():
                for key, value in seen.items():
                    v.setdefault(key, value)
                self.results.setdefault(family, {})[k] = v
                self.module_results.setdefault(family, []).append(k)


def _dgl_warmup(fg, args: argparse.Namespace) -> None:
    """One-time costs of this process (lazy imports, thread pools, first touches of a freshly
    loaded graph) would otherwise land on the first configuration alone, the headline's DGL
    side: a short untimed run first. (worker-mode's trainer is a fresh process every time:
    its first batch stays in its figure, so this can only favour DGL.)"""
    from benchmarks import dgl_pipeline

    t0 = time.perf_counter()
    dgl_pipeline.train_dgl(fg, args.fanouts, args.batch_size, 1, hidden=args.hidden,
                           max_batches=DGL_WARMUP_BATCHES, seed=args.seed,
                           dropout=args.dropout[0], num_threads=args.num_threads,
                           device=args.device)
    log(f"DGL warm-up ({DGL_WARMUP_BATCHES} batches, untimed) took "
        f"{time.perf_counter() - t0:.1f}s")


AUTOCAST = "-autocast"  # the name suffix of DGL's runs under torch.autocast (bfloat16)


def _dgl_train(steps: Steps, family: str, fg, args: argparse.Namespace, p: float,
               suffix: str = "", precision: str = "highest") -> None:
    """DGL training at dropout ``p`` and matmul ``precision``, once per ``--dgl-workers``
    value. At ``medium`` on the CPU, once more each under ``torch.autocast("cpu",
    bfloat16)``: DGL's own way to bfloat16 products where torch's ``medium`` computes
    float32 (an AMD Zen 4), a candidate for DGL's best of that row."""
    import torch

    from benchmarks import dgl_pipeline

    def train(w: int, autocast: bool = False) -> dict:
        # no weight cache: it lives as long as the context, which spans the whole training
        # loop here, and would keep the first step's bfloat16 weights (DGL then learns
        # nothing); each op casts afresh, what a context per forward pass costs
        cast = (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if autocast
                else nullcontext())
        with matmul_precision(precision), cast:
            res = dgl_pipeline.train_dgl(
                fg, args.fanouts, args.batch_size, args.epochs, hidden=args.hidden,
                num_workers=w, max_batches=args.max_batches, seed=args.seed, dropout=p, lr=LR,
                weight_decay=WEIGHT_DECAY, num_threads=args.num_threads, device=args.device)
        return {**res, "matmul_precision": precision, "autocast_bf16": autocast}

    for w in args.dgl_workers:
        steps.run(family, f"dgl_train_w{w}_{dlabel(p, precision)}{suffix}",
                  lambda w=w: train(w))
        if precision == "medium" and args.device == "cpu":
            steps.run(family, f"dgl_train_w{w}_{dlabel(p, precision)}{AUTOCAST}{suffix}",
                      lambda w=w: train(w, autocast=True))


def measure_dgl(steps: Steps, family: str, parts: Path, args: argparse.Namespace,
                sample_batches: int) -> None:
    """The DGL steps: training for each dropout and ``--dgl-workers`` value, then sample +
    gather. The full graph is freed when this returns."""
    from benchmarks import dgl_pipeline

    fg = _load_full_graph(parts)
    if "dgl-train" not in args.skip:
        _dgl_warmup(fg, args)
        for p, q in variants(args):
            _dgl_train(steps, family, fg, args, p, precision=q)
    if "dgl-sample" not in args.skip:
        for w in args.dgl_workers:
            steps.run(family, f"dgl_sample_w{w}", lambda w=w: dgl_pipeline.sample_only_dgl(
                fg, args.fanouts, args.batch_size, sample_batches, num_workers=w,
                seed=args.seed, num_threads=args.num_threads))


def _load_full_graph(parts: Path):
    from benchmarks import dgl_pipeline

    log(f"loading the full graph for DGL from {parts}")
    fg = dgl_pipeline.load_full_graph(parts)
    log(f"loaded in {fg.load_s:.1f}s")
    return fg


def measure_rounds(steps: Steps, family: str, parts: Path, args: argparse.Namespace) -> None:
    """Rounds 2..``--rounds`` of the end-to-end training rows (round 1 is the ordinary
    flow): per round and dropout, DGL and worker mode back to back, worker mode first in
    even rounds; results named ``<name>_r<round>``."""
    sides = [s for s in ("dgl-train", "worker") if s not in args.skip]  # the --skip names
    if args.rounds < 2 or not sides:
        return
    dgl = _DGLGraph(parts, args)
    for r in range(2, args.rounds + 1):
        suffix = f"_r{r}"
        log(f"{family}: round {r} of {args.rounds}, "
            f"{'worker mode' if r % 2 == 0 else 'DGL'} first")
        for p, q in variants(args):
            for side in (sides[::-1] if r % 2 == 0 else sides):
                if side == "dgl-train":
                    _dgl_train(steps, family, dgl.get(), args, p, suffix, q)
                else:
                    dgl.release()  # (worker mode runs with DGL's graph freed: see _DGLGraph)
                    steps.run(family, f"worker_mode_{dlabel(p, q)}{suffix}",
                              lambda p=p, q=q: run_worker_mode(parts, args, p, precision=q))
    dgl.release()


class _DGLGraph:
    """DGL's full graph for the rounds' DGL runs, loaded (and warmed up, untimed) when a DGL
    run needs it and freed before each worker-mode run: each side runs with the other's
    memory returned. Worker mode run beside this process holding DGL's graph (1.5 GB of
    heap, idle) trained 13-20% slower on the products-shaped graph (forward/backward 3.2-3.4
    s against 2.8-2.9 s; docs/benchmarks.md, "Issue 14, session 57"), and DGL's runs never
    have worker mode's memory beside them."""

    def __init__(self, parts: Path, args: argparse.Namespace):
        self.parts, self.args, self.fg = parts, args, None

    def get(self):
        if self.fg is None:
            self.fg = _load_full_graph(self.parts)
            _dgl_warmup(self.fg, self.args)
        return self.fg

    def release(self) -> None:
        self.fg = None
        release_memory()


def release_memory() -> None:
    """This process's garbage collected and its heap's free memory returned to the OS
    (``--malloc-retain-mb`` keeps it otherwise): before each worker-mode run, which should
    not run beside the memory DGL's side left here."""
    from common.alloc import return_freed_memory

    gc.collect()
    return_freed_memory()


def measure_mfgserve(steps: Steps, family: str, parts: Path, args: argparse.Namespace,
                     sample_batches: int) -> None:
    """The mfgserve steps not skipped: server alone (per ``--sampler-procs``), worker mode
    (per dropout)."""
    if "server" not in args.skip:
        from benchmarks.server_only import measure_server

        for n in args.sampler_procs:
            steps.run(family, "server_only" + (f"_procs{n}" if n else ""),
                      lambda n=n: measure_server(
                          parts, args.fanouts, args.batch_size, sample_batches,
                          inflight=args.inflight, server_workers=args.server_workers,
                          seed=args.seed, shm_ring=args.shm_ring, sampler_procs=n))
    if "worker" not in args.skip:
        for p, q in variants(args):
            steps.run(family, f"worker_mode_{dlabel(p, q)}",
                      lambda p=p, q=q: run_worker_mode(parts, args, p, precision=q))


def measure_ddp(steps: Steps, family: str, parts: Path, args: argparse.Namespace) -> None:
    """Two (``--ddp-procs``) trainers on one node at the headline dropout, the same total
    batch: DGL DDP over gloo, then worker mode."""
    from benchmarks import dgl_pipeline

    n = args.ddp_procs
    p = headline_dropout(args.dropout)
    q = args.matmul_precision[0]
    steps.run(family, f"dgl_ddp{n}_{dlabel(p, q)}", lambda: dgl_pipeline.train_dgl_ddp(
        parts, args.fanouts, args.batch_size, args.epochs, hidden=args.hidden, nprocs=n,
        max_batches=args.max_batches, seed=args.seed, dropout=p, lr=LR,
        weight_decay=WEIGHT_DECAY, num_threads=args.num_threads,
        timeout_s=args.worker_timeout_s, malloc_retain_mb=args.malloc_retain_mb,
        matmul_precision=args.matmul_precision[0]))
    steps.run(family, f"worker_mode_t{n}_{dlabel(p, q)}", lambda: run_worker_mode(
        parts, args, p, num_trainers=n, batch_size=args.batch_size // n))


def step_args(args: argparse.Namespace, dropout: float, family: str) -> argparse.Namespace:
    """The Namespace a step module gets: this run's options with ``dropout`` one float."""
    return argparse.Namespace(**{**vars(args), "dropout": dropout, "dropouts": args.dropout,
                                 "family": family})


def measure_modules(steps: Steps, family: str, parts: Path, args: argparse.Namespace) -> None:
    """``benchmarks.{step,datapath,limits}.run_step(parts, args)``, imported here so that a
    missing or failing module is that step's error: ``step`` for each dropout, the model-free
    ones at the headline dropout."""
    import torch

    for name in MODULE_STEPS:
        if name in args.skip:
            continue
        dropouts = args.dropout if name == "step" else [headline_dropout(args.dropout)]
        for p in dropouts:
            def call(name=name, p=p):
                threads = torch.get_num_threads()
                try:
                    mod = importlib.import_module(f"benchmarks.{name}")
                    return mod.run_step(parts, step_args(args, p, family))
                finally:
                    torch.set_num_threads(threads)

            steps.run_many(family, f"{name}_{dlabel(p)}" if name == "step" else name, call)


# ------------------------------------------------------------------------------ summary


def _best(results: dict, names: list[str], key: str) -> tuple[str | None, float | None]:
    cands = [(k, results[k][key]) for k in names
             if isinstance(results.get(k), dict) and results[k].get(key)]
    return max(cands, key=lambda kv: kv[1]) if cands else (None, None)


def _seeds(results: dict, name: str | None) -> float | None:
    return results.get(name, {}).get("seeds_per_s") if name else None


def round_suffixes(args: argparse.Namespace) -> list[str]:
    """The result-name suffix of each round: "" for round 1, ``_r2``, ``_r3``, ..."""
    return [""] + [f"_r{r}" for r in range(2, args.rounds + 1)]


def dgl_names(args: argparse.Namespace, d: str, sfx: str = "") -> list[str]:
    """DGL's runs a row at label ``d`` is compared with: each ``--dgl-workers`` value, at
    the row's precision and, for a row at another precision, at highest too, and under
    autocast (DGL's best; a name not measured is skipped)."""
    labels = [d] if "_" not in d else [d, d + AUTOCAST, d.split("_", 1)[0]]
    return [f"dgl_train_w{w}_{x}{sfx}" for x in labels for w in args.dgl_workers]


def _round_sides(results: dict, args: argparse.Namespace, d: str, sfx: str
                 ) -> tuple[float | None, float | None]:
    """(DGL's best seeds/s, worker mode's seeds/s) of one round at label ``d``."""
    _, base = _best(results, dgl_names(args, d, sfx), "seeds_per_s")
    return base, _seeds(results, f"worker_mode_{d}{sfx}")


def round_ratios(results: dict, args: argparse.Namespace, d: str) -> list[float]:
    """Each round's ratio at dropout label ``d`` (worker mode / that round's best DGL run),
    for the rounds where both sides were measured."""
    out = []
    for sfx in round_suffixes(args):
        dgl, ours = _round_sides(results, args, d, sfx)
        r = ratio(ours, dgl)
        if r is not None:
            out.append(r)
    return out


def _median_seeds(results: dict, args: argparse.Namespace, d: str, side: int) -> float | None:
    vals = [v for v in (_round_sides(results, args, d, sfx)[side]
                        for sfx in round_suffixes(args)) if v]
    return round(statistics.median(vals), 1) if vals else None


def compute_ratios(results: dict, args: argparse.Namespace,
                   module_results: list[str] = ()) -> dict:
    """One family's ratios (mfgserve / DGL)."""
    ratios: dict = {}
    for p, q in variants(args):
        d = dlabel(p, q)
        names = dgl_names(args, d)
        base_key, _ = _best(results, names, "seeds_per_s")  # round 1's best
        wm = _seeds(results, f"worker_mode_{d}")
        per_round = round_ratios(results, args, d)
        ratios[f"train_seeds_per_s_{d}"] = (round(statistics.median(per_round), 3)
                                            if per_round else None)
        ratios[f"train_seeds_per_s_{d}_rounds"] = per_round
        ratios[f"train_baseline_{d}"] = base_key
        for k in names:
            if _seeds(results, k):
                ratios[f"train_seeds_per_s_{d}_vs_{k}"] = ratio(wm, _seeds(results, k))
        dgl_acc = results.get(base_key, {}).get("test_acc") if base_key else None
        wm_acc = results.get(f"worker_mode_{d}", {}).get("test_acc")
        if dgl_acc is not None and wm_acc is not None:
            ratios[f"test_acc_diff_{d}"] = round(wm_acc - dgl_acc, 4)  # mfgserve minus DGL
    n, d = args.ddp_procs, dlabel(headline_dropout(args.dropout), args.matmul_precision[0])
    ratios[f"ddp_seeds_per_s_{d}"] = ratio(_seeds(results, f"worker_mode_t{n}_{d}"),
                                           _seeds(results, f"dgl_ddp{n}_{d}"))
    sample_names = [f"dgl_sample_w{w}" for w in args.dgl_workers]
    dgl_sample_key, dgl_sample = _best(results, sample_names, "batches_per_s")
    srv_names = [k for k in results if k.startswith("server_only")]
    srv_key, srv = _best(results, srv_names, "batches_per_s")
    ratios["sample_batches_per_s"] = ratio(srv, dgl_sample)
    ratios["sample_baseline"] = dgl_sample_key
    ratios["sample_mfgserve_config"] = srv_key
    for k in sample_names:
        if results.get(k, {}).get("batches_per_s"):
            ratios[f"sample_batches_per_s_vs_{k}"] = ratio(srv, results[k]["batches_per_s"])
    for name in module_results:  # surfaced as the modules computed them
        all_ratios = "ratio" in name  # e.g. datapath's "datapath-ratios" result
        for k, v in results.get(name, {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) \
                    and k not in EVIDENCE_KEYS \
                    and (all_ratios or any(t in k for t in ("ratio", "_vs_", "_of_"))):
                ratios[f"{name}_{k}"] = v
    return ratios


def comparison_rows(results: dict, ratios: dict, args: argparse.Namespace) -> list[dict]:
    """The end-to-end rows per family: the headline dropout first, then the others, then
    the DDP row; rows with neither side measured are left out."""
    h = headline_dropout(args.dropout)
    rows = []
    for family, res in results.items():
        r = ratios.get(family, {})
        rows += _family_rows(family, res, r, args, h)
    return [row for row in rows if row["dgl_seeds_per_s"] or row["mfgserve_seeds_per_s"]]


def _family_rows(family: str, res: dict, r: dict, args: argparse.Namespace,
                 h: float) -> list[dict]:
    """One family's rows: each dropout (the headline first), then the DDP row."""
    rows = []
    for p, q in variants(args):
        d = dlabel(p, q)
        base = r.get(f"train_baseline_{d}")
        rows.append({"family": family, "label": row_label(p, q), "dropout": p,
                     "matmul_precision": q, "trainers": 1,
                     "dgl": base, "dgl_seeds_per_s": _median_seeds(res, args, d, 0),
                     "mfgserve": f"worker_mode_{d}",
                     "mfgserve_seeds_per_s": _median_seeds(res, args, d, 1),
                     "ratio": r.get(f"train_seeds_per_s_{d}"),
                     "rounds": r.get(f"train_seeds_per_s_{d}_rounds") or []})
    q = args.matmul_precision[0]
    n, d = args.ddp_procs, dlabel(h, q)
    rows.append({"family": family, "label": f"{row_label(h, q)}, {n} trainers", "dropout": h,
                 "trainers": n, "dgl": f"dgl_ddp{n}_{d}",
                 "dgl_seeds_per_s": _seeds(res, f"dgl_ddp{n}_{d}"),
                 "mfgserve": f"worker_mode_t{n}_{d}",
                 "mfgserve_seeds_per_s": _seeds(res, f"worker_mode_t{n}_{d}"),
                 "ratio": r.get(f"ddp_seeds_per_s_{d}"), "rounds": []})
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def _pct(share: float | None) -> str:
    """A share as a percentage with one decimal (``-`` when unknown)."""
    return "-" if share is None else f"{100 * share:.1f} %"


def _columns(rows: list[tuple]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def print_table(summary: dict) -> None:
    m, c = summary["machine"], summary["config"]
    out = [f"\nmachine: {m['cores']} cores, {m['ram_gb']} GB, torch {m['torch']}, dgl {m['dgl']}, "
           f"python {m['python']}, load avg {m['loadavg_start']} -> {m.get('loadavg_end')}, "
           f"cpu steal {_pct(m.get('cpu_steal_share'))}; "
           f"fanouts {c['fanouts']}, batch {c['batch_size']}, hidden {c['hidden']}, "
           f"threads {c['num_threads'] or 'default'}, "
           f"matmul precision {','.join(c.get('matmul_precision') or ['highest'])}"]
    rounds = c.get("rounds", 1)
    head = ("end to end, training seeds/s", "DGL best", "mfgserve", "ratio")
    if rounds > 1:
        out.append(f"{rounds} rounds: median seeds/s per side; ratio = median of the rounds' "
                   "ratios (each pairs two runs made back to back)")
    rows = [head + (("rounds' ratios",) if rounds > 1 else ())]
    for r in summary["comparison"]:
        row = (f"{r['family']}: {r['label']}", _fmt(r["dgl_seeds_per_s"]),
               _fmt(r["mfgserve_seeds_per_s"]), _fmt(r["ratio"]))
        if rounds > 1:
            row += (" / ".join(f"{x:.2f}" for x in r.get("rounds", [])) or "-",)
        rows.append(row)
    out += _columns(rows)
    for family in summary["families"]:
        g = summary["graphs"].get(family)
        if g:
            out.append(f"\n{family}: {g.get('dataset')}: {g.get('num_nodes'):,} nodes, "
                       f"{g.get('num_edges'):,} edges, {g.get('num_train'):,} train seeds")
        else:
            out.append(f"\n{family}: no graph")
        rows = [("measurement", "batches/s", "seeds/s", "MB/s", "train_s", "test_acc",
                 "cpu steal")]
        for k, v in summary["results"].get(family, {}).items():
            rows.append((k, _fmt(v.get("batches_per_s")), _fmt(v.get("seeds_per_s")),
                         _fmt(v.get("mb_per_s", v.get("feat_mb_per_s"))),
                         _fmt(v.get("train_s")), _fmt(v.get("test_acc")),
                         _pct(v.get("cpu_steal_share"))))
        for k, e in summary["errors"].items():
            if k.startswith(family + "/"):
                rows.append((k.split("/", 1)[1], "FAILED", e.splitlines()[0][:60] if e else "",
                             "", "", "", ""))
        out += _columns(rows)
        r = summary["ratios"].get(family, {})
        others = {k: v for k, v in r.items() if v is not None and not k.startswith(
            ("train_seeds_per_s", "train_baseline", "ddp_seeds_per_s"))}
        out.append("other ratios: " + ", ".join(f"{k} {_fmt(v)}" for k, v in others.items()))
    if "wire" in summary["errors"]:
        out.append(f"\nwire: FAILED {summary['errors']['wire'].splitlines()[0][:80]}")
    h = summary.get("hetero")
    if h:
        g, d, c, w = h["graph"], h["dgl"], h["dgl_heteroconv"], h["mfgserve"]
        out.append(f"\nheterogeneous ({g['papers']:,}-paper mag-shaped graph, {g['nodes']:,} "
                   f"nodes, {g['edges']:,} edges, {len(g['relations'])} relations; fanouts "
                   f"{h['fanouts']}, {h['epochs']} epochs):")
        out += _columns([("", "seeds/s", "test_acc"),
                         ("DGL pipeline, RelGraphSAGE (same model)", _fmt(d.get("seeds_per_s")),
                          _fmt(d.get("test_acc"))),
                         ("DGL pipeline, HeteroGraphConv(SAGEConv)",
                          _fmt(c.get("seeds_per_s")), _fmt(c.get("test_acc"))),
                         ("mfgserve worker mode, RelGraphSAGE", _fmt(w.get("seeds_per_s")),
                          _fmt(w.get("test_acc"))),
                         ("ratio (same model) / acc diff", _fmt(h.get("ratio")),
                          _fmt(h.get("acc_diff"))),
                         ("ratio vs HeteroGraphConv", _fmt(h.get("ratio_vs_heteroconv")), "")])
    elif "hetero" in summary["errors"]:
        out.append(f"\nhetero: FAILED {summary['errors']['hetero'].splitlines()[0][:80]}")
    ml = summary.get("multilabel")
    if ml:
        g = ml["graph"]
        out.append(f"\nmulti-label ({g['dataset']}: {g['nodes']:,} nodes, {g['edges']:,} edges, "
                   f"{g['num_tasks']} tasks, {g['num_train']:,} train seeds; {ml['epochs']} "
                   f"epochs, {row_label(ml['dropout'])}):")
        rows = [("round (first)", "DGL best", "mfgserve", "ratio", "test ROC-AUC DGL / ours")]
        for r in ml["rounds"]:
            d = r["dgl"][r["dgl_best_workers"]]
            rows.append((f"{r['round']} ({r['first']})",
                         f"{_fmt(d['seeds_per_s'])} (w{r['dgl_best_workers']})",
                         _fmt(r["mfgserve"]["seeds_per_s"]), _fmt(r["ratio"]),
                         f"{d['test_rocauc']:.4f} / {r['mfgserve']['test_rocauc']:.4f}"))
        rows.append(("median", _fmt(ml["dgl_seeds_per_s"]), _fmt(ml["mfgserve_seeds_per_s"]),
                     _fmt(ml["ratio"]), f"diff {ml['test_rocauc_diff']:+.4f}"))
        out += _columns(rows)
    elif "multilabel" in summary["errors"]:
        out.append(f"\nmultilabel: FAILED "
                   f"{summary['errors']['multilabel'].splitlines()[0][:80]}")
    print("\n".join(out) + "\n", file=sys.stderr, flush=True)


def graph_info(parts: Path, meta: PartitionSetMeta) -> dict:
    return {"parts_dir": str(parts), "dataset": meta.dataset, "num_parts": meta.num_parts,
            "num_nodes": meta.num_nodes, "num_edges": meta.num_edges,
            "feat_dim": meta.feat_dim, "num_classes": meta.num_classes,
            "num_train": sum(p.num_train for p in meta.parts),
            "num_valid": sum(p.num_valid for p in meta.parts),
            "num_test": sum(p.num_test for p in meta.parts)}


def run_config(args: argparse.Namespace, families: list[str], sample_batches: int) -> dict:
    return {"families": families, "dropouts": args.dropout,
            "headline_dropout": headline_dropout(args.dropout),
            "fanouts": args.fanouts, "batch_size": args.batch_size, "hidden": args.hidden,
            "lr": LR, "weight_decay": WEIGHT_DECAY, "optimizer": "Adam",
            "epochs": args.epochs, "rounds": args.rounds, "max_batches": args.max_batches,
            "sample_batches": sample_batches, "dgl_workers": args.dgl_workers,
            "num_trainers": args.num_trainers, "ddp_procs": args.ddp_procs,
            "num_threads": args.num_threads, "device": args.device,
            "matmul_precision": args.matmul_precision,
            "worker_servers": args.worker_servers, "server_workers": args.server_workers,
            "inflight": args.inflight, "prefetch": args.prefetch, "seed": args.seed,
            "skip": args.skip,
            "cache_ratio": args.cache_ratio, "feat_transfer": args.feat_transfer,
            "sampler_procs": args.sampler_procs,
            "worker_sampler_procs": args.worker_sampler_procs, "shm_ring": args.shm_ring,
            "worker_timeout_s": args.worker_timeout_s,
            "malloc_retain_mb": args.malloc_retain_mb,
            # this process's (DGL's side, the in-process steps); worker mode's trainers report
            # theirs in their results (deploy/worker_mode.py's child_env)
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
            "dgl_warmup_batches": DGL_WARMUP_BATCHES,
            "synthetic_nodes": None if args.parts else args.synthetic_nodes,
            "hetero": {"papers": args.hetero_papers, "epochs": args.hetero_epochs,
                       "fanouts": args.hetero_fanouts},
            "multilabel": {"nodes": args.multilabel_nodes, "degree": args.multilabel_degree,
                           "epochs": args.multilabel_epochs},
            "rmat": {q: getattr(args, f"rmat_{q}") for q in ("a", "b", "c", "noise")}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.parts and args.family is not None:
        parser.error("--family picks generated graphs; --parts DIR benchmarks the given set "
                     "(family 'given'): use one of them")
    if args.device == "cuda" and "ddp" not in args.skip:
        parser.error("--device cuda: the ddp step runs DGL's DDP over gloo on the CPU and would "
                     "put every worker-mode trainer on one GPU; add --skip ddp")
    if "ddp" not in args.skip and args.batch_size % args.ddp_procs:
        parser.error(f"--batch-size {args.batch_size} does not split over --ddp-procs "
                     f"{args.ddp_procs} (the ddp step keeps the total batch): choose a "
                     "multiple, or --skip ddp")
    return args


def measure_family(steps: Steps, family: str, parts: Path, args: argparse.Namespace,
                   sample_batches: int) -> None:
    if "dgl-train" not in args.skip or "dgl-sample" not in args.skip:
        measure_dgl(steps, family, parts, args, sample_batches)
        release_memory()
    measure_mfgserve(steps, family, parts, args, sample_batches)
    measure_rounds(steps, family, parts, args)
    if "ddp" not in args.skip:
        measure_ddp(steps, family, parts, args)
    measure_modules(steps, family, parts, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_malloc(args.malloc_retain_mb)  # DGL's side and the in-process steps; mfgserve's by flag
    import torch

    # DGL's runs set theirs per row; the ddp row and the step modules run at the first
    torch.set_float32_matmul_precision(args.matmul_precision[0])
    # --cpu-gemm for mfgserve's model code in this process (the step module's side, and the
    # typed row's DGL side, which runs mfgserve's RelGraphSAGE); dgl.nn multiplies via MKL
    from trainer_client.model import set_cpu_gemm

    set_cpu_gemm(args.cpu_gemm)
    warnings.filterwarnings("ignore", message=".*CPU affinity.*")
    t_start = time.perf_counter()
    machine, times_start = machine_info(), cpu_times()
    families = ["given"] if args.parts else (args.family or list(FAMILIES))
    sample_batches = args.max_batches or 30
    steps = Steps()
    graphs: dict[str, dict] = {}
    for family in families:
        log(f"=== family {family}")
        try:
            parts = Path(args.parts) if args.parts else family_parts(family, args)
            graphs[family] = graph_info(parts, PartitionSetMeta.load(parts))
        except Exception as e:  # this family's graph: its steps cannot run, the others can
            steps.errors[f"{family}/graph"] = f"{type(e).__name__}: {e}"
            log(f"{family}: no graph\n{traceback.format_exc()}")
            continue
        measure_family(steps, family, parts, args, sample_batches)
    wire = None
    if "wire" not in args.skip:
        from benchmarks.wire import measure_wire

        got = steps._attempt("wire", measure_wire)
        if got is not None:
            wire = {**got[0], **got[1]}

    hetero = None
    if "hetero" not in args.skip:
        from benchmarks.hetero import measure_hetero

        got = steps._attempt("hetero", lambda: measure_hetero(args))
        if got is not None:
            hetero = {**got[0], **got[1]}

    multilabel = None
    if "multilabel" not in args.skip:
        from benchmarks.multilabel import measure_multilabel

        got = steps._attempt("multilabel", lambda: measure_multilabel(args))
        if got is not None:
            multilabel = {**got[0], **got[1]}

    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    machine["cpu_steal_share"] = steal_share(times_start, cpu_times())
    ratios = {f: compute_ratios(steps.results.get(f, {}), args, steps.module_results.get(f, []))
              for f in families if f in graphs}
    h, q = headline_dropout(args.dropout), args.matmul_precision[0]
    headline = {"label": row_label(h, q), "dropout": h, "matmul_precision": q,
                "train_seeds_per_s": {f: r.get(f"train_seeds_per_s_{dlabel(h, q)}")
                                      for f, r in ratios.items()},
                "ddp_seeds_per_s": {f: r.get(f"ddp_seeds_per_s_{dlabel(h, q)}")
                                    for f, r in ratios.items()}}
    summary = {"machine": machine, "config": run_config(args, families, sample_batches),
               "families": families, "graphs": graphs,
               "results": {f: steps.results.get(f, {}) for f in graphs},
               "ratios": ratios, "headline": headline,
               "comparison": comparison_rows({f: steps.results.get(f, {}) for f in graphs},
                                             ratios, args),
               "wire": wire, "hetero": hetero, "multilabel": multilabel,
               "errors": steps.errors,
               "wall_s": round(time.perf_counter() - t_start, 1),
               "command": command_line("benchmarks.run", argv)}
    emit_summary(summary, args.out, print_table)
    return 1 if steps.errors else 0


if __name__ == "__main__":
    sys.exit(main())
