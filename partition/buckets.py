"""Append-only int64 buckets on disk, for sorting more data than fits in memory.

A streaming pass that must group values by a key it only knows per chunk (edges by their
destination's part, adjacency by node block, ...) appends each chunk's values to per-bucket
files with :class:`BucketFiles`, then reads one bucket at a time back. Only the write buffers
(``buffer_bytes`` in all) and the bucket being read are ever in memory.

Writes are plain ``file.write`` calls of buffered, contiguous blocks: the data goes to the
page cache, which the kernel may drop or write back at will, so it never counts in this
process's resident set (an ``np.memmap`` written through would count its dirty pages). Reads
use ``np.fromfile``: one bucket is one allocation.

Usage::

    with BucketFiles(tmp_dir, num_parts) as b:
        for src, dst in chunks:
            b.add(owner[dst], key[...])
        for p in range(num_parts):
            keys = b.read(p)      # int64, in the order added
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["BucketFiles"]

_ITEM = 8  # bytes per int64 value


class BucketFiles:
    """``num_buckets`` append-only int64 files under a fresh subdirectory of ``directory``.

    ``buffer_bytes`` bounds the memory of the write buffers (all buckets together); a bucket's
    buffer is flushed when it fills, and every buffer before a :meth:`read` or :meth:`flush`.
    :meth:`close` (or leaving the ``with`` block) deletes the files and their directory.
    """

    def __init__(self, directory: str | os.PathLike, num_buckets: int,
                 buffer_bytes: int = 64 << 20):
        if num_buckets < 1:
            raise ValueError(f"BucketFiles: num_buckets={num_buckets} must be >= 1")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="buckets-", dir=directory))
        self.num_buckets = int(num_buckets)
        # per-bucket buffer capacity in values; at least 4096 values (32 KiB) each, so that
        # many buckets with a small budget still write reasonably large blocks
        self._cap = max(4096, int(buffer_bytes) // (_ITEM * self.num_buckets))
        self._bufs: list[list[np.ndarray]] = [[] for _ in range(self.num_buckets)]
        self._buffered = np.zeros(self.num_buckets, dtype=np.int64)
        self._counts = np.zeros(self.num_buckets, dtype=np.int64)
        self._closed = False

    def path(self, b: int) -> Path:
        """File holding bucket ``b``."""
        return self.dir / f"bucket-{b:05d}.bin"

    def add(self, bucket_ids: np.ndarray, values: np.ndarray) -> None:
        """Append ``values[i]`` to bucket ``bucket_ids[i]`` (order kept within a bucket)."""
        self._check_open()
        bucket_ids = np.asarray(bucket_ids)
        values = np.asarray(values, dtype=np.int64)
        if bucket_ids.shape != values.shape or values.ndim != 1:
            raise ValueError(
                f"BucketFiles.add: bucket_ids {bucket_ids.shape} and values {values.shape} "
                "must be 1-D of the same length")
        if values.shape[0] == 0:
            return
        if self.num_buckets == 1:
            groups = [(0, values)]
        else:
            if bucket_ids.min() < 0 or bucket_ids.max() >= self.num_buckets:
                raise ValueError(
                    f"BucketFiles.add: bucket ids span [{bucket_ids.min()}, "
                    f"{bucket_ids.max()}], outside [0, {self.num_buckets})")
            # a stable sort of 16-bit keys is a radix sort in numpy: O(n), ~5x int64's
            keys = (bucket_ids.astype(np.uint16, copy=False) if self.num_buckets <= 1 << 16
                    else bucket_ids)
            order = np.argsort(keys, kind="stable")
            del keys
            counts = np.bincount(bucket_ids, minlength=self.num_buckets)
            ends = np.cumsum(counts)
            grouped = values[order]
            del order
            groups = [(int(b), grouped[ends[b] - counts[b]: ends[b]])
                      for b in np.flatnonzero(counts)]
        for b, vals in groups:
            self._bufs[b].append(vals.copy())  # never a view of the caller's or shared array
            self._buffered[b] += vals.shape[0]
            self._counts[b] += vals.shape[0]
            if self._buffered[b] >= self._cap:
                self._flush_one(b)

    def _flush_one(self, b: int) -> None:
        if self._buffered[b]:
            block = (self._bufs[b][0] if len(self._bufs[b]) == 1
                     else np.concatenate(self._bufs[b]))
            # opened per flush (append), so thousands of buckets never exhaust file handles
            with open(self.path(b), "ab") as f:
                f.write(memoryview(np.ascontiguousarray(block)).cast("B"))
            self._bufs[b] = []
            self._buffered[b] = 0

    def flush(self) -> None:
        """Write every buffered value to its file."""
        self._check_open()
        for b in range(self.num_buckets):
            self._flush_one(b)

    def count(self, b: int) -> int:
        """Number of values appended to bucket ``b`` so far."""
        return int(self._counts[b])

    def counts(self) -> np.ndarray:
        """Values per bucket (int64 [num_buckets], a copy)."""
        return self._counts.copy()

    def read(self, b: int) -> np.ndarray:
        """All values of bucket ``b`` (int64, in the order added); buffers are flushed first."""
        self.flush()
        if self._counts[b] == 0:
            return np.empty(0, dtype=np.int64)
        arr = np.fromfile(self.path(b), dtype=np.int64)
        if arr.shape[0] != self._counts[b]:
            raise OSError(f"{self.path(b)} holds {arr.shape[0]} values, expected "
                          f"{int(self._counts[b])} (the temp directory was changed underneath)")
        return arr

    def read_chunks(self, b: int, rows: int):
        """Bucket ``b`` as consecutive int64 blocks of at most ``rows`` values (in the order
        added), each read with ``np.fromfile`` (a private buffer, never a mapping)."""
        self.flush()
        total = int(self._counts[b])
        if total == 0:
            return
        with open(self.path(b), "rb") as f:
            done = 0
            while done < total:
                block = np.fromfile(f, dtype=np.int64, count=min(int(rows), total - done))
                if block.shape[0] == 0:
                    raise OSError(f"{self.path(b)} ends after {done} of {total} values")
                done += block.shape[0]
                yield block

    def discard(self, b: int) -> None:
        """Delete bucket ``b``'s file (its disk space) once it is no longer needed; later
        ``add`` calls to it start it afresh."""
        self._check_open()
        self._bufs[b] = []
        self._buffered[b] = 0
        self._counts[b] = 0
        try:
            os.unlink(self.path(b))
        except FileNotFoundError:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("BucketFiles is closed")

    def close(self) -> None:
        """Close and delete the bucket files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._bufs = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> BucketFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a forgotten close() still removes the files
        try:
            self.close()
        except Exception:
            pass
