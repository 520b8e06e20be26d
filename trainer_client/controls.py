"""Training controls: learning-rate schedule, gradient clipping, early stopping, per-epoch seeds.

All are decided identically on every DDP rank without extra communication: the schedule
depends only on the epoch, clipping sees the gradients DDP already averaged, and early
stopping reads the validation accuracy that evaluation all-reduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from common.config import TrainerConfig


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainerConfig):
    """The ``--lr-schedule`` as a torch scheduler stepped once per epoch, or None."""
    if cfg.lr_schedule == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=cfg.lr_step_epochs,
                                               gamma=cfg.lr_gamma)
    if cfg.lr_schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    return None


def scheduled_lr(cfg: TrainerConfig, epoch: int) -> float:
    """The learning rate of ``epoch`` (from 0) under ``cfg``'s schedule, in closed form (what
    the scheduler yields; tests compare the two)."""
    if cfg.lr_schedule == "step":
        return cfg.lr * cfg.lr_gamma ** (epoch // cfg.lr_step_epochs)
    if cfg.lr_schedule == "cosine":
        return cfg.lr * (1 + math.cos(math.pi * epoch / cfg.epochs)) / 2
    return cfg.lr


def clip_gradients(net: nn.Module, max_norm: float) -> float:
    """Scale the gradients down to a global L2 norm of at most ``max_norm``; returns the norm
    before clipping. Called after the non-finite check (a NaN norm would only spread NaN)."""
    params = [p for p in net.parameters() if p.grad is not None]
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The torch seed of one rank's epoch: a resumed run draws exactly the numbers (dropout
    masks) the uninterrupted run drew, whatever happened before the epoch."""
    return ((seed * 1_000_003 + epoch) * 65_537 + rank) % (2**63 - 1)


@dataclass
class EarlyStopping:
    """``--patience``: stop after that many evaluations without a better valid_acc (0: off)."""

    patience: int
    bad_evals: int = 0  # evaluations since the best one
    stopped: bool = False

    def update(self, improved: bool) -> bool:
        """Record one evaluation; returns whether training stops now."""
        self.bad_evals = 0 if improved else self.bad_evals + 1
        self.stopped = self.patience > 0 and self.bad_evals >= self.patience
        return self.stopped

    def state(self) -> dict:
        return {"bad_evals": self.bad_evals, "stopped": self.stopped}

    def load(self, state: dict) -> None:
        self.bad_evals, self.stopped = int(state["bad_evals"]), bool(state["stopped"])
