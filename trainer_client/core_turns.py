"""``--yield-cores``: during the servers' turn the trainer's idle OpenMP threads give way.

When the loader alternates (``--prefetch auto`` on a CPU trainer whose torch threads cover
the cores, with a server on this host writing into its ring), each window of requests is the
servers' turn on the cores and each step the trainer's. After a step, libgomp's idle worker
threads spin for a few milliseconds before they sleep (its default wait policy, which the
step itself needs: docs/benchmarks.md, session 32), on a core a server thread now wants. A
typed window timed across the processes showed the second request reaching a sampling thread
3.6-6 ms after the first for that reason (session 44).

:class:`CoreTurns` makes the spinning give way:

- once, before training: it finds this process's OpenMP worker threads (the threads other
  than the caller that run while a parallel product runs, :func:`find_omp_workers`) and checks
  that a thread may leave ``SCHED_IDLE`` again here (:func:`idle_is_reversible`: an
  unprivileged process needs ``RLIMIT_NICE`` >= 20 for that);
- at the first window: it pins the calling thread to the first core this process may use and
  each worker to one of the next ones (a step's threads then stay on their cores);
- for every window: the workers go to ``SCHED_IDLE`` before the requests are sent (a spinning
  worker then yields its core to any server thread at once) and back to ``SCHED_OTHER`` when
  the window's replies are in, before the next step. During a step they are ordinary threads,
  so other load on the host cannot starve them.

Measured on the 2-core RMAT benchmark graph, worker mode alternated with and without it, on an
AMD EPYC VM: ahead in 13 of 15 pairs, a median of +5.7 % seeds/s; products +1.5 % (2 of 3;
docs/benchmarks.md, "Issue 14, session 44"). On an Intel Xeon VM it read even (a median of
1.00 over 7 RMAT pairs; session 48). Where anything fails (no ``/proc`` schedstat, a refused
policy, fewer cores than threads), it turns itself off and says why in the trainer's summary
(``core_turns``); the run goes on as without it.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger("mfgserve.trainer")


def _runtime_ns() -> dict[int, int]:
    """Nanoseconds each thread of this process has run (``/proc/self/task/*/schedstat``)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/task")
    except OSError:
        return out
    for name in names:
        try:
            with open(f"/proc/self/task/{name}/schedstat") as f:
                out[int(name)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def find_omp_workers(products: int = 12, size: int = 512) -> list[int]:
    """Thread ids of this process's OpenMP worker threads: the threads other than the caller
    that ran for at least an eighth of the caller's time while the caller ran ``products``
    parallel ``size`` x ``size`` products. A worker computes its share of each (the caller
    cannot finish one without it) or spins between them; the process's other threads (the
    sockets' I/O, a progress bar's monitor) run for microseconds meanwhile. Empty where
    ``/proc`` has no schedstat."""
    me = threading.get_native_id()
    a = torch.randn(size, size)
    with torch.no_grad():
        torch.mm(a, a)  # the pool's threads exist before the count starts
        before = _runtime_ns()
        for _ in range(products):
            torch.mm(a, a)
        after = _runtime_ns()
    mine = after.get(me, 0) - before.get(me, 0)
    if mine <= 0:
        return []
    return sorted(t for t, ns in after.items()
                  if t != me and ns - before.get(t, ns) >= mine / 8)


def idle_is_reversible() -> str:
    """"" when a thread of this process may enter ``SCHED_IDLE`` and leave it again (tried on
    a throwaway thread), else why not."""
    why: list[str] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError) as e:
            why.append(f"SCHED_IDLE refused: {e}")
            return
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError as e:
            why.append(f"a thread may not leave SCHED_IDLE here ({e}); it takes CAP_SYS_NICE "
                       "or RLIMIT_NICE >= 20 (ulimit -e)")

    t = threading.Thread(target=probe, name="mfgserve-idle-probe")
    t.start()
    t.join()
    return why[0] if why else ""


class CoreTurns:
    """The OpenMP workers of this trainer, pinned and yielding during each window of
    requests (see the module docstring). Never raises: a failure turns it off (``reason``)."""

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        self.active = False
        self.reason = ""
        self.workers: list[int] = []
        self.cores: list[int] = []
        self.main = threading.get_native_id()
        self.windows = 0
        self._pinned = False
        self._idle = False

    @classmethod
    def start(cls, mode: str, alternates: bool) -> CoreTurns:
        """Find the workers and check the policy switch (once, before training), for a trainer
        that may take turns with servers on its host (``alternates``)."""
        turns = cls(mode)
        if mode == "off":
            turns.reason = "--yield-cores off"
        elif not alternates:
            turns.reason = ("the trainer does not alternate with the servers (a CPU trainer "
                            "whose torch threads cover the cores alternates)")
        elif not hasattr(os, "sched_setaffinity") or not hasattr(os, "SCHED_IDLE"):
            turns.reason = "this OS has no thread affinity or SCHED_IDLE"
        else:
            turns._find()
        if turns.reason:
            log.info("--yield-cores: off (%s)", turns.reason)
        return turns

    def _find(self) -> None:
        threads = torch.get_num_threads()
        cores = sorted(os.sched_getaffinity(0))
        if threads < 2:
            self.reason = "one torch thread: no OpenMP worker to yield"
            return
        if threads > len(cores):
            self.reason = (f"{threads} torch threads on {len(cores)} cores: one core per "
                           "thread is not possible")
            return
        workers = find_omp_workers()
        if len(workers) != threads - 1:
            self.reason = (f"found {len(workers)} threads running a parallel product besides "
                           f"this one, expected {threads - 1} OpenMP workers")
            return
        why = idle_is_reversible()
        if why:
            self.reason = why
            return
        self.workers, self.cores, self.active = workers, cores[:threads], True

    def give(self) -> None:
        """Before a window's requests go out: the workers yield their cores (pinned first,
        at the first window)."""
        if not self.active:
            return
        try:
            if not self._pinned:
                os.sched_setaffinity(self.main, {self.cores[0]})
                for tid, core in zip(self.workers, self.cores[1:]):
                    os.sched_setaffinity(tid, {core})
                self._pinned = True
            for tid in self.workers:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            self._idle = True
            self.windows += 1
        except OSError as e:
            self._fail(e)

    def take(self) -> None:
        """The window's replies are in: the workers are ordinary threads again."""
        if not (self.active and self._idle):
            return
        try:
            for tid in self.workers:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            self._idle = False
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        """Off for the rest of the run, the workers back to ordinary threads where possible."""
        self.active = False
        self.reason = f"stopped after {self.windows} windows: {e}"
        log.warning("--yield-cores: %s; the run goes on without it", self.reason)
        for tid in self.workers:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass

    def summary(self) -> dict:
        """The trainer summary's ``core_turns``."""
        return {"mode": self.mode, "active": self.active, "reason": self.reason,
                "omp_workers": len(self.workers), "cores": self.cores if self._pinned else [],
                "windows": self.windows}
