"""``python -m benchmarks.scalerun``: partition a products-shaped graph at 1x / 2x / 4x products
scale within ``--max-memory-gb``, then train a few hundred batches in worker mode on the
largest set (issue 12's "scale runs").

For each of ``--scales`` (multiples of ``--base-nodes``, default ogbn-products' 2,449,029
nodes; the average degree and feature size are the same at every scale), three steps, each a
subprocess with a timeout (``--step-timeout-s``, ``--train-timeout-s``) whose process tree
this process polls with psutil every ``--poll-s`` seconds:

1. ``generate``: ``partition-ogbn --dataset synthetic --raw-out RAW --raw-format binary
   --num-nodes N --avg-degree D --feat-dim F ...`` writes the graph in OGB's raw layout
   (binary: ``raw/data.npz`` + ``raw/node-label.npz``, as ogbn-papers100M ships; where this
   partition-ogbn has no ``--raw-format`` the csv layout is written and ``raw_format`` says
   so). Splits are products' by default: 8.03 % train, 1.61 % valid, the rest test.
2. ``partition``: ``partition-ogbn --dataset-dir RAW --add-reverse-edges --num-parts P
   --method M --max-memory-gb G --out PARTS``; its JSON summary (edge cut, balance, times,
   its own peak RSS) is kept whole and the polled peak RSS of its process tree added.
   RAW is deleted once this step has run (unless ``--keep``).
3. ``train`` (on ``--train-scales``, default the largest): ``worker-mode`` (one server per
   part, each memory-mapping its part; one trainer) for one epoch of ``--train-batches``
   batches. The trainer has no batch limit, so the run serves a *view* of PARTS
   (:func:`make_view`): a directory of symlinks to PARTS' arrays (the servers map exactly
   the same files) with the training split cut to ``--train-batches x --batch-size`` seeds
   and valid / test to ``--eval-seeds`` each, chosen by a hash of the original node id (the
   same nodes whatever the partitioning). The servers' RSS, PSS and USS (psutil
   ``memory_full_info``, summed over each server's process tree: its sampler processes
   included) are polled; ``startup_s`` is worker-mode's time from spawning the servers to
   every one answering a ping. PARTS is deleted after this step (unless ``--keep``).
   The trainer takes the features through worker-mode's shared-memory ring (``shm_ring`` in
   the entry says so), so ``bytes_per_batch`` is the reply without them; with
   ``--no-shm-ring`` every reply carries them on the socket, as from a server on another
   machine.
   ``--eval-every 0`` (valid / test once, after training) and no checkpoints.

Files: ``<work-dir>/scale-<scale>-<nodes>n/`` holds ``raw/`` (the generated graph),
``parts-<method>-<parts>/`` (the set) and ``work/`` (partition-ogbn's --work-dir, the view,
the trainer's run directory); all removed after the scale unless ``--keep``. Disk at 4x
products: ~8 GB raw + ~8.5 GB set + the partitioner's temporary buckets.

``benchmarks.capacity check --runs FILE`` reads this summary as it is (its
``runs_from_scalerun`` flattens each scale: ``partition.wall_s``, ``partition.peak_rss_bytes``,
``partition.parts_bytes``, ``train.bytes_per_batch``, ``train.server_to_server_bytes`` /
``train.batches``, ``train.server_cpu_ms_per_batch``, ``train.server_rss_max_bytes``,
``train.server_pss_max_bytes``): keep these names.

Output: progress (children's stderr, prefixed) and tables on stderr; the LAST stdout line is
one JSON object::

    {"machine": {...benchmarks.report.machine_info()},
     "config": {"scales", "base_nodes", "avg_degree", "feat_dim", "num_classes",
                "train_frac", "valid_frac", "labeled_frac", "feat_dtype", "raw_format",
                "parts", "method", "max_memory_gb", "train_scales", "train_batches",
                "batch_size", "fanouts", "eval_seeds", "seed", "work_dir", ...},
     "scales": [{
        "scale": 4.0, "nodes": 9796116,            # requested node count
        "generate": {"wall_s", "peak_rss_bytes",  # partition-ogbn's own (getrusage) figure
                     "peak_rss_polled_bytes",      # psutil poll of its process tree (sum)
                     "raw_bytes", "raw_format", "exit_code", "cli": {its JSON line}},
        "partition": {"wall_s", "peak_rss_bytes", "peak_rss_polled_bytes",
                      "peak_rss_polled_single_bytes",        # largest single process
                      "max_memory_bytes",                    # the budget asked for
                      "max_memory_applied",                  # false: no --max-memory-gb here
                      "within_budget",                       # polled and own peak < budget
                      "num_nodes", "num_edges",              # directed edges as stored
                      "edge_cut", "edge_cut_frac", "node_balance", "edge_balance",
                      "train_balance", "load_s", "partition_s", "total_s", "method",
                      "parts_bytes",                         # bytes of the partition set
                      "exit_code", "cli": {its JSON line}},
        "train": null | {
            "wall_s", "exit_code", "startup_s",    # startup_s: servers spawned -> all ready
            "seeds_per_s", "train_s", "batches", "batches_per_s", "epochs_done",
            "test_acc", "valid_acc", "final_loss",
            "bytes_received",                      # every reply the trainer received
            "train_bytes_received",                # ... for training batches (metrics.jsonl)
            "eval_batches",                        # evaluation batches after training
            "bytes_per_batch",                     # train_bytes_received / batches
            "bytes_per_batch_source",              # (else bytes_received / all batches)
            "epochs": [{"epoch", "epoch_s", "seeds_per_s", "bytes_received", "loss",
                        "valid_acc", "test_acc"}],   # metrics.jsonl, one per epoch
            "server_to_server_bytes", "server_to_server_requests",  # training batches only
            "server_to_server_bytes_per_batch",
            "stages_s": {...the trainer summary's}, "stage_ms_per_batch": {...per batch},
            "servers": [{"part", "pid", "peak_rss_bytes", "peak_pss_bytes", "peak_uss_bytes",
                         "cpu_s", "cpu_at_trainer_start_s", "processes"}],
            "server_rss_max_bytes", "server_pss_max_bytes", "server_uss_max_bytes",
                                                   # the largest server's peaks
            "server_rss_sum_bytes", "server_pss_sum_bytes",  # peak of the sum over servers
            "server_cpu_s",                        # servers' CPU seconds, startup included
            "server_serving_cpu_s",                # ... since the trainer started
            "server_cpu_ms_per_batch",             # serving CPU / (batches + eval_batches)
            "trainer_peak_rss_bytes", "parts_bytes", "shm_ring", "polls",
            "view": {"dir", "of", "splits_full", "splits"}}}],
     "growth": {...largest over smallest scale...},
     "errors": {"<scale>:<step>": "message"}, "wall_s", "command"}

Exit code 0 when every step ran, 1 when one failed (its error in ``errors``; the other
scales still run); 2 for bad options; 130 / 143 after SIGINT / SIGTERM (the running step's
process tree stopped, its directories removed, the summary of what ran still printed). Every byte count is bytes, every ``*_s`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from pathlib import Path

import numpy as np
import psutil

from benchmarks.report import (
    REPO,
    command_line,
    emit_summary,
    int_list,
    logger,
    process_cpu_s,
    ratio,
)
from common.cli import Interrupted, raise_on_signals

PRODUCTS_NODES = 2_449_029
PRODUCTS_EDGES = 61_859_140  # undirected
PRODUCTS_AVG_DEGREE = 2 * PRODUCTS_EDGES / PRODUCTS_NODES  # directed edges per node (~50.5)
PRODUCTS_TRAIN_FRAC = round(196_615 / PRODUCTS_NODES, 4)  # 0.0803
PRODUCTS_VALID_FRAC = round(39_323 / PRODUCTS_NODES, 4)  # 0.0161
SPLITS = ("train", "valid", "test")
BACKLOG_MB_WITHOUT_RING = 4096
log = logger("scalerun")


class StepError(RuntimeError):
    """A step's subprocess failed, timed out, or printed no JSON; the message says which."""


