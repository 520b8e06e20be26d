"""What both benchmark commands (``benchmarks.run``, ``benchmarks.scale``) share in their
output: progress lines, the machine description, mfgserve / DGL ratios, the command line and
the summary itself (a table on stderr, then one JSON line on stdout). torch and numpy are
imported only by :func:`machine_info`, so a command's bad options fail fast."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from common.cpuinfo import first_cpu

REPO = Path(__file__).resolve().parents[1]


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers ("15,10,5")."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def at_least(low: float, kind: type = int) -> Callable[[str], float]:
    """argparse type: a number of ``kind`` (int or float) that is >= ``low``; anything else
    is refused as "expected an integer (a number) >= low"."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not v >= low:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low:g}, got {text!r}")
        return v
    return parse


def logger(tag: str) -> Callable[[str], None]:
    """A progress printer: ``[tag HH:MM:SS] msg`` lines on stderr."""

    def log(msg: str) -> None:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def cached_parts(parts: Path, commands: list[list[str]], log: Callable[[str], None],
                 seed: int) -> Path:
    """``parts`` (a partition set directory) as made by ``commands`` (``partition-ogbn``'s
    arguments, run in order with ``--no-progress --seed seed``), made only where its
    ``metadata.json`` is not there yet; a failed command raises with its stderr's end."""
    if (parts / "metadata.json").is_file():
        return parts
    parts.parent.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "partition.cli", "--no-progress", "--seed", str(seed)]
    for args in commands:
        argv = [*cli, *args]
        log(" ".join(argv[1:]))
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[1:4])} exited {proc.returncode}: "
                               f"{proc.stderr[-2000:]}")
    return parts


def process_cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds ``proc`` has run so far, all its threads (live and exited),
    to the nanosecond: its process CPU-time clock (Linux's ``clock_getcpuclockid``, read with
    ``clock_gettime``). psutil's ``cpu_times`` counts in clock ticks (10 ms here), so a window
    of a few small batches can read 0. Falls back to psutil where the clock cannot be read
    (another OS; a process of another user). Raises ``psutil.Error`` for a process gone."""
    if sys.platform.startswith("linux"):
        try:
            # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED): what clock_getcpuclockid(pid) returns
            return time.clock_gettime(((~proc.pid) << 3) | 2)
        except OSError:  # the process is gone (EINVAL), or not ours to read
            if not proc.is_running():
                raise psutil.NoSuchProcess(proc.pid) from None
    t = proc.cpu_times()
    return t.user + t.system


def cpu_times():
    """This machine's CPU times since boot (``psutil.cpu_times()``: per state, in seconds; on
    Linux ``steal`` among them)."""
    return psutil.cpu_times()


def steal_share(before, after) -> float | None:
    """The share of this machine's CPU time between two :func:`cpu_times` readings that its
    hypervisor ran other guests on (steal time; idle time counts in the whole; guest time,
    already within user, is not counted twice): a VM's neighbours slow every figure measured
    meanwhile, and this says by how much they took the cores. None without both readings,
    where the platform reports no steal, or with no time between them."""
    if before is None or after is None or "steal" not in before._fields:
        return None
    spent = {f: getattr(after, f) - getattr(before, f)
             for f in before._fields if f not in ("guest", "guest_nice")}
    total = sum(spent.values())
    return round(spent["steal"] / total, 4) if total > 0 else None


# the instruction sets that decide which library multiplies the step's products (MKL or
# oneDNN: trainer_client/model.py's float32_library) and whether bfloat16 has hardware
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_identity(text: str | None = None) -> dict:
    """The first CPU of Linux's ``/proc/cpuinfo`` (or of ``text`` in its format): ``cpu``
    (model name), ``cpu_vendor``, ``cpu_family`` and ``cpu_model_number`` (ints; None where
    absent) and ``cpu_flags``, those of :data:`CPU_FLAGS` it has. A VM's model name is often
    only "AMD EPYC", while family 23 (Zen 1-2, AVX2) and 26 (Zen 5, AVX-512) run the step at
    twice different rates (docs/benchmarks.md, sessions 51-52)."""
    fields = first_cpu(text)

    def number(key: str) -> int | None:
        try:
            return int(fields[key])
        except (KeyError, ValueError):
            return None

    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", ""), "cpu_vendor": fields.get("vendor_id", ""),
            "cpu_family": number("cpu family"), "cpu_model_number": number("model"),
            "cpu_flags": [f for f in CPU_FLAGS if f in flags]}


def machine_info() -> dict:
    import numpy as np
    import torch

    from common.dgl_compat import import_dgl

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
        **cpu_identity(),
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


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` rounded to 3 places; None when either is missing or zero."""
    if not num or not den:
        return None
    return round(num / den, 3)


def add_malloc_arg(p: argparse.ArgumentParser) -> None:
    """``--malloc-retain-mb``, one value for both sides of a comparison (see
    :func:`apply_malloc`)."""
    from common.alloc import DEFAULT_RETAIN_MB

    p.add_argument("--malloc-retain-mb", type=int, default=DEFAULT_RETAIN_MB,
                   help="glibc malloc retention (common/alloc.py) on BOTH sides: this "
                        "process (DGL's pipeline, the step and data-path consumers), DGL's DDP "
                        "processes and mfgserve's trainers and servers (--malloc-retain-mb, "
                        f"--server-malloc-retain-mb); 0: the C library's defaults on both "
                        f"(default {DEFAULT_RETAIN_MB}, mfgserve's default)")


def apply_malloc(retain_mb: int) -> int:
    """Apply ``--malloc-retain-mb`` to this process; the value in effect (0: none)."""
    from common.alloc import check_retain_mb, retain_freed_memory
    from common.errors import ConfigError

    try:
        check_retain_mb(retain_mb)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    return retain_mb if retain_freed_memory(retain_mb, "benchmark process") else 0
