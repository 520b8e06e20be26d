"""common/page_cache.py: residency asked without loading, a file's missing blocks read in
order in a background thread, nothing read where the missing bytes would not fit, a failed
read reported (not raised). The worker-mode run that uses it, as a user runs it, is in
tests/test_local_features.py (the two-part set's files evicted first)."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest

from common.page_cache import Warmer, resident, resident_fraction

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="mincore and posix_fadvise: Linux")


def evict(path) -> None:
    """Drop ``path``'s clean pages from the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cold_file(tmp_path, nbytes: int) -> str:
    path = str(tmp_path / "feat.bin")
    np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8).tofile(path)
    evict(path)
    frac = resident_fraction(path)
    if frac is None or frac > 0.05:
        pytest.skip(f"this file system keeps {path} in memory after POSIX_FADV_DONTNEED "
                    f"(resident {frac}): a cold file cannot be made here")
    return path


@pytest.mark.timeout(60)
def test_warmer_reads_a_cold_file_in_and_then_nothing(tmp_path):
    path = _cold_file(tmp_path, 24 << 20)
    # asking is not loading
    assert resident_fraction(path) <= 0.05
    s = Warmer([path], block=1 << 20).wait(30)
    assert s["done"] and "error" not in s and "reason" not in s, s
    # (at most 5 % was resident after the eviction: _cold_file)
    assert s["files"] == 1 and s["mb"] == round((24 << 20) / 1e6, 1), s
    assert 0.95 * s["mb"] <= s["mb_read"] <= s["mb"], s
    assert resident_fraction(path) == 1.0
    again = Warmer([path]).wait(30)
    assert again["done"] and again["mb_read"] == 0.0, again


@pytest.mark.timeout(60)
def test_warmer_reads_only_the_missing_blocks(tmp_path):
    block = 1 << 20
    path = _cold_file(tmp_path, 64 * block + 123)  # a short last block
    with open(path, "rb") as f:  # blocks 0-7 read: cached
        f.read(8 * block)
    r = resident(path)
    if not r[: 8 * block // mmap.PAGESIZE].all():
        pytest.skip("the page cache did not keep what was just read")
    # the kernel's read-ahead may go on caching blocks past block 7 meanwhile (read_ahead_kb:
    # up to 8 MiB here), never the 56 MiB after them
    w = Warmer([path], block=block)
    s = w.wait(30)
    assert s["done"] and "error" not in s, s
    # the cached blocks were not read again; some of the rest were
    assert 0 < w.bytes_read <= 56 * block + 123, w.bytes_read
    assert (w.bytes_read - 123) % block == 0, w.bytes_read  # whole blocks, the short last one
    assert resident_fraction(path) == 1.0


@pytest.mark.timeout(60)
def test_warmer_reads_nothing_that_would_not_fit(tmp_path):
    path = _cold_file(tmp_path, 4 << 20)
    s = Warmer([path], max_fraction=0.0).wait(30)
    assert s["done"] and s["mb_read"] == 0.0, s
    assert "not in the page cache" in s["reason"] and "available" in s["reason"], s
    assert resident_fraction(path) <= 0.05


@pytest.mark.timeout(60)
def test_warmer_reports_a_missing_file(tmp_path):
    path = str(tmp_path / "gone.npy")
    s = Warmer([path]).wait(30)
    assert s["done"] and s["mb_read"] == 0.0, s
    assert "FileNotFoundError" in s["error"] and "gone.npy" in s["error"], s


def test_resident_of_an_empty_file(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert resident(str(path)).size == 0 and resident_fraction(str(path)) == 1.0
