"""Files read into the page cache in order, before the random reads that follow.

A trainer that reads its input rows from the partition set's ``feat.npy`` in place
(``--local-features``, trainer_client/local_features.py) indexes a read-only map at random
rows. Where the page cache has lost the file (another job's files, a reclaim daemon, a fresh
boot), each batch's first gathers fault the file in a page at a time: on the products-shaped
graph the first step took 4.7 s (68k faults in ``index_select``) against 236 ms with the file
cached, while reading the same 400 MB in order takes 0.6 s (docs/benchmarks.md, "Issue 14,
session 56"). DGL's pipeline loads its feature tensor into memory before its first step; this
module does the same for a map: :class:`Warmer` reads, in a background thread, the blocks of
each file that are not already in the page cache (``mincore``), in file order, so the map's
later faults find their pages. A set larger than the memory free for it is not read (the
reason is reported): its pages would evict each other.
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

BLOCK = 8 << 20  # bytes per read
_PROT_READ, _MAP_SHARED = 1, 0x01


def linux_libc():
    """The C library with ``mmap``, ``munmap`` and ``mincore`` typed, on Linux; else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident(path: str) -> np.ndarray | None:
    """Which of ``path``'s pages are in the page cache now (a bool per page of
    ``mmap.PAGESIZE`` bytes), or None where it cannot be asked (not Linux, or ``mincore``
    failed). Maps the file without touching it: asking loads nothing."""
    libc = linux_libc()
    if libc is None:
        return None
    size = os.path.getsize(path)
    page = _mmap.PAGESIZE
    pages = -(-size // page)
    if pages == 0:
        return np.zeros(0, dtype=bool)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = np.zeros(pages, dtype=np.uint8)
        if libc.mincore(addr, size, vec.ctypes.data) != 0:
            return None
    finally:
        libc.munmap(addr, size)
    return (vec & 1).astype(bool)


def resident_fraction(path: str) -> float | None:
    """The share of ``path``'s pages in the page cache (1.0 for an empty file), or None
    where it cannot be asked (:func:`resident`)."""
    r = resident(path)
    if r is None:
        return None
    return float(r.mean()) if r.size else 1.0


def _missing_blocks(path: str, size: int, block: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each ``block``-byte stretch of ``path`` that holds a page not
    in the page cache (every stretch where residency cannot be asked)."""
    spans = [(o, min(block, size - o)) for o in range(0, size, block)]
    r = resident(path)
    if r is None:
        return spans
    page = _mmap.PAGESIZE
    return [(o, n) for o, n in spans if not r[o // page:-(-(o + n) // page)].all()]


class Warmer:
    """Reads ``paths`` into the page cache in a background thread (started at once): each
    file's missing blocks in order, ``block`` bytes a read. Not where they would not fit:
    where the missing bytes exceed ``max_fraction`` of the memory available now
    (``psutil``), nothing is read and :attr:`reason` says why. :meth:`wait` blocks until it
    is done and returns what it did (:meth:`summary`). A read that fails (a file removed)
    ends the pass; the error is in the summary, the caller's reads go on from the map."""

    def __init__(self, paths: Sequence[str], *, block: int = BLOCK,
                 max_fraction: float = 0.5):
        self.paths = list(paths)
        self.block = max(int(block) // _mmap.PAGESIZE, 1) * _mmap.PAGESIZE
        self.bytes_read = 0
        self.bytes_total = 0
        self.seconds = 0.0
        self.reason = ""
        self.error = ""
        self._max_fraction = max_fraction
        self._thread = threading.Thread(target=self._run, name="mfgserve-page-cache-warmer",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            plan = []
            for path in self.paths:
                size = os.path.getsize(path)
                self.bytes_total += size
                plan.append((path, _missing_blocks(path, size, self.block)))
            missing = sum(n for _, spans in plan for _, n in spans)
            import psutil
            avail = psutil.virtual_memory().available
            if missing > self._max_fraction * avail:
                self.reason = (f"{missing / 1e6:.0f} MB not in the page cache, more than "
                               f"{self._max_fraction:.0%} of the {avail / 1e6:.0f} MB "
                               "available: read from the map as needed")
                return
            buf = bytearray(self.block)
            view = memoryview(buf)
            for path, spans in plan:
                if not spans:
                    continue
                fd = os.open(path, os.O_RDONLY)
                try:
                    for off, n in spans:
                        got = os.preadv(fd, [view[:n]], off)
                        self.bytes_read += got
                        if got < n:  # (the file shrank under us: the rest is not there)
                            break
                finally:
                    os.close(fd)
        except Exception as e:  # noqa: BLE001 - a warm-up only: the map reads as needed
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the pass is over (at most ``timeout`` seconds); :meth:`summary`."""
        self._thread.join(timeout)
        return self.summary()

    def summary(self) -> dict:
        out: dict = {"files": len(self.paths), "mb": round(self.bytes_total / 1e6, 1),
                     "mb_read": round(self.bytes_read / 1e6, 1), "s": round(self.seconds, 3),
                     "done": self.done}
        if self.reason:
            out["reason"] = self.reason
        if self.error:
            out["error"] = self.error
        return out
