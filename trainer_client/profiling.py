"""``--profile-steps N``: torch.profiler over N training steps of a run's first epoch.

Rank 0 profiles steps ``[start, start + N)`` of the first epoch it trains, ``start`` being 5
(the first steps warm the allocator, the ring and the caches) or fewer where the epoch is
short, and writes the operators by self time to ``<run dir>/profile.txt``: host operators,
and on a GPU the CUDA kernels too, sorted by their device time. The summary's
``files.profile`` names the file. The profile covers whole steps as the trainer runs them:
the loss read of the step before (``stages_s.loss_read_s``), forward, backward and the
optimizer step; the loader's own thread is not in it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

WARM_STEPS = 5  # steps before the profiled ones (fewer where the epoch is short)
ROWS = 40  # operators in the table


class StepProfiler:
    """Profiles ``steps`` consecutive training steps once, then writes ``path``."""

    def __init__(self, steps: int, device: torch.device, path: Path):
        self.steps, self.device, self.path = steps, device, path
        self.written = False
        self._prof: profile | None = None
        self._start = self._count = 0

    def epoch_start(self, num_batches: int) -> None:
        """Called before an epoch's first step: where its profiled window starts."""
        self._start = min(WARM_STEPS, max(0, num_batches - self.steps))

    def before(self, batch: int) -> None:
        if self.written or self._prof is not None or batch != self._start:
            return
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._count = 0

    def after(self) -> None:
        if self._prof is None:
            return
        self._count += 1
        if self._count >= self.steps:
            self.finish()

    def finish(self) -> None:
        """End the window (at its last step, or at the epoch's end) and write the table."""
        if self._prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        cuda = self.device.type == "cuda"
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=ROWS)
        head = (f"# torch.profiler: {self._count} training steps from step {self._start} of "
                f"the first epoch, device {self.device}; operators by self "
                f"{'CUDA' if cuda else 'CPU'} time, the top {ROWS}\n")
        tmp = self.path.with_suffix(".txt.tmp")
        tmp.write_text(head + table + "\n")
        tmp.replace(self.path)
        self.written = True
