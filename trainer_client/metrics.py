"""The task a partition set poses, its loss and its evaluation metric.

Two tasks, as ogb's meta_dict names them (partition/layout.py ``task_type``):

* ``multiclass``: labels int64 ``[n]`` (a class, ``-1`` unlabelled), cross-entropy, metric
  ``acc``;
* ``binary`` (multi-label, e.g. ogbn-proteins' 112 tasks): labels float32 ``[n, T]`` (0 / 1,
  NaN unknown), logits ``[n, T]``, binary cross-entropy over the labelled entries, metric
  ``rocauc`` computed exactly as ogb's evaluator does (:func:`rocauc`) over ALL the
  predictions of a split (every rank's rows gathered: :func:`gather_rows`), never averaged
  per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from common.errors import MfgServeError

__all__ = ["TASK_METRICS", "Task", "task_of", "rocauc", "rank0_rocauc", "check_shared_score",
           "loss_fn", "gather_rows"]

OGB_PROTEINS_TASKS = 112  # Evaluator('ogbn-proteins') checks for exactly this many


@dataclass(frozen=True)
class Task:
    task_type: str = "multiclass"  # "multiclass" | "binary"
    num_tasks: int = 1
    eval_metric: str = "acc"  # "acc" | "rocauc"

    @property
    def binary(self) -> bool:
        return self.task_type == "binary"


TASK_METRICS = {"multiclass": "acc", "binary": "rocauc"}  # the metric of each task type


def task_of(info) -> Task:
    """The task of the served partition set, as the servers' ping reply (``info``, a
    :class:`common.messages.Pong`) names it from the partition metadata. Raises :class:`MfgServeError` when the reply
    does not name a task this trainer knows."""
    task_type, num_tasks, metric = (getattr(info, "task_type", ""),
                                    int(getattr(info, "num_tasks", 0)),
                                    getattr(info, "eval_metric", ""))
    if task_type not in TASK_METRICS or metric != TASK_METRICS[task_type] or num_tasks < 1 \
            or (task_type == "multiclass" and num_tasks != 1):
        raise MfgServeError(
            f"the servers of {getattr(info, 'dataset', '?')} name task {task_type or '(none)'!r} "
            f"with {num_tasks} task(s) and metric {metric or '(none)'!r}; this trainer knows "
            "multiclass (1 task, acc) and binary (rocauc): re-run partition-ogbn, or run "
            "servers and trainers of the same mfgserve version")
    return Task(task_type, num_tasks, metric)


def loss_fn(task: Task, logits: Tensor, label: Tensor) -> Tensor:
    """Cross-entropy (multiclass), or binary cross-entropy with logits over the labelled
    (non-NaN) entries (binary tasks; 0 when a batch has none)."""
    if not task.binary:
        return F.cross_entropy(logits, label)
    known = ~torch.isnan(label)
    if not bool(known.any()):
        return logits.sum() * 0.0
    return F.binary_cross_entropy_with_logits(logits[known], label[known])


def rocauc(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """ROC-AUC averaged over the tasks exactly as ogb computes it: ogb's own
    ``Evaluator('ogbn-proteins')`` when there are 112 tasks, else the same per-task loop
    (ogb/nodeproppred/evaluate.py ``_eval_rocauc``): a task counts when it has a positive
    and a negative label; its AUC is sklearn's over its labelled (non-NaN) rows. Raises
    :class:`MfgServeError` when no task has both labels."""
    y_true = np.asarray(y_true, dtype=np.float32)
    y_pred = np.asarray(y_pred, dtype=np.float32)
    if y_true.ndim == 1:
        y_true, y_pred = y_true.reshape(-1, 1), y_pred.reshape(-1, 1)
    try:
        if y_true.shape[1] == OGB_PROTEINS_TASKS:
            from ogb.nodeproppred import Evaluator

            return float(Evaluator("ogbn-proteins").eval(
                {"y_true": y_true, "y_pred": y_pred})["rocauc"])
        from sklearn.metrics import roc_auc_score

        scores = []
        for i in range(y_true.shape[1]):
            col = y_true[:, i]
            if np.sum(col == 1) > 0 and np.sum(col == 0) > 0:
                labeled = col == col
                scores.append(roc_auc_score(col[labeled], y_pred[labeled, i]))
        if not scores:
            raise RuntimeError("No positively labeled data available. Cannot compute ROC-AUC.")
        return float(sum(scores) / len(scores))
    except RuntimeError as e:
        raise MfgServeError(f"ROC-AUC over {y_true.shape[0]} nodes: {e} (every task lacks "
                            "a positive or a negative label in this split)") from e


def rank0_rocauc(y_true, y_pred, rank: int) -> tuple[float, str]:
    """For scoring a gathered split once (rank 0) and sharing the score with a sum over the
    ranks: ``(rocauc, "")`` on rank 0, ``(0.0, "")`` elsewhere, and ``(nan, why)`` when rank 0
    cannot score it, so that the NaN in the sum tells every rank to raise (:func:`
    check_shared_score`) instead of rank 0 raising alone while the others wait in the
    collective."""
    if rank != 0:
        return 0.0, ""
    try:
        return rocauc(y_true, y_pred), ""
    except MfgServeError as e:
        return float("nan"), str(e)


def check_shared_score(score: float, error: str, what: str) -> float:
    """``score`` (a sum of :func:`rank0_rocauc` values over the ranks), or the error: rank 0's
    message, or on another rank one naming rank 0's failure."""
    if score != score:  # NaN
        raise MfgServeError(error or f"{what}: rank 0 could not compute the ROC-AUC (its log "
                            "names why)")
    return score


def gather_rows(t: Tensor, world_size: int) -> Tensor:
    """Every rank's rows of ``t`` (same trailing shape and dtype on every rank, any row
    count), concatenated in rank order on every rank (one size all-gather, one padded
    all-gather)."""
    if world_size <= 1:
        return t
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    counts = [int(s) for s in sizes]
    top = max(counts)
    padded = torch.zeros((top, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[:c] for o, c in zip(out, counts)])
