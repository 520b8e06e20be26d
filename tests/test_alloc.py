"""--malloc-retain-mb (common/alloc.py): a large block freed by one batch stays in the heap for
the next instead of being mmapped and unmapped each time. Checked with glibc's own accounting
(mallinfo2's ``hblkhd``: bytes in mmapped blocks) in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from procs import REPO

# glibc's malloc, free and mallinfo2 (its accounting), typed, for the probes below
LIBC_PRELUDE = r"""
import ctypes, json, sys
from common.alloc import retain_freed_memory, return_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
"""

PROBE = LIBC_PRELUDE + r"""
ok = retain_freed_memory(int(sys.argv[1]), "probe")
p = libc.malloc(48 << 20)  # a 48 MiB tensor's buffer
mmapped = libc.mallinfo2().hblkhd
libc.free(p)
arena_after_free = libc.mallinfo2().arena
print(json.dumps({"ok": ok, "mmapped": mmapped, "arena_after_free": arena_after_free}))
"""


def _probe(retain_mb: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(retain_mb)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").gnu_get_libc_version)
    except (OSError, AttributeError):
        return False


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _glibc(), reason="mallopt is glibc's")
def test_retained_block_comes_from_the_heap_and_stays():
    default = _probe(0)
    assert default["ok"] is False
    assert default["mmapped"] >= 48 << 20  # glibc's default: a fresh mapping per block
    tuned = _probe(256)
    assert tuned["ok"] is True
    assert tuned["mmapped"] < 48 << 20  # served from the heap ...
    assert tuned["arena_after_free"] >= 48 << 20  # ... and kept there after free


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cli,flag", [("deploy.worker_mode", "--malloc-retain-mb"),
                                      ("deploy.worker_mode", "--server-malloc-retain-mb"),
                                      ("sampler_server.main", "--malloc-retain-mb")])
def test_out_of_range_is_a_clear_error(cli, flag, tmp_path):
    proc = subprocess.run([sys.executable, "-m", cli, "--parts", str(tmp_path), flag, "4096"],
                          capture_output=True, text=True, timeout=100, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--malloc-retain-mb must be in 0..2047" in proc.stderr, proc.stderr[-2000:]


TRIM_PROBE = LIBC_PRELUDE + r"""
retain_freed_memory(256, "probe")
p = libc.malloc(48 << 20)
libc.free(p)
kept = libc.mallinfo2().fordblks  # free bytes the heap keeps
returned = return_freed_memory()
print(json.dumps({"kept": kept, "returned": returned, "after": libc.mallinfo2().fordblks}))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _glibc(), reason="malloc_trim is glibc's")
def test_freed_memory_kept_by_retain_goes_back_to_the_os():
    """What ``--malloc-retain-mb`` kept, ``return_freed_memory`` hands back (benchmarks.run
    does so before each worker-mode run): the heap keeps no more than a page or so free."""
    proc = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["kept"] >= 48 << 20 and got["returned"] is True, got
    assert got["after"] < 1 << 20, got


PREFAULT_PROBE = LIBC_PRELUDE + r"""
import resource
from common.alloc import HeapPrefault
retain_freed_memory(256, "probe")
if sys.argv[1] == "1":
    pf = HeapPrefault(64)
    pf.wait(60)
    done = pf.done
else:
    done = None
size = 48 << 20  # a 48 MiB tensor's buffer, allocated after the prefault and written
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(size)
ctypes.memset(p, 1, size)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults": faults, "pages": size // 4096, "done": done}))
"""


def _prefault_probe(on: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", PREFAULT_PROBE, "1" if on else "0"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _thp_always() -> bool:
    """Whether transparent huge pages back every anonymous mapping here: then a fresh block
    faults once per 2 MiB, and the count below cannot tell a prefaulted heap from a cold one."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _glibc(), reason="the prefault uses glibc's heap")
@pytest.mark.skipif(_thp_always(), reason="THP 'always': page faults come per 2 MiB")
def test_prefaulted_heap_serves_the_next_block_without_page_faults():
    """A block allocated after :class:`HeapPrefault` is done comes from pages already mapped
    (almost no page faults when it is written); without it every page faults once."""
    cold = _prefault_probe(False)
    assert cold["faults"] > cold["pages"] * 3 // 4, cold
    warm = _prefault_probe(True)
    assert warm["done"] is True, warm
    assert warm["faults"] < warm["pages"] // 10, warm


def test_step_heap_estimate_and_when_the_prefault_applies():
    from common.alloc import HeapPrefault, prefault_step_heap, step_heap_mb
    from common.shm_ring import max_input_rows

    def heap(batch, fanouts, nodes, in_width, hidden):  # as the trainer sizes it
        return step_heap_mb(max_input_rows(batch, fanouts[1:], nodes), in_width, hidden)

    # input layer's destinations: 1024 x 11 x 6 (fanouts after the input layer's 15: 10, 5)
    rows = 1024 * 11 * 6
    assert heap(1024, [15, 10, 5], 10 ** 6, 100, 256) == -(-(rows * 968 * 4) >> 20)
    assert heap(1024, [15, 10, 5], 3000, 100, 256) == -(-(3000 * 968 * 4) >> 20)
    assert heap(8, [5, -1], 500, 10, 16) == -(-(500 * 68 * 4) >> 20)  # -1: all nodes
    off = prefault_step_heap(0, 200)
    assert off["mb"] == 0 and "--malloc-retain-mb" in off["reason"]
    small = prefault_step_heap(256, 8)
    assert small["mb"] == 0 and "below 16 MiB" in small["reason"]
    capped = prefault_step_heap(64, 500)  # under the retain threshold, or glibc would mmap it
    assert isinstance(capped, HeapPrefault) and capped.mb == 48
    capped.wait(60)
    assert capped.done and capped.summary()["mb"] == 48
    assert "done_before_training" not in capped.summary()  # training never started
    capped.training_starts()
    assert capped.summary()["done_before_training"] is True
