"""Keep freed large blocks in the process for reuse instead of returning them to the OS.

Every training step (and every sampled batch) allocates and frees the same large tensors:
activations, gradients, sampled ids. glibc serves a block of 128 KiB or more (its default
``M_MMAP_THRESHOLD``, raised dynamically up to 32 MiB) with a fresh ``mmap`` and unmaps it on
free, and trims the top of the heap beyond 128 KiB (``M_TRIM_THRESHOLD``): each step then pays
the kernel's zeroing and the page faults of tens of MB of fresh pages. Raising both thresholds
to ``retain_mb`` keeps those blocks in the heap, where the next step reuses them; the cost is
resident memory that stays at the step's peak plus up to ``retain_mb`` MiB freed at the top.
Measured on a 2-core machine (docs/benchmarks.md, "Allocator"): one GraphSAGE step on the rmat
family, 129 -> 96 ms for mfgserve's model and 189 -> 120 ms for DGL's.

Only glibc has ``mallopt``; elsewhere :func:`retain_freed_memory` does nothing and says so
(its return value; the trainer's and server's logs name it).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

from common.errors import ConfigError

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
DEFAULT_RETAIN_MB = 256
MAX_RETAIN_MB = 2047  # mallopt takes an int of bytes


def check_retain_mb(mb: int) -> None:
    """ConfigError naming ``--malloc-retain-mb`` unless ``mb`` is in 0..MAX_RETAIN_MB."""
    if not 0 <= mb <= MAX_RETAIN_MB:
        raise ConfigError(f"--malloc-retain-mb must be in 0..{MAX_RETAIN_MB} (0: the C "
                          f"library's defaults), got {mb}")


def _libc():
    """The process's own C library when it is glibc (the symbols already loaded), else None."""
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") \
            else None
    except OSError:
        return None


def retain_freed_memory(retain_mb: int, who: str = "this process") -> bool:
    """Set glibc's mmap and trim thresholds to ``retain_mb`` MiB (see the module docstring);
    0 leaves the allocator as it is. True when the setting took effect; False (with a warning
    naming ``who`` and the option) where the C library is not glibc or refused it."""
    if retain_mb <= 0:
        return False
    libc = _libc()
    value = min(retain_mb, MAX_RETAIN_MB) << 20
    ok = (libc is not None and libc.mallopt(M_MMAP_THRESHOLD, value) == 1
          and libc.mallopt(M_TRIM_THRESHOLD, value) == 1)
    if not ok:
        log.warning("%s: --malloc-retain-mb %d has no effect here (needs glibc's mallopt); "
                    "large tensors are allocated and freed by the C library's defaults",
                    who, retain_mb)
    return ok


def return_freed_memory() -> bool:
    """Give the heap's free memory back to the OS (glibc's ``malloc_trim(0)``), what
    ``retain_mb`` kept: True where some was returned; False where none was, or the C library
    is not glibc."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "malloc_trim") and libc.malloc_trim(0))


#: the smallest estimate :class:`HeapPrefault` acts on: below it a first step's fresh pages
#: cost a few milliseconds at most
PREFAULT_MIN_MB = 16
PREFAULT_MARGIN_MB = 16  # kept below the retain threshold: a block at it would be mmapped


def step_heap_mb(dst_rows: int, in_width: int, hidden: int) -> int:
    """An upper bound, in MiB, on the heap a CPU training step of a layered GNN allocates:
    its input layer's destination rows (``dst_rows``, a bound on the sources of the layers
    above: ``common.shm_ring.max_input_rows`` over the fanouts after the input layer's)
    times two ``in_width`` copies (the self term and the mean) and three ``hidden`` ones
    (the output, its gradient and the mean's backward), float32."""
    return -(-(dst_rows * (2 * in_width + 3 * hidden) * 4) // (1 << 20))


class HeapPrefault:
    """Faults in ``mb`` MiB of this process's heap in a background thread, so that the first
    training steps find their pages mapped.

    A fresh process's first steps allocate the step's whole working set (activations and
    gradients, 100-250 MB for the benchmark graphs) from pages the kernel has never given it.
    On a VM each first touch of a page costs several microseconds (session 59's AMD EPYC VM:
    about 10, with 28-51k faults in the first step: it took 250-490 ms against the 70-165 of
    the steps after it). Here the calling thread (the trainer's main thread, whose allocations
    the step's tensors come from) allocates one ``mb`` MiB block from glibc's main heap (no
    page is touched yet), and a thread writes every page of it and frees it. With
    :func:`retain_freed_memory` in effect (``mb`` below its thresholds) glibc keeps the freed
    block in the heap, where the step's tensors are then carved from mapped pages. The thread
    runs on a core the trainer's setup leaves idle (its main thread's setup is serial Python)
    and ends before the first step on the benchmark graphs; a step that comes first simply
    faults its own pages, as without it.

    Only with glibc: elsewhere (or if the block cannot be had) it does nothing and
    :attr:`reason` says why."""

    def __init__(self, mb: int):
        self.mb = 0
        self.seconds = 0.0
        self.reason = ""
        self.done_at_start: bool | None = None  # :meth:`training_starts` records it
        self._thread: threading.Thread | None = None
        libc = _libc()
        if libc is None or not hasattr(libc, "malloc") or not hasattr(libc, "free"):
            self.reason = "not glibc"
            return
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        size = int(mb) << 20
        ptr = libc.malloc(size)  # the main heap's block: nothing touched yet
        if not ptr:
            self.reason = f"malloc of {mb} MiB failed"
            return
        self.mb = int(mb)
        self._thread = threading.Thread(target=self._touch, args=(libc, ptr, size),
                                        name="mfgserve-heap-prefault", daemon=True)
        self._thread.start()

    def _touch(self, libc, ptr: int, size: int) -> None:
        t0 = time.perf_counter()
        try:
            ctypes.memset(ptr, 0, size)  # (ctypes releases the GIL for the call)
        finally:
            libc.free(ptr)  # back into the main heap, where retain keeps it
            self.seconds = time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def training_starts(self) -> None:
        """Record whether the pass is over as the first step begins (:meth:`summary`)."""
        self.done_at_start = self.done

    def summary(self) -> dict:
        """What it did, for a run's summary: ``mb`` (0: nothing), the thread's seconds, and
        whether it had finished when training started (where :meth:`training_starts` was
        called), or ``reason``."""
        out: dict = {"mb": self.mb, "s": round(self.seconds, 3), "done": self.done}
        if self.done_at_start is not None:
            out["done_before_training"] = self.done_at_start
        if self.reason:
            out["reason"] = self.reason
        return out


def prefault_step_heap(retained_mb: int, estimate_mb: int) -> HeapPrefault | dict:
    """A :class:`HeapPrefault` of ``estimate_mb`` (:func:`step_heap_mb`), capped below the
    ``--malloc-retain-mb`` that took effect (``retained_mb``, 0 where it did not); or, where
    it would not apply, a summary dict saying why."""
    if retained_mb <= 0:
        return {"mb": 0, "reason": "--malloc-retain-mb not in effect: a freed block would "
                                   "go back to the OS"}
    mb = min(estimate_mb, retained_mb - PREFAULT_MARGIN_MB)
    if mb < PREFAULT_MIN_MB:
        return {"mb": 0, "reason": f"the step's heap ({estimate_mb} MiB, capped at "
                                   f"{max(mb, 0)} MiB) is below {PREFAULT_MIN_MB} MiB"}
    return HeapPrefault(mb)
