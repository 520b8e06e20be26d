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
