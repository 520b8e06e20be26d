"""Checkpoints and the saved best model: written atomically, read without unpickling objects.

A checkpoint (``<checkpoint dir>/epoch-NNNNNN.pt``, NNNNNN = epochs completed; the newest
:data:`KEEP` are kept) holds everything a resumed run needs to continue exactly where the
uninterrupted run would be::

    {"format": "mfgserve-checkpoint/1", "epoch": epochs completed, "model": state_dict,
     "optimizer": ..., "scheduler": ... or {}, "rng": {"torch": ByteTensor},
     "config": the options that change the result (:func:`result_config`), "set_id",
     "dataset", "world_size", "run_dir", "best": {"valid_<metric>", "test_<metric>",
     "epoch"} (read back by :func:`resumed_best`), "best_state": the best model's state_dict
     (rank 0 rewrites best_model.pt from it on resume: the killed run may have saved a
     better model of an epoch after the checkpoint), "history": [...],
     "early_stop": {"bad_evals": int, "stopped": bool}, "node_tensors": {name: state}}

Only tensors, dicts, lists, str, int, float, bool and None: ``torch.load(weights_only=True)``
reads it (a file that needs anything else is refused, never executed). Written to a temporary
file, synced, then renamed over the final name: a process killed while writing leaves the
previous checkpoints intact and no partial ``epoch-*.pt``.

The best model (``<run dir>/best_model.pt``, :func:`save_best_model`)::

    {"format": "mfgserve-model/1", "model_spec", "state_dict", "epoch",
     "valid_<metric>": its validation score (valid_acc, valid_rocauc), "eval_metric":
     the dataset's metric, "set_id", "dataset"}

(files written before ``eval_metric`` existed hold ``valid_acc`` whatever the metric was;
:func:`best_score` reads both).

A checkpoint is only resumed by a run that computes the same thing: same partition set,
dataset, number of trainers and every option outside :data:`RUN_ONLY_KEYS`; otherwise
:func:`check_compatible` raises a :class:`ConfigError` naming each difference.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path

import torch
from torch import nn

from common.config import TrainerConfig, to_dict
from common.errors import ConfigError

FORMAT = "mfgserve-checkpoint/1"
MODEL_FORMAT = "mfgserve-model/1"
KEEP = 2  # checkpoints kept: the newest, and one to fall back on should it be damaged
_NAME = re.compile(r"^epoch-(\d{6,})\.pt$")

# Options that do not change what a run computes (where and how long it runs, how it talks
# to servers, how it reports): a checkpoint may be resumed with other values for these.
RUN_ONLY_KEYS = frozenset({
    "cluster", "epochs", "progress", "summary_out", "run_dir", "checkpoint_dir",
    "checkpoint_every", "resume", "request_timeout_s", "heartbeat_s", "heartbeat_timeout_s",
    "curve_secret_key", "replica_suspect_s", "max_message_mb", "max_inflight", "prefetch",
    "shm_ring", "shm_ring_mb", "num_threads", "device", "eval_batch_size", "malloc_retain_mb",
    "profile_steps"})


def result_config(cfg: TrainerConfig) -> dict:
    """The options a checkpoint must agree on with the run resuming it. ``epochs`` only
    counts with the cosine schedule (its curve depends on the total)."""
    out = {k: v for k, v in to_dict(cfg).items() if k not in RUN_ONLY_KEYS}
    if cfg.lr_schedule == "cosine":
        out["epochs"] = cfg.epochs
    return out


def checkpoint_path(directory: str | Path, epoch: int) -> Path:
    return Path(directory) / f"epoch-{epoch:06d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The directory's checkpoints, oldest first (by epoch number, not file time)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_atomic(obj: dict, path: str | Path) -> Path:
    """``torch.save`` into a temporary file beside ``path``, fsync, rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def prune(directory: str | Path, keep: int = KEEP) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints; returns the kept ones, oldest first."""
    found = list_checkpoints(directory)
    for old in found[:-keep]:
        old.unlink(missing_ok=True)
    return found[-keep:]


def load_bytes(data: bytes, source: str) -> dict:
    """A checkpoint or model file's content (``torch.load(weights_only=True)``, on CPU)."""
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise ConfigError(f"cannot read checkpoint {source}: {str(e).splitlines()[0]}; it is "
                          "damaged or not an mfgserve checkpoint (only tensors, dicts, lists "
                          "and numbers are loaded)") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ConfigError(f"{source} is not an mfgserve checkpoint (format {found!r}, "
                          f"expected {FORMAT!r})")
    return obj


_ABSENT = object()  # a key one side of a comparison lacks