# ------------------------------------------------------------------------------ polling


def _server_part(cmdline: list[str]) -> int:
    """``--part-id`` of a ``sampler_server.main`` command line (launchers pass only options
    that differ from their defaults: absent means part 0)."""
    for i, a in enumerate(cmdline):
        if a.startswith("--part-id="):
            return int(a.split("=", 1)[1])
        if a == "--part-id" and i + 1 < len(cmdline):
            return int(cmdline[i + 1])
    return 0


class TreePoller:
    """Polls the process tree under ``pid`` every ``interval_s`` seconds (a thread).

    ``peak_rss`` is the peak of the RSS summed over the tree, ``peak_single_rss`` the largest
    single process. With ``servers=True`` every ``sampler_server.main`` process (and its own
    descendants: sampler processes) is also measured on its own: peak RSS, PSS and USS
    (``memory_full_info``: /proc/PID/smaps_rollup), its CPU seconds at the last poll and at
    the first poll that saw a ``trainer_client.main`` process (worker-mode starts the
    trainers once every server is ready: the difference is the CPU spent serving), and the
    peaks of the servers' summed RSS / PSS."""

    def __init__(self, pid: int, interval_s: float = 0.5, servers: bool = False):
        self.pid, self.interval_s, self.track_servers = pid, interval_s, servers
        self.peak_rss = 0
        self.peak_single_rss = 0
        self.peak_processes = 0
        self.servers: dict[int, dict] = {}  # server pid -> figures
        self.server_rss_sum = 0
        self.server_pss_sum = 0
        self.trainer_rss = 0
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-poller")

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def poll_once(self) -> None:
        procs = self._tree()
        if not procs:
            return
        total, single = 0, 0
        infos: dict[int, tuple[psutil.Process, int]] = {}
        for p in procs:
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            infos[p.pid] = (p, rss)
            total += rss
            single = max(single, rss)
        self.polls += 1
        self.peak_rss = max(self.peak_rss, total)
        self.peak_single_rss = max(self.peak_single_rss, single)
        self.peak_processes = max(self.peak_processes, len(infos))
        if self.track_servers:
            self._poll_servers(infos)

    def _poll_servers(self, infos: dict[int, tuple[psutil.Process, int]]) -> None:
        rss_sum = pss_sum = 0
        trainer_seen = False
        for p, _ in infos.values():
            try:
                trainer_seen = trainer_seen or "trainer_client.main" in p.cmdline()
            except psutil.Error:
                continue
        for pid, (p, _) in infos.items():
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if "trainer_client.main" in cmd:
                self.trainer_rss = max(self.trainer_rss, infos[pid][1])
            if "sampler_server.main" not in cmd:
                continue
            try:
                members = [p, *p.children(recursive=True)]
            except psutil.Error:
                continue
            rss = pss = uss = 0
            cpu = 0.0
            for m in members:
                try:
                    with m.oneshot():
                        full = m.memory_full_info()
                    m_cpu = process_cpu_s(m)  # to the ns: a tiny run serves for ms
                except psutil.Error:
                    continue
                rss += full.rss
                pss += getattr(full, "pss", full.rss)
                uss += getattr(full, "uss", full.rss)
                cpu += m_cpu
            s = self.servers.setdefault(pid, {"part": _server_part(cmd), "pid": pid,
                                              "peak_rss_bytes": 0, "peak_pss_bytes": 0,
                                              "peak_uss_bytes": 0, "cpu_s": 0.0,
                                              "cpu_at_trainer_start_s": None,
                                              "processes": 0})
            if trainer_seen and s["cpu_at_trainer_start_s"] is None:
                s["cpu_at_trainer_start_s"] = round(cpu, 6)
            s["peak_rss_bytes"] = max(s["peak_rss_bytes"], rss)
            s["peak_pss_bytes"] = max(s["peak_pss_bytes"], pss)
            s["peak_uss_bytes"] = max(s["peak_uss_bytes"], uss)
            s["cpu_s"] = max(s["cpu_s"], round(cpu, 6))
            s["processes"] = max(s["processes"], len(members))
            rss_sum, pss_sum = rss_sum + rss, pss_sum + pss
        self.server_rss_sum = max(self.server_rss_sum, rss_sum)
        self.server_pss_sum = max(self.server_pss_sum, pss_sum)

    def _run(self) -> None:
        while True:
            try:
                self.poll_once()
            except Exception as e:  # a poll must never take the measured run down
                log(f"poll failed: {type(e).__name__}: {e}")
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> TreePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# ------------------------------------------------------------------------------ children


