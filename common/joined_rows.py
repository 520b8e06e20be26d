"""Several parts' feature files mapped as one matrix, so a trainer that reads a multi-part
set's rows in place (``--local-features``, trainer_client/local_features.py) indexes one
tensor, as with a one-part set.

Each part's ``feat.npy`` is mapped read-only (``MAP_SHARED``: the page cache the servers and
the parts' own maps read, nothing copied) at an address inside one reserved range
(``PROT_NONE``, no memory), chosen so that every part's first row lies a whole number of rows
after part 0's: part ``p``'s row ``r`` is the joined matrix's row ``starts[p] + r``. The rows
between two parts are a gap no id maps to. A file's mapping must start on a page boundary,
so part ``p`` can start at row ``k`` only where ``header_0 + k * row_bytes - header_p`` is a
multiple of the page size (:func:`layout`); where no row is (``gcd(row_bytes, page)`` does
not divide the difference of the two header lengths), or the platform has no ``mmap`` with
``MAP_FIXED`` (not Linux), :func:`join` says why and the caller reads the parts one by one
(:class:`~common.mfg.SourceRows` over several matrices).

Why: with several matrices SAGEConv's mean splits each batch's bags by part and runs one
``embedding_bag`` per part, writing every destination's row once per part, and the
destinations' rows are copied part by part: 2 parts cost about twice one part's mean
(docs/benchmarks.md, "Issue 14, session 54"). Over the joined matrix the mean is the one-part
mean; only the ids are rebased (:meth:`JoinedRows.source_rows`, one native pass).
"""

from __future__ import annotations

import ctypes
import math
import mmap as _mmap
import os
import sys
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.mfg import SourceRows, owners
from common.page_cache import linux_libc

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED = 0x01, 0x02, 0x10
_MAP_ANONYMOUS, _MAP_NORESERVE = 0x20, 0x4000  # Linux's values


def layout(headers: Sequence[int], rows: Sequence[int], row_bytes: int,
           page: int = _mmap.PAGESIZE) -> tuple[list[int], list[int], int] | None:
    """Where each part goes in one range: ``(starts, map_at, size)``. Part ``p``'s rows
    start at joined row ``starts[p]`` (part 0 at 0, each after the previous part's last row);
    its file (``headers[p]`` bytes of header, then ``rows[p]`` rows of ``row_bytes``) is
    mapped at byte ``map_at[p]`` of the range (a page boundary, after the previous file's
    pages), so its first row is at byte ``headers[0] + starts[p] * row_bytes``; ``size``:
    the range's bytes (whole pages). None where some part has no such start (such starts
    recur every ``page // gcd(row_bytes, page)`` rows: none among the first that many)."""
    if row_bytes <= 0 or len(headers) != len(rows) or not rows:
        return None
    step = page // math.gcd(row_bytes, page)  # rows between two page-aligned starts
    starts, map_at = [0], [0]
    end_row = rows[0]
    end_byte = headers[0] + rows[0] * row_bytes  # the previous file's mapping ends here
    for h, n in zip(headers[1:], rows[1:]):
        first_page = -(-end_byte // page) * page
        # the earliest row k >= end_row whose file mapping starts on a page at or after
        # first_page: headers[0] + k * row_bytes - h, a multiple of page, >= first_page
        k = max(end_row, -(-(first_page + h - headers[0]) // row_bytes))
        for _ in range(step):
            if (headers[0] + k * row_bytes - h) % page == 0:
                break
            k += 1
        else:
            return None
        starts.append(k)
        map_at.append(headers[0] + k * row_bytes - h)
        end_row = k + n
        end_byte = headers[0] + end_row * row_bytes
    return starts, map_at, -(-end_byte // page) * page


@dataclass
class JoinedRows:
    """The parts' matrices as one: ``matrix`` (read-only; rows between parts never read),
    part ``p``'s row ``r`` at ``starts[p] + r``; ``offsets`` the set's node offsets (node
    ``gid`` of part ``p`` is its row ``gid - offsets[p]``)."""

    matrix: Tensor
    starts: list[int]
    offsets: list[int]

    def rows_of(self, ids: Tensor) -> Tensor:
        """The joined matrix's row of each global node id (int64; ValueError for an id outside
        the set; :func:`common.mfg.owners`)."""
        return owners(ids, self.offsets, base=self.starts, with_part=False)[1]

    def source_rows(self, ids: Tensor) -> SourceRows:
        """A batch's source rows (global node ids ``ids``) over the joined matrix."""
        return SourceRows(self.matrix, self.rows_of(ids))


def join(arrays: Sequence[np.memmap], offsets: Sequence[int]) -> tuple[JoinedRows | None, str]:
    """The parts' feature arrays (``np.load(..., mmap_mode="r")`` of each ``feat.npy``, one
    dtype and width, C order) mapped as one matrix: ``(JoinedRows, "")``, or ``(None, why
    not)``. The range is unmapped when the last tensor over it is freed."""
    if len(arrays) < 2:
        return None, "one part"
    libc = linux_libc()
    if libc is None:
        return None, f"no mmap with MAP_FIXED on {sys.platform}"
    first = arrays[0]
    if any(not isinstance(a, np.memmap) or a.ndim != 2 or not a.flags.c_contiguous
           or a.dtype != first.dtype or a.shape[1] != first.shape[1] for a in arrays):
        return None, "the parts' features are not C-order maps of one dtype and width"
    if [a.shape[0] for a in arrays] != [b - a for a, b in zip(offsets, offsets[1:])]:
        return None, "the parts' rows do not match the node offsets"
    files = [f for f in (a.filename for a in arrays) if f is not None]
    if len(files) != len(arrays):
        return None, "the parts' features are not maps of files"
    row_bytes = first.shape[1] * first.dtype.itemsize
    plan = layout([int(a.offset) for a in arrays], [a.shape[0] for a in arrays], row_bytes)
    if plan is None:
        return None, (f"no page-aligned start for a part's rows ({row_bytes}-byte rows, "
                      f"headers {[int(a.offset) for a in arrays]} bytes)")
    starts, map_at, size = plan
    base = libc.mmap(None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
                     -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        return None, f"cannot reserve {size} bytes of address space ({os.strerror(ctypes.get_errno())})"
    try:
        for a, at, file in zip(arrays, map_at, files):
            length = int(a.offset) + a.shape[0] * row_bytes
            if length == 0:
                continue
            fd = os.open(file, os.O_RDONLY)
            try:
                got = libc.mmap(base + at, length, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0)
            finally:
                os.close(fd)
            if got != base + at:
                raise OSError(ctypes.get_errno(), f"mmap of {file}: "
                              f"{os.strerror(ctypes.get_errno())}")
    except OSError as e:
        libc.munmap(base, size)
        return None, f"cannot map the parts' features as one ({e})"
    total_rows = starts[-1] + arrays[-1].shape[0]
    buf = (ctypes.c_char * (total_rows * row_bytes)).from_address(base + int(first.offset))
    weakref.finalize(buf, libc.munmap, base, size)  # after the last view of buf is freed
    view = np.frombuffer(buf, dtype=first.dtype).reshape(total_rows, first.shape[1])
    view.flags.writeable = False  # mapped read-only: a write would fault
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch's note on read-only arrays)
        matrix = torch.from_numpy(view)
    return JoinedRows(matrix, starts, [int(o) for o in offsets]), ""