def _show(value) -> str:
    return "(absent)" if value is _ABSENT else repr(value)


def check_compatible(ckpt: dict, expected: dict, source: str) -> None:
    """Refuse (ConfigError naming every difference, with both values) a checkpoint written by
    another configuration or partition set. ``expected``: this run's {"config":
    :func:`result_config`, "set_id", "dataset", "world_size"}."""
    labels = {"set_id": "partition set (set_id)", "dataset": "dataset",
              "world_size": "number of trainers (world size)"}
    diffs = [f"{label}: checkpoint {_show(ckpt.get(key, _ABSENT))}, this run "
             f"{expected[key]!r}" for key, label in labels.items()
             if ckpt.get(key, _ABSENT) != expected[key]]
    theirs, ours = ckpt.get("config", {}), expected["config"]
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key, _ABSENT), ours.get(key, _ABSENT)
        if a != b:
            diffs.append(f"--{key.replace('_', '-')}: checkpoint {_show(a)}, this run {_show(b)}")
    if diffs:
        raise ConfigError(
            f"checkpoint {source} was written by a run with another configuration or "
            f"partition set; refusing to resume from it. Differences: {'; '.join(diffs)}. "
            "Resume with the checkpoint's values, or start a new run (without --resume, or "
            "with another --run-dir / --checkpoint-dir)")


def model_state(model: nn.Module) -> dict:
    """The model's tensors on CPU, names without DDP's ``module.`` prefix."""
    return {k.removeprefix("module."): v.detach().to("cpu", copy=True)
            for k, v in model.state_dict().items()}


def save_best_model(path: str | Path, model: nn.Module | dict, spec: dict, epoch: int,
                    valid: float, set_id: str, dataset: str, metric: str = "acc") -> Path:
    """The best-validation model (``mfgserve-model/1``; ``model``: a module or its
    :func:`model_state`), loadable with weights_only=True and rebuilt by
    ``trainer_client.models.build_model(spec)``. Its validation score is stored under the
    dataset's metric, ``valid_<metric>`` (``valid_acc``, ``valid_rocauc``), with
    ``eval_metric`` naming it; :func:`best_score` reads it back (older files too)."""
    state = model_state(model) if isinstance(model, nn.Module) else model
    return save_atomic({"format": MODEL_FORMAT, "model_spec": dict(spec),
                        "state_dict": state, "epoch": int(epoch),
                        f"valid_{metric}": float(valid), "eval_metric": metric,
                        "set_id": set_id, "dataset": dataset}, path)


def best_score(saved: dict) -> tuple[str, float]:
    """``(metric, validation score)`` of a saved best model: its ``eval_metric`` and
    ``valid_<metric>``; a file written before models named their metric holds ``valid_acc``
    only (whatever the metric was): ``("acc", valid_acc)``."""
    metric = saved.get("eval_metric") or "acc"
    key = f"valid_{metric}"
    if key not in saved:
        raise ConfigError(f"the saved model names metric {metric!r} but has no {key!r}; it "
                          "is damaged")
    return metric, float(saved[key])


def resumed_best(best: dict, metric: str) -> dict:
    """A checkpoint's ``best`` (``{"valid_<metric>", "test_<metric>", "epoch"}``) for a run
    whose metric is ``metric``. A checkpoint that keyed the best by ``valid_acc`` / ``test_acc``
    whatever the metric was is read with those values as the metric's."""
    key = f"valid_{metric}"
    if key in best:
        return dict(best)
    if "valid_acc" in best:
        return {key: best["valid_acc"], f"test_{metric}": best.get("test_acc", 0.0),
                "epoch": best.get("epoch", -1)}
    raise ConfigError(f"the checkpoint's best model record {sorted(best)} has no {key!r} "
                      "(this run's metric); it was written by another kind of run")


class Checkpointer:
    """When to write checkpoints and which exist (every rank tracks the same names; only the
    writer, rank 0, touches the directory)."""

    def __init__(self, directory: str | Path, every: int, writer: bool,
                 kept: list[str] | None = None):
        self.dir = Path(directory)
        self.every = every
        self.writer = writer
        self.kept: list[str] = list(kept or [])

    def due(self, epochs_done: int, final: bool) -> bool:
        """Every ``every`` epochs and after the final (last or early-stopped) epoch."""
        return self.every > 0 and (final or epochs_done % self.every == 0)

    def save(self, state: dict, epochs_done: int) -> str:
        path = checkpoint_path(self.dir, epochs_done)
        if self.writer:
            save_atomic(state, path)
            self.kept = [str(p) for p in prune(self.dir)]
        else:
            self.kept = (self.kept + [str(path)])[-KEEP:]
        return str(path)