def _stop_tree(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the child's process group (it was started in a session of its own), then
    SIGKILL what is left after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_child(name: str, argv: list[str], timeout_s: float, *, poll_s: float = 0.5,
              servers: bool = False, cwd: Path = REPO) -> tuple[dict, TreePoller, float]:
    """Run ``argv`` (a command printing one JSON object as its last stdout line) with its
    stderr echoed to ours prefixed ``[name]``; returns (that JSON, the poller, wall seconds).

    Raises :class:`StepError` when it exits non-zero (with its exit code and last stderr
    lines), runs past ``timeout_s`` (its whole process group is stopped: SIGTERM, then
    SIGKILL) or prints no JSON."""
    log(f"{name}: {' '.join(argv[1:] if argv[0] == sys.executable else argv)}")
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                            start_new_session=True)
    tail: deque[str] = deque(maxlen=30)
    out = bytearray()

    def pump_err() -> None:
        assert proc.stderr is not None
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n").rsplit("\r", 1)[-1]
            if line.strip():
                tail.append(line)
                print(f"[{name}] {line}", file=sys.stderr, flush=True)

    def pump_out() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read(65536):
            out.extend(chunk)

    readers = [threading.Thread(target=pump_err, daemon=True),
               threading.Thread(target=pump_out, daemon=True)]
    for t in readers:
        t.start()
    with TreePoller(proc.pid, poll_s, servers=servers) as poller:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_tree(proc)
            raise StepError(f"{name} did not finish within {timeout_s:.0f}s and was stopped "
                            "(raise --step-timeout-s / --train-timeout-s); stderr ends:\n"
                            + "\n".join(list(tail)[-8:])) from None
        except BaseException:  # SIGINT / SIGTERM to us (Interrupted): the child goes too
            _stop_tree(proc, grace_s=15.0)
            raise
        finally:
            for t in readers:
                t.join(timeout=10)
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    if proc.returncode != 0:
        raise StepError(f"{name} exited with code {proc.returncode}; last stdout line: "
                        f"{lines[-1][:500] if lines else '<none>'}; stderr ends:\n"
                        + "\n".join(list(tail)[-8:]))
    try:
        res = json.loads(lines[-1])
        if not isinstance(res, dict):
            raise ValueError("not a JSON object")
    except (IndexError, ValueError) as e:
        raise StepError(f"{name} printed no JSON object as its last stdout line ({e})") from e
    return res, poller, wall


def dir_bytes(path: Path) -> int:
    """Apparent size of the regular files under ``path`` (symlinks not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            if not os.path.islink(os.path.join(root, f)):
                total += st.st_size
    return total


_HELP: str | None = None


def partition_help() -> str:
    """``partition-ogbn --help`` (cached): which options this checkout's CLI has."""
    global _HELP
    if _HELP is None:
        try:
            _HELP = subprocess.run([sys.executable, "-m", "partition.cli", "--help"],
                                   capture_output=True, text=True, timeout=120, cwd=REPO,
                                   stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.SubprocessError):
            _HELP = ""
    return _HELP


def has_option(opt: str) -> bool:
    return re.search(rf"(^|\s){re.escape(opt)}[\s=,]", partition_help()) is not None


def partition_cli() -> list[str]:
    return [sys.executable, "-m", "partition.cli"]


# ------------------------------------------------------------------------------ steps


def generate_argv(args: argparse.Namespace, n: int, raw: Path) -> tuple[list[str], str]:
    """``partition-ogbn`` writing the ``n``-node graph to ``raw``; and the raw format used."""
    argv = [*partition_cli(), "--dataset", "synthetic", "--raw-out", str(raw),
            "--num-nodes", str(n), "--avg-degree", repr(args.avg_degree),
            "--feat-dim", str(args.feat_dim), "--num-classes", str(args.num_classes),
            "--train-frac", repr(args.train_frac), "--valid-frac", repr(args.valid_frac),
            "--seed", str(args.seed), "--force"]
    if not args.progress:
        argv.append("--no-progress")
    fmt = args.raw_format
    if has_option("--raw-format"):
        argv += ["--raw-format", fmt]
    else:
        fmt = "csv"  # this partition-ogbn writes synthetic graphs in the csv layout only
    if args.labeled_frac is not None:
        argv += ["--labeled-frac", repr(args.labeled_frac)]
    if args.feat_dtype:
        argv += ["--feat-dtype", args.feat_dtype]
    return argv, fmt


def step_generate(args: argparse.Namespace, n: int, raw: Path) -> dict:
    argv, fmt = generate_argv(args, n, raw)
    cli, poll, wall = run_child("generate", argv, args.step_timeout_s, poll_s=args.poll_s)
    return {"wall_s": round(wall, 2), "peak_rss_bytes": cli.get("peak_rss_bytes"),
            "peak_rss_polled_bytes": poll.peak_rss, "raw_bytes": dir_bytes(raw),
            "raw_format": fmt, "raw_dir": str(raw), "exit_code": 0, "cli": cli}


