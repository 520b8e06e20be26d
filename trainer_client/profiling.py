"""``--profile-steps N``: torch.profiler over N training steps of a run's first epoch.

Rank 0 profiles steps ``[start, start + N)`` of the first epoch it trains, ``start`` being 5
(the first steps warm the allocator, the ring and the caches) or fewer where the epoch is
short, and writes the operators by self time to ``<run dir>/profile.txt``: sorted by host
time, and on a GPU a second table sorted by the time of their CUDA kernels. The summary's
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
        self._cuda = device.type == "cuda"
        self.written = False
        self._prof: profile | None = None
        self._start = self._count = 0

    def epoch_start(self, num_batches: int) -> None:
        """Called before an epoch's first step: where its profiled window starts."""
        self._start = min(WARM_STEPS, max(0, num_batches - self.steps))

    def before(self, batch: int) -> None:
        if self.written or self._prof is not None or batch != self._start:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
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
        if self._cuda:
            torch.cuda.synchronize(self.device)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        head = (f"# torch.profiler: {self._count} training steps from step {self._start} of "
                f"the first epoch, device {self.device}")
        events = prof.key_averages()
        text = (f"{head}; operators by self CPU time, the top {ROWS}\n"
                + events.table(sort_by="self_cpu_time_total", row_limit=ROWS) + "\n")
        if self._cuda:  # the same operators by their kernels' time
            text += (f"\n# operators by self CUDA time, the top {ROWS}\n"
                     + events.table(sort_by="self_device_time_total", row_limit=ROWS) + "\n")
        tmp = self.path.with_suffix(".txt.tmp")
        tmp.write_text(text)
        tmp.replace(self.path)
        self.written = True
