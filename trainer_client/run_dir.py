"""The run directory: every output of one training run in one place (only rank 0 writes).

Layout (paths relative to the run directory)::

    config.json       {"trainer": options, "dataset", "set_id", "world_size", "model_spec"}
    metrics.jsonl     one strict JSON line per epoch, flushed as the epoch ends
    summary.json      the final summary (the JSON line rank 0 prints)
    best_model.pt     the best-validation model (trainer_client.checkpoint.save_best_model)
    checkpoints/      epoch-NNNNNN.pt (trainer_client.checkpoint)
    profile.txt       with --profile-steps: torch.profiler's table (trainer_client.profiling)

The default name is ``runs/<UTC yyyymmdd-HHMMSS>-<6 hex>`` under the current directory. Under
DDP every rank must use the same one: rank 0 decides and broadcasts it as bytes in a uint8
tensor (:func:`broadcast_bytes`; nothing pickled), so clocks and random suffixes of the other
ranks never matter.

Where ``--resume`` looks (:func:`resume_location`): the checkpoints of ``--checkpoint-dir`` if
given, else of ``<--run-dir>/checkpoints``; with neither, the newest run under ``./runs``
(names sort by time) that holds a checkpoint. The run directory of a resumed run is
``--run-dir`` if given, else the one that checkpoint was written by (recorded in it), so its
metrics.jsonl continues.

This module imports torch only inside :func:`broadcast_bytes` (launchers import it to name run
directories).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from common.jsonout import dumps_strict

CHECKPOINT_SUBDIR = "checkpoints"
CHECKPOINT_GLOB = "epoch-*.pt"


def new_run_name(now: float | None = None) -> str:
    """``yyyymmdd-HHMMSS-<6 hex>`` in UTC: sorts by start time, unique across runs started
    in the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(3)}"


def checkpoint_dir_of(run_dir: str | Path, checkpoint_dir: str = "") -> Path:
    """Where a run's checkpoints go: ``checkpoint_dir`` if given, else ``<run_dir>/checkpoints``."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / CHECKPOINT_SUBDIR


def newest_resumable_run(root: str | Path) -> Path | None:
    """The newest run directory under ``root`` (by name, i.e. start time) that holds a
    checkpoint, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    for run in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name,
                      reverse=True):
        if any((run / CHECKPOINT_SUBDIR).glob(CHECKPOINT_GLOB)):
            return run
    return None


def resume_location(run_dir: str, checkpoint_dir: str, runs_root: str = "runs") -> Path | None:
    """The checkpoint directory ``--resume`` continues from (see the module docstring); None
    when no run under ``runs_root`` has a checkpoint."""
    if checkpoint_dir or run_dir:
        return checkpoint_dir_of(run_dir, checkpoint_dir)
    run = newest_resumable_run(runs_root)
    return None if run is None else run / CHECKPOINT_SUBDIR


def broadcast_bytes(data: bytes | None, rank: int, world_size: int, device) -> bytes:
    """Rank 0's ``data`` on every rank (length, then the bytes as a uint8 tensor; no pickle).
    With one rank, ``data`` itself."""
    if world_size == 1:
        return data or b""
    import torch
    import torch.distributed as dist

    payload = (data or b"") if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if rank == 0 and payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if buf.numel():
        dist.broadcast(buf, 0)
    return bytes(buf.cpu().numpy().tobytes())


def write_json_atomic(path: Path, obj: dict) -> None:
    """``obj`` as strict JSON, written to a temporary file and renamed over ``path``."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps_strict(obj, indent=1) + "\n")
    os.replace(tmp, path)


class RunFiles:
    """The run directory's file names (every rank) and their writer (rank 0 only)."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.config = self.dir / "config.json"
        self.metrics = self.dir / "metrics.jsonl"
        self.summary = self.dir / "summary.json"
        self.best_model = self.dir / "best_model.pt"
        self.profile = self.dir / "profile.txt"  # --profile-steps (trainer_client/profiling.py)

    def create(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: dict) -> None:
        write_json_atomic(self.config, config)

    def append_metrics(self, record: dict) -> None:
        """One epoch's line, flushed and synced to the file before the next epoch starts."""
        with open(self.metrics, "a") as f:
            f.write(dumps_strict(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_metrics(self, after_epoch: int) -> None:
        """Drop lines of epochs after ``after_epoch`` (a resumed run repeats those epochs:
        the killed run may have logged epochs its last checkpoint does not hold), and a line
        the killed run left half written."""
        if not self.metrics.is_file():
            return
        kept = []
        for line in self.metrics.read_text().splitlines():
            try:
                if json.loads(line).get("epoch", -1) <= after_epoch:
                    kept.append(line)
            except ValueError:
                continue
        tmp = self.metrics.with_name(f"{self.metrics.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.metrics)

    def write_summary(self, summary: dict) -> None:
        write_json_atomic(self.summary, summary)

    def files(self, checkpoints: list[str], best_saved: bool,
              profiled: bool = False) -> dict:
        """The summary's ``files`` entry (paths as written; the same on every rank)."""
        out = {"config": str(self.config), "metrics": str(self.metrics),
               "best_model": str(self.best_model) if best_saved else None,
               "checkpoints": checkpoints, "summary": str(self.summary)}
        if profiled:  # --profile-steps
            out["profile"] = str(self.profile)
        return out