def partition_argv(args: argparse.Namespace, raw: Path, out: Path, method: str,
                   work: Path) -> list[str]:
    argv = [*partition_cli(), "--dataset-dir", str(raw), "--add-reverse-edges",
            "--num-parts", str(args.parts), "--method", method, "--out", str(out),
            "--seed", str(args.seed), "--force"]
    if args.max_memory_gb and has_option("--max-memory-gb"):
        argv += ["--max-memory-gb", repr(args.max_memory_gb)]
    if has_option("--work-dir"):
        argv += ["--work-dir", str(work)]
    if args.presample_batches is not None:
        argv += ["--presample-batches", str(args.presample_batches)]
    if args.stream_passes is not None and method in ("fennel", "ldg"):
        argv += ["--stream-passes", str(args.stream_passes)]
    if not args.progress:
        argv.append("--no-progress")
    return argv


PARTITION_KEYS = ("num_nodes", "num_edges", "method", "edge_cut", "edge_cut_frac",
                  "node_balance", "edge_balance", "train_balance", "part_nodes", "part_edges",
                  "part_train", "load_s", "partition_s", "total_s", "max_memory_bytes",
                  "peak_rss_sampled_bytes", "passes")


def step_partition(args: argparse.Namespace, raw: Path, out: Path, method: str,
                   work: Path) -> dict:
    argv = partition_argv(args, raw, out, method, work)
    work.mkdir(parents=True, exist_ok=True)
    cli, poll, wall = run_child(f"partition {method}", argv, args.step_timeout_s,
                                poll_s=args.poll_s)
    res = {k: cli[k] for k in PARTITION_KEYS if k in cli}
    res.update(wall_s=round(wall, 2), peak_rss_bytes=cli.get("peak_rss_bytes"),
               peak_rss_polled_bytes=poll.peak_rss,
               peak_rss_polled_single_bytes=poll.peak_single_rss,
               parts_bytes=dir_bytes(out), parts_dir=str(out), exit_code=0, cli=cli)
    budget = int(args.max_memory_gb * 2**30) if args.max_memory_gb else None
    res.setdefault("max_memory_bytes", budget)
    # False where this partition-ogbn has no --max-memory-gb: the peak is then unbounded
    res["max_memory_applied"] = bool(args.max_memory_gb) and has_option("--max-memory-gb")
    peaks = [p for p in (res["peak_rss_bytes"], res["peak_rss_polled_bytes"]) if p]
    res["within_budget"] = (max(peaks) < budget) if budget and peaks else None
    return res


# ------------------------------------------------------------------------------ view


def _mix64(x: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of ``x ^ salt``: a fixed pseudo-random key per original node id."""
    z = (x.astype(np.uint64) ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF))
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _pick(parts_dir: Path, meta, split: str, cap: int | None, salt: int) -> list[np.ndarray]:
    """Per part, the ``split`` seeds kept: all when ``cap`` is None or not smaller than the
    split, else the ``cap`` seeds with the smallest key of their original id (so the same
    nodes are kept whatever the partitioning)."""
    from partition.layout import load_partition

    seeds = []
    keys = []
    for p in range(meta.num_parts):
        part = load_partition(parts_dir, p)
        gids = np.asarray(getattr(part, split), dtype=np.int64)
        seeds.append(gids)
        if cap is not None:
            local = gids - meta.node_offsets[p]
            keys.append(_mix64(np.asarray(part.orig_ids[local]), salt))
    total = sum(len(s) for s in seeds)
    if cap is None or cap >= total:
        return seeds
    cut = np.partition(np.concatenate(keys), cap - 1)[cap - 1] if cap > 0 else None
    out = []
    for s, k in zip(seeds, keys):
        out.append(np.sort(s[k <= cut]) if cut is not None else s[:0])
    # ties at the cut (equal keys need equal ids): drop the excess from the last parts
    excess = sum(len(s) for s in out) - cap
    for i in range(len(out) - 1, -1, -1):
        if excess <= 0:
            break
        drop = min(excess, len(out[i]))
        out[i] = out[i][: len(out[i]) - drop]
        excess -= drop
    return out


def make_view(parts_dir: Path, view: Path, caps: dict[str, int | None], salt: int = 0) -> dict:
    """A partition set at ``view`` serving ``parts_dir``'s graph with smaller splits.

    Every array except train / valid / test is a symlink to ``parts_dir``'s file (servers map
    the very same files, so memory and startup are those of the full set); each split keeps
    ``caps[split]`` seeds (None: all) picked by :func:`_pick`. metadata.json is the original
    with the split sizes changed, a fresh set_id and ``stats.view_of``. Returns the split
    sizes before and after."""
    from partition.layout import METADATA_FILE, PartitionSetMeta, save_array

    parts_dir, view = parts_dir.resolve(), Path(view)
    meta = PartitionSetMeta.load(parts_dir)
    if view.exists():
        shutil.rmtree(view)
    view.mkdir(parents=True)
    picked = {s: _pick(parts_dir, meta, s, caps.get(s), salt + i)
              for i, s in enumerate(SPLITS)}
    for f in parts_dir.iterdir():
        if f.is_file() and f.name != METADATA_FILE:
            (view / f.name).symlink_to(f)
    raw = json.loads((parts_dir / METADATA_FILE).read_text())
    before = {s: sum(getattr(pi, f"num_{s}") for pi in meta.parts) for s in SPLITS}
    for p, info in enumerate(meta.parts):
        src, dst = parts_dir / info.dir, view / info.dir
        dst.mkdir()
        for f in src.iterdir():
            if f.suffix == ".npy" and f.stem in SPLITS:
                continue
            (dst / f.name).symlink_to(f)
        for s in SPLITS:
            save_array(dst / f"{s}.npy", picked[s][p])
            raw["parts"][p][f"num_{s}"] = int(len(picked[s][p]))
    raw["set_id"] = uuid.uuid4().hex
    raw.setdefault("stats", {})["view_of"] = {"dir": str(parts_dir), "set_id": meta.set_id,
                                              "splits": before}
    (view / METADATA_FILE).write_text(json.dumps(raw, indent=2))
    after = {s: sum(len(a) for a in picked[s]) for s in SPLITS}
    return {"dir": str(view), "of": str(parts_dir), "splits_full": before, "splits": after}


# ------------------------------------------------------------------------------ training


def worker_argv(args: argparse.Namespace, parts: Path, run_dir: Path, work: Path,
                epochs: int) -> list[str]:
    argv = [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts),
            "--num-trainers", "1", "--epochs", str(epochs),
            "--fanouts", ",".join(map(str, args.fanouts)),
            "--batch-size", str(args.batch_size), "--seed", str(args.seed),
            "--run-dir", str(run_dir), "--work-dir", str(work), "--no-progress",
            "--startup-timeout-s", repr(float(args.startup_timeout_s)),
            "--checkpoint-every", "0", "--eval-every", "0",
            "--no-shm-ring" if args.no_shm_ring else "--shm-ring",
            # the servers gather the features, as for a GPU trainer or one on another host
            # (a one-part set's CPU trainer would otherwise read them here, unmeasured)
            "--local-features", "off"]
    if args.no_shm_ring:
        # a reply then carries the batch's features (~140 MB at 500k nodes, fanouts
        # 15,10,5): the default 256 MiB backlog per client drops the second one in flight
        argv += ["--server-max-peer-backlog-mb", str(BACKLOG_MB_WITHOUT_RING)]
    if args.server_workers:
        argv += ["--server-num-workers", str(args.server_workers)]
    return argv


def read_epochs(run_dir: Path) -> list[dict]:
    """The trainer's metrics.jsonl records (one per epoch), the figures kept compact."""
    out = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for ln in lines:
        try:
            r = json.loads(ln)
        except ValueError:
            continue
        if isinstance(r, dict) and "epoch" in r:
            out.append({k: r.get(k) for k in ("epoch", "epoch_s", "seeds_per_s",
                                               "bytes_received", "loss", "valid_acc",
                                               "test_acc")})
    return out


def train_figures(summary: dict, poll: TreePoller, wall: float, eval_batches: int = 0,
                  epochs: list[dict] | None = None) -> dict:
    """The ``train`` entry from worker-mode's summary and the poller's server figures;
    ``eval_batches``: the evaluation batches the trainer sent after training (they share the
    servers' CPU time measured from the trainer's start); ``epochs``: metrics.jsonl's
    records, whose ``bytes_received`` count the training batches alone."""
    epochs_done = summary.get("epochs_done") or summary.get("epochs") or 1
    batches = (summary.get("batches_per_epoch_per_trainer") or 0) * epochs_done * \
        (summary.get("num_trainers") or 1)
    train_s = summary.get("train_s")
    res = {k: summary.get(k) for k in (
        "startup_s", "prepare_s", "launcher_wall_s", "seeds_per_s", "train_s", "test_acc",
        "valid_acc", "final_loss", "epochs_done", "batches_per_epoch_per_trainer",
        "num_trainers", "num_parts", "bytes_received", "server_to_server_bytes",
        "server_to_server_requests", "stages_s", "shm_ring", "device", "teardown")}
    # the summary's bytes_received counts every reply, the evaluation batches' too; the
    # epochs' records (and the stages, server_to_server_*) the training batches alone
    requests = batches + eval_batches
    epoch_bytes = [e["bytes_received"] for e in epochs or [] if e.get("bytes_received")]
    train_bytes = sum(epoch_bytes) if len(epoch_bytes) == epochs_done else None
    if train_bytes is not None and batches:
        per_batch = round(train_bytes / batches)
    else:
        per_batch = round(summary.get("bytes_received", 0) / requests) if requests else None
    res.update(wall_s=round(wall, 2), exit_code=0, batches=batches,
               batches_per_s=round(batches / train_s, 3) if train_s else None,
               train_bytes_received=train_bytes, bytes_per_batch=per_batch,
               bytes_per_batch_source="metrics.jsonl training batches"
               if train_bytes is not None else "summary bytes_received / (batches + eval)",
               epochs=epochs or [],
               server_to_server_bytes_per_batch=round(
                   summary.get("server_to_server_bytes", 0) / batches) if batches else None)
    res["stage_ms_per_batch"] = ({k.removesuffix("_s"): round(1000 * v / batches, 3)
                                  for k, v in (summary.get("stages_s") or {}).items()}
                                 if batches else None)
    servers = sorted(poll.servers.values(), key=lambda s: (s["part"] is None, s["part"]))
    res["servers"] = servers
    res["server_rss_sum_bytes"] = poll.server_rss_sum
    res["server_pss_sum_bytes"] = poll.server_pss_sum
    res["server_rss_max_bytes"] = max((s["peak_rss_bytes"] for s in servers), default=None)
    res["server_pss_max_bytes"] = max((s["peak_pss_bytes"] for s in servers), default=None)
    res["server_uss_max_bytes"] = max((s["peak_uss_bytes"] for s in servers), default=None)
    res["server_cpu_s"] = round(sum(s["cpu_s"] for s in servers), 2)
    serving = [s["cpu_s"] - s["cpu_at_trainer_start_s"] for s in servers
               if s["cpu_at_trainer_start_s"] is not None]
    res["server_serving_cpu_s"] = round(sum(serving), 4) if serving else None
    res["eval_batches"] = eval_batches
    res["server_cpu_ms_per_batch"] = (round(1000 * sum(serving) / requests, 3)
                                      if serving and requests else None)
    res["trainer_peak_rss_bytes"] = poll.trainer_rss
    res["polls"] = poll.polls
    return res


EVAL_BATCH_SIZE = 1024  # the trainer's --eval-batch-size default (worker_argv leaves it)


def train_on_view(args: argparse.Namespace, view: dict, work: Path, run_dir: Path, *,
                  epochs: int, name: str, extra: tuple[str, ...] = ()) -> dict:
    """worker-mode on ``view`` (:func:`make_view`) for ``epochs``, with ``extra`` trainer
    options; its figures (:func:`train_figures`), the set's bytes and the view."""
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = worker_argv(args, Path(view["dir"]), run_dir, work, epochs) + list(extra)
    summary, poll, wall = run_child(name, argv, args.train_timeout_s, poll_s=args.poll_s,
                                    servers=True)
    eval_batches = sum(-(-view["splits"][sp] // EVAL_BATCH_SIZE) for sp in ("valid", "test"))
    res = train_figures(summary, poll, wall, eval_batches, read_epochs(run_dir))
    res["parts_bytes"] = dir_bytes(Path(view["of"]))
    res["view"] = view
    return res


def step_train(args: argparse.Namespace, parts: Path, work: Path, *, epochs: int,
               caps: dict[str, int | None], name: str = "train") -> dict:
    """worker-mode on a view of ``parts`` (splits capped by ``caps``) for ``epochs``."""
    view = make_view(parts, work / "view", caps, salt=args.seed)
    return train_on_view(args, view, work, work / "run", epochs=epochs, name=name)


# ------------------------------------------------------------------------------ driver


def _scale_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e
    if not vals or any(not 0 < v <= 64 for v in vals):
        raise argparse.ArgumentTypeError(f"scales must be in (0, 64], got {text!r}")
    return sorted(set(vals))


def add_graph_args(p: argparse.ArgumentParser) -> None:
    """Options shared with ``benchmarks.partcompare``: the generated graph, the training run
    and the timeouts."""
    p.add_argument("--avg-degree", type=float, default=PRODUCTS_AVG_DEGREE,
                   help="directed edges per node, both directions counted (default "
                        f"{PRODUCTS_AVG_DEGREE:.4f}, ogbn-products')")
    p.add_argument("--feat-dim", type=int, default=100, help="feature size (default 100)")
    p.add_argument("--num-classes", type=int, default=47, help="classes (default 47)")
    p.add_argument("--train-frac", type=float, default=PRODUCTS_TRAIN_FRAC,
                   help=f"training split (default {PRODUCTS_TRAIN_FRAC}, products')")
    p.add_argument("--valid-frac", type=float, default=PRODUCTS_VALID_FRAC,
                   help=f"validation split, test is the rest (default {PRODUCTS_VALID_FRAC})")
    p.add_argument("--labeled-frac", type=float, default=None,
                   help="fraction of labelled nodes (the rest NaN); passed to the generator "
                        "when given")
    p.add_argument("--feat-dtype", choices=("float32", "float16"), default=None,
                   help="stored feature dtype; passed to the generator when given")
    p.add_argument("--raw-format", choices=("binary", "csv"), default="binary",
                   help="OGB raw layout the graph is written in (default binary; csv where "
                        "partition-ogbn has no --raw-format)")
    p.add_argument("--parts", type=int, default=4, help="partitions (default 4)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="partition-ogbn --max-memory-gb, the peak RSS budget (default "
                        "%(default)s)")
    p.add_argument("--stream-passes", type=int, default=None,
                   help="partition-ogbn --stream-passes for fennel / ldg (default: its own)")
    p.add_argument("--presample-batches", type=int, default=None,
                   help="partition-ogbn --presample-batches (default: its own)")
    p.add_argument("--fanouts", type=int_list, default=[15, 10, 5],
                   help="training fanouts, input layer first (default 15,10,5)")
    p.add_argument("--batch-size", type=int, default=1024, help="seeds per batch (1024)")
    p.add_argument("--eval-seeds", type=int, default=10000,
                   help="valid and test seeds evaluated after training, each (default 10000; "
                        "0: the whole splits)")
    p.add_argument("--no-shm-ring", action="store_true",
                   help="no shared-memory ring: every reply carries its features on the "
                        "socket, as from a server on another machine (bytes_per_batch is then "
                        "the whole reply; the servers' --max-peer-backlog-mb is raised to "
                        f"{BACKLOG_MB_WITHOUT_RING}). Default: worker-mode's ring, features "
                        "written into shared memory, bytes_per_batch without them")
    p.add_argument("--server-workers", type=int, default=0,
                   help="sampling threads per server (0: worker-mode's default)")
    p.add_argument("--seed", type=int, default=0, help="generator / partition / training seed")
    p.add_argument("--work-dir", required=True,
                   help="where the raw graphs, partition sets and runs are written")
    p.add_argument("--keep", action="store_true",
                   help="keep the raw and partition directories (deleted after use otherwise)")
    p.add_argument("--progress", action="store_true",
                   help="let partition-ogbn show progress bars (off: --no-progress)")
    p.add_argument("--poll-s", type=float, default=0.5,
                   help="seconds between psutil polls of a step's process tree (default 0.5)")
    p.add_argument("--step-timeout-s", type=float, default=4 * 3600.0,
                   help="stop a generate / partition subprocess after this long (default 4 h)")
    p.add_argument("--train-timeout-s", type=float, default=2 * 3600.0,
                   help="stop a worker-mode run after this long (default 2 h)")
    p.add_argument("--startup-timeout-s", type=float, default=1800.0,
                   help="worker-mode --startup-timeout-s (default 1800)")
    p.add_argument("--out", help="also write the JSON summary to this file")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scalerun",
        description="Generate products-shaped graphs at several scales in OGB's raw layout, "
                    "partition each with partition-ogbn --max-memory-gb (time, peak RSS, cut, "
                    "balance) and train a few hundred batches in worker mode on the largest "
                    "(server RSS/PSS, startup, seeds/s). Every step is a subprocess with a "
                    "timeout. The last stdout line is a JSON summary; tables go to stderr.")
    p.add_argument("--scales", type=_scale_list, default=[1.0, 2.0, 4.0],
                   help="multiples of --base-nodes (default 1,2,4)")
    p.add_argument("--base-nodes", type=int, default=PRODUCTS_NODES,
                   help=f"nodes at scale 1 (default {PRODUCTS_NODES:,}, ogbn-products)")
    p.add_argument("--method", default="fennel",
                   help="partition-ogbn --method (default fennel)")
    p.add_argument("--train-scales", type=_scale_list, default=None,
                   help="scales that get the worker-mode run (default: the largest)")
    p.add_argument("--train-batches", type=int, default=300,
                   help="training batches of the worker-mode run (default 300; 0 skips it)")
    add_graph_args(p)
    p.set_defaults(max_memory_gb=12.0)
    return p


def _attempt(errors: dict[str, str], key: str, fn):
    t0 = time.perf_counter()
    try:
        res = fn()
    except Interrupted:
        raise
    except Exception as e:  # one failed step must not lose the others
        errors[key] = f"{type(e).__name__}: {e}"
        detail = "" if isinstance(e, StepError) else "\n" + traceback.format_exc()
        log(f"{key}: FAILED after {time.perf_counter() - t0:.1f}s: {e}{detail}")
        return None
    log(f"{key}: done in {time.perf_counter() - t0:.1f}s")
    return res


def _remove(path: Path, keep: bool) -> None:
    if not keep and path.exists():
        shutil.rmtree(path, ignore_errors=True)
        log(f"removed {path}")


def measure_scale(args: argparse.Namespace, entry: dict, train: bool,
                  errors: dict[str, str]) -> None:
    scale, n = entry["scale"], entry["nodes"]
    tag = f"{scale:g}"
    sdir = Path(args.work_dir) / f"scale-{tag}-{n}n"
    raw, parts, work = sdir / "raw", sdir / f"parts-{args.method}-{args.parts}", sdir / "work"
    try:
        log(f"scale {tag}: {n:,} nodes, avg degree {args.avg_degree:.4g}, "
            f"{args.feat_dim}-dim features")
        entry["generate"] = _attempt(errors, f"{tag}:generate",
                                     lambda: step_generate(args, n, raw))
        if entry["generate"] is None:
            return
        entry["partition"] = _attempt(errors, f"{tag}:partition", lambda: step_partition(
            args, raw, parts, args.method, work))
        _remove(raw, args.keep)
        if entry["partition"] is None or not train:
            return
        caps = {"train": args.train_batches * args.batch_size,
                "valid": args.eval_seeds or None, "test": args.eval_seeds or None}
        entry["train"] = _attempt(errors, f"{tag}:train", lambda: step_train(
            args, parts, work, epochs=1, caps=caps))
    finally:
        _remove(raw, args.keep)
        _remove(parts, args.keep)
        _remove(work, args.keep)
        if not args.keep and sdir.is_dir() and not any(sdir.iterdir()):
            sdir.rmdir()


def growth(scales: list[dict]) -> dict:
    """Largest over smallest scale (both partitioned): nodes, edges, time, peak."""
    ok = [s for s in scales if s.get("partition")]
    if len(ok) < 2:
        return {}
    lo, hi = ok[0], ok[-1]
    a, b = lo["partition"], hi["partition"]
    g = {"from_scale": lo["scale"], "to_scale": hi["scale"],
         "nodes": ratio(b.get("num_nodes"), a.get("num_nodes")),
         "edges": ratio(b.get("num_edges"), a.get("num_edges")),
         "partition_wall_s": ratio(b.get("wall_s"), a.get("wall_s")),
         "partition_peak_rss": ratio(b.get("peak_rss_bytes"), a.get("peak_rss_bytes")),
         "partition_peak_rss_polled": ratio(b.get("peak_rss_polled_bytes"),
                                            a.get("peak_rss_polled_bytes")),
         "parts_bytes": ratio(b.get("parts_bytes"), a.get("parts_bytes"))}
    ga, gb = lo.get("generate") or {}, hi.get("generate") or {}
    g["generate_wall_s"] = ratio(gb.get("wall_s"), ga.get("wall_s"))
    g["generate_peak_rss"] = ratio(gb.get("peak_rss_bytes"), ga.get("peak_rss_bytes"))
    return g


def _gb(v) -> str:
    return "-" if not v else f"{v / 2**30:.2f}"


def _f(v, fmt: str = ",.1f") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def train_rows(runs: list[tuple[str, dict]]) -> str:
    rows = [("run", "startup s", "seeds/s", "batches", "test acc", "MB/batch", "s2s MB",
             "srv RSS GiB (sum)", "srv PSS GiB (sum)", "srv RSS max", "srv PSS max",
             "srv cpu ms/batch", "parts GiB")]
    for name, t in runs:
        rows.append((name, _f(t.get("startup_s"), ".2f"), _f(t.get("seeds_per_s")),
                     _f(t.get("batches"), "d"), _f(t.get("test_acc"), ".4f"),
                     _f((t.get("bytes_per_batch") or 0) / 1e6, ".2f"),
                     _f((t.get("server_to_server_bytes") or 0) / 1e6, ".1f"),
                     _gb(t.get("server_rss_sum_bytes")), _gb(t.get("server_pss_sum_bytes")),
                     _gb(t.get("server_rss_max_bytes")), _gb(t.get("server_pss_max_bytes")),
                     _f(t.get("server_cpu_ms_per_batch"), ".1f"), _gb(t.get("parts_bytes"))))
    return table(rows)


def print_table(summary: dict) -> None:
    c = summary["config"]
    rows = [("scale", "nodes", "directed edges", "gen s", "gen peak GiB", "part s",
             "part peak GiB (own/polled)", "budget GiB", "cut %", "node bal", "train bal",
             "raw GiB", "parts GiB")]
    for s in summary["scales"]:
        g, p = s.get("generate") or {}, s.get("partition") or {}
        rows.append((f"{s['scale']:g}", f"{p.get('num_nodes') or s['nodes']:,}",
                     _f(p.get("num_edges"), ","), _f(g.get("wall_s")),
                     _gb(g.get("peak_rss_bytes") or g.get("peak_rss_polled_bytes")),
                     _f(p.get("wall_s")),
                     f"{_gb(p.get('peak_rss_bytes'))}/{_gb(p.get('peak_rss_polled_bytes'))}",
                     _gb(p.get("max_memory_bytes")),
                     _f(100 * p["edge_cut_frac"] if "edge_cut_frac" in p else None, ".2f"),
                     _f(p.get("node_balance"), ".3f"), _f(p.get("train_balance"), ".3f"),
                     _gb(g.get("raw_bytes")), _gb(p.get("parts_bytes"))))
    print(f"\nscale runs: --method {c['method']} --parts {c['parts']} --max-memory-gb "
          f"{c['max_memory_gb']}, avg degree {c['avg_degree']:.4g}, {c['feat_dim']}-dim "
          f"features, {c['raw_format']} raw layout", file=sys.stderr)
    print(table(rows), file=sys.stderr)
    runs = [(f"scale {s['scale']:g}", s["train"]) for s in summary["scales"] if s.get("train")]
    if runs:
        print(f"\nworker-mode, {c['train_batches']} batches of {c['batch_size']}, fanouts "
              f"{c['fanouts']}:", file=sys.stderr)
        print(train_rows(runs), file=sys.stderr)
    for k, e in summary["errors"].items():
        print(f"FAILED {k}: {e.splitlines()[0][:300] if e else ''}", file=sys.stderr)
    print(file=sys.stderr, flush=True)


class MachineInfo:
    """:func:`benchmarks.report.machine_info` in a background thread (importing torch and
    dgl takes seconds: it overlaps the first step instead of delaying it)."""

    def __init__(self) -> None:
        self.info: dict = {"cores": os.cpu_count(),
                           "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
        self._thread = threading.Thread(target=self._run, daemon=True, name="machine-info")
        self._thread.start()

    def _run(self) -> None:
        try:
            from benchmarks.report import machine_info

            self.info = machine_info() | {"loadavg_start": self.info["loadavg_start"]}
        except Exception as e:  # the figures matter more than the description
            self.info["error"] = f"{type(e).__name__}: {e}"

    def result(self, timeout_s: float = 120.0) -> dict:
        self._thread.join(timeout=timeout_s)
        info = dict(self.info)
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        return info


def config_of(args: argparse.Namespace, keys: tuple[str, ...]) -> dict:
    cfg = {k: getattr(args, k) for k in keys}
    cfg["raw_format"] = args.raw_format if has_option("--raw-format") else "csv"
    if "server_workers" in cfg and not cfg["server_workers"]:
        from common.config import ServerConfig

        cfg["server_workers"] = ServerConfig().num_workers  # what worker-mode's servers use
    cfg["work_dir"] = str(args.work_dir)
    cfg["partition_cli_options"] = {o: has_option(o) for o in (
        "--raw-format", "--max-memory-gb", "--labeled-frac", "--feat-dtype", "--work-dir")}
    return cfg


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.parts < 1:
        parser.error("--parts must be >= 1")
    if args.batch_size < 1 or getattr(args, "train_batches", 0) < 0 or args.eval_seeds < 0:
        parser.error("--batch-size must be >= 1, --train-batches and --eval-seeds >= 0")
    if not (0 < args.train_frac and 0 <= args.valid_frac and args.train_frac + args.valid_frac
            < 1):
        parser.error("need 0 < --train-frac, 0 <= --valid-frac, and their sum < 1")
    if args.max_memory_gb is not None and args.max_memory_gb <= 0:
        parser.error("--max-memory-gb must be > 0")
    for name in ("poll_s", "step_timeout_s", "train_timeout_s", "startup_timeout_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    t_start = time.perf_counter()
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    info = MachineInfo()
    config = config_of(args, (
        "scales", "base_nodes", "avg_degree", "feat_dim", "num_classes", "train_frac",
        "valid_frac", "labeled_frac", "feat_dtype", "parts", "method", "max_memory_gb",
        "train_scales", "train_batches", "batch_size", "fanouts", "eval_seeds",
        "server_workers", "no_shm_ring", "presample_batches", "stream_passes", "seed",
        "poll_s", "step_timeout_s", "train_timeout_s"))
    train_scales = set(args.train_scales or [max(args.scales)])
    if not train_scales <= set(args.scales):
        parser.error(f"--train-scales {sorted(train_scales)} must be among --scales "
                     f"{args.scales}")
    config["train_scales"] = sorted(train_scales)
    errors: dict[str, str] = {}
    scales: list[dict] = []
    code = 0
    raise_on_signals()
    try:
        for scale in args.scales:
            entry = {"scale": scale, "nodes": max(100, round(scale * args.base_nodes)),
                     "generate": None, "partition": None, "train": None}
            scales.append(entry)
            measure_scale(args, entry, args.train_batches > 0 and scale in train_scales,
                          errors)
    except Interrupted as e:  # the running step was stopped, its files removed
        errors["interrupted"] = f"stopped by {e}; the scales after it did not run"
        code = 128 + e.signum
    summary = {"machine": info.result(), "config": config, "scales": scales,
               "growth": growth(scales), "errors": errors,
               "wall_s": round(time.perf_counter() - t_start, 1),
               "command": command_line("benchmarks.scalerun", argv)}
    emit_summary(summary, args.out, print_table)
    return code or (1 if errors else 0)


if __name__ == "__main__":
    sys.exit(main())
