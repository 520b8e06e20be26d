"""A trainer's ring of shared-memory receive buffers that co-located servers write into.

Why: a batch's input features are most of its bytes (1024 seeds, fanouts 15,10,5 on a
products-sized graph: ~150 MB). Over a socket they are copied into the kernel and out again;
a server on the same host can instead gather the rows straight into the trainer's memory.

How:

* The trainer creates an anonymous ``memfd`` (no name in any filesystem, so nothing is left
  behind if it dies: the kernel frees it once the last mapping goes), maps it, writes a header
  (magic, random token, slot geometry) and, with CUDA, page-locks it (``cudaHostRegister``) so
  that host-to-device copies can be non-blocking.
* A :class:`~common.messages.SampleRequest` names a free slot in its ``slot`` field (a
  :class:`SlotRef`): the trainer's pid, the memfd's fd number, the token, the slot's offset
  and capacity. A server on the same host opens ``/proc/<pid>/fd/<fd>`` (the kernel allows it
  only for the same user), checks that it is an unlinked memfd whose header carries the token,
  gathers the feature rows into the slot and replies with features ``via="ring"``
  (common.sampled_mfg.Features). A server elsewhere cannot open it and replies with the
  features on the wire plus ``slot_error`` saying why; the trainer then stops offering slots
  to that server. A reply too large for its slot also goes on the wire.
* A slot is free again when every tensor viewing it is gone (a finalizer on the array the
  tensors share) and, with CUDA, when the copy out of it has completed (an event). A slot
  whose request was re-sent elsewhere (failover) or abandoned is never reused: the first
  server may still write into it later.

Slots are page aligned; the header takes the first page.

First touches: a slot's pages are allocated (and zeroed) by the first write into them, and
every mapping of the ring (the trainer's, each server process's) takes a page fault per
4 KiB page the first time it touches it: about 2 microseconds each on a VM, so a products
batch's 150 MB costs 70-145 ms per slot and mapping, once per run (docs/benchmarks.md,
session 24). Fewer of them: a server's sampler threads share one :class:`ShmWriter`, so a
server process maps each ring once; and before a range is first written (server) or read
(trainer) it is populated in one call (``madvise`` ``MADV_POPULATE_WRITE`` /
``MADV_POPULATE_READ``, Linux 5.14+), which takes 55-75 % of the time of faulting the same
pages one at a time. Where the kernel lacks them, the pages fault in as usual.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import stat
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.errors import MfgServeError
from common.structs import Struct, need

log = logging.getLogger("mfgserve.shm")

MAGIC = b"MFGRING1"
MEMFD_NAME = "mfgserve-ring"
HEADER_BYTES = mmap.PAGESIZE
TOKEN_BYTES = 16
_PAGE = mmap.PAGESIZE


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+ (asm-generic/mman-common.h)


def _libc_madvise():
    """libc's ``madvise`` through ctypes (which releases the GIL for the call, unlike
    ``mmap.madvise``: populating 150 MB takes ~0.1 s), or None off glibc/Linux."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise() if os.uname().sysname == "Linux" else None


class _Populated:
    """How far each slot of one mapping has been populated (see the module docstring)."""

    def __init__(self, advice: int):
        self.advice = advice
        self.done: dict[int, int] = {}  # slot start address -> bytes from it populated
        self.supported = _madvise is not None

    def ensure(self, addr: int, nbytes: int) -> None:
        """Populate ``[addr, addr + nbytes)`` (``addr``: a slot's page-aligned start in this
        mapping) beyond what already is. Best effort: a kernel without the advice (EINVAL
        before Linux 5.14) faults the pages in as they are used."""
        done = self.done.get(addr, 0)
        if nbytes <= done or not self.supported:
            return
        end = _round_up(nbytes, _PAGE)
        if _madvise(addr + done, end - done, self.advice) != 0:  # type: ignore[misc]
            self.supported = False
            return
        self.done[addr] = end


@dataclass(frozen=True)
class SlotRef(Struct):
    """What a request carries so that a server can find the slot (see module doc); a nested
    struct of SampleRequest (``slot``)."""

    pid: int
    fd: int
    token: str
    offset: int
    capacity: int

    def check(self) -> None:
        need(self.pid > 0 and self.fd >= 0 and self.offset > 0 and self.capacity >= 0,
             "bad_field", "a ring slot needs pid > 0, fd >= 0, offset > 0 and capacity >= 0")
        need(len(self.token) == 2 * TOKEN_BYTES and all(c in "0123456789abcdef"
                                                        for c in self.token),
             "bad_field", f"a ring slot's token is {2 * TOKEN_BYTES} lowercase hex digits")


def max_input_rows(batch_size: int, fanouts: list[int], num_nodes: int) -> int:
    """An upper bound on a batch's input nodes: each layer adds at most ``fanout`` sources
    per destination (all of them for -1), and never more than the graph has."""
    rows = min(batch_size, num_nodes)
    for f in fanouts:
        rows = num_nodes if f < 0 else min(num_nodes, rows * (1 + f))
    return rows


class ShmRing:
    """The trainer's side: ``num_slots`` slots of ``slot_bytes`` each, in one memfd."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool = False):
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError("a ring needs at least one slot of at least one byte")
        if not hasattr(os, "memfd_create"):
            raise MfgServeError("shared-memory replies need Linux memfd_create; "
                                "run with --no-shm-ring")
        self.num_slots = num_slots
        self.slot_bytes = _round_up(slot_bytes, _PAGE)
        self.size = HEADER_BYTES + num_slots * self.slot_bytes
        self.token = secrets.token_hex(TOKEN_BYTES)
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self.mm[:HEADER_BYTES] = _header(self.token, self.slot_bytes, num_slots).ljust(
            HEADER_BYTES, b"\0")
        self.base = np.frombuffer(self.mm, dtype=np.uint8)
        self.populated = _Populated(MADV_POPULATE_READ)
        self.pinned = False
        if pin:
            self.pinned = _cuda_host_register(self.base)
        self.free = list(range(num_slots))
        self.pending: list[tuple[int, object]] = []  # (slot, CUDA event) until the copy is done
        self.in_use: set[int] = set()
        self.poisoned: set[int] = set()
        self.touched: set[int] = set()  # slots ever handed out: the ring's resident part
        self.released = 0
        self.closed = False

    def acquire(self) -> int | None:
        """A free slot's index, or None if every slot is held (the caller uses the wire)."""
        if self.pending:
            still = []
            for slot, event in self.pending:
                if event is None or event.query():  # type: ignore[attr-defined]
                    self.free.append(slot)
                else:
                    still.append((slot, event))
            self.pending = still
        if not self.free:
            return None
        slot = self.free.pop()  # the slot freed last: its pages are mapped and warm
        self.in_use.add(slot)
        self.touched.add(slot)
        return slot

    def ref(self, slot: int) -> SlotRef:
        return SlotRef(os.getpid(), self.fd, self.token, HEADER_BYTES + slot * self.slot_bytes,
                       self.slot_bytes)

    def release(self, slot: int, event: object = None) -> None:
        """Give ``slot`` back (after ``event`` completes, if given)."""
        if self.closed or slot not in self.in_use:
            return
        self.in_use.discard(slot)
        self.released += 1
        self.pending.append((slot, event))

    def poison(self, slot: int) -> None:
        """Never hand ``slot`` out again: a server may still write into it."""
        if slot in self.in_use:
            self.in_use.discard(slot)
            self.poisoned.add(slot)

    def view(self, slot: int, rows: int, cols: int, dtype: torch.dtype,
             on_release=None) -> Tensor:
        """``rows x cols`` of ``dtype`` at the start of ``slot``; the slot is released (via
        ``on_release(slot)`` if given, else :meth:`release`) once no tensor views it."""
        nbytes = rows * cols * dtype.itemsize
        if nbytes > self.slot_bytes:
            raise MfgServeError(f"a server wrote {nbytes} bytes into a ring slot of "
                                f"{self.slot_bytes}")
        start = HEADER_BYTES + slot * self.slot_bytes
        arr = self.base[start:start + nbytes]  # a new array object: the finalizer's anchor
        self.populated.ensure(arr.ctypes.data, nbytes)  # the server's pages, in one call
        weakref.finalize(arr, on_release or self.release, slot)
        return torch.from_numpy(arr).view(dtype).view(rows, cols)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pinned:
            _cuda_host_unregister(self.base)
        self.base = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # tensors still view it; the mapping goes with them
        os.close(self.fd)


def _header(token: str, slot_bytes: int, num_slots: int) -> bytes:
    return (MAGIC + bytes.fromhex(token) + slot_bytes.to_bytes(8, "little")
            + num_slots.to_bytes(8, "little"))


def _cuda_host_register(arr: np.ndarray) -> bool:
    """Page-lock ``arr`` for non-blocking copies; False (and a warning) if CUDA refuses."""
    try:
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(arr.ctypes.data, arr.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")
        return True
    except Exception as e:  # pinning is an optimisation; copies still work unpinned
        log.warning("could not page-lock the receive ring (%s); host-to-device copies will "
                    "be synchronous", e)
        return False


def _cuda_host_unregister(arr: np.ndarray) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)
    except Exception:
        pass


class ShmError(Exception):
    """The slot a request names cannot be used; the text says why (sent back to the trainer)."""


@dataclass
class _Mapped:
    """A trainer's ring as one server process maps it."""

    mm: mmap.mmap
    size: int
    last_used: float
    populated: _Populated


class ShmWriter:
    """The server's side: maps trainers' rings on first use and keeps the mapping while it is
    used (dropped after ``idle_s`` without use, so a finished trainer's memory is freed).
    One per server process, shared by its sampler threads (thread-safe): each ring is mapped,
    and each page faulted in, once per process."""

    def __init__(self, idle_s: float = 10.0):
        self.idle_s = idle_s
        self.maps: dict[tuple[int, int, str], _Mapped] = {}
        self._lock = threading.Lock()

    def _open(self, ref: SlotRef) -> _Mapped:
        key = (ref.pid, ref.fd, ref.token)
        entry = self.maps.get(key)
        if entry is not None:
            entry.last_used = time.monotonic()
            return entry
        path = f"/proc/{ref.pid}/fd/{ref.fd}"
        try:
            target = os.readlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise ShmError(f"cannot open the trainer's ring {path} ({e.strerror}): the trainer "
                           "is on another host, in another pid namespace, or runs as another "
                           "user; features go on the wire") from None
        try:
            st = os.fstat(fd)
            if (not target.startswith(f"/memfd:{MEMFD_NAME}") or not stat.S_ISREG(st.st_mode)
                    or st.st_nlink != 0):
                raise ShmError(f"{path} is not an mfgserve ring (it is {target})")
            head = os.pread(fd, len(MAGIC) + TOKEN_BYTES, 0)
            if head != MAGIC + bytes.fromhex(ref.token):
                raise ShmError(f"{path} does not carry the request's ring token")
            if ref.offset < HEADER_BYTES or ref.offset + ref.capacity > st.st_size:
                raise ShmError(f"slot [{ref.offset}, +{ref.capacity}) is outside the ring "
                               f"({st.st_size} bytes)")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        entry = _Mapped(mm, st.st_size, time.monotonic(), _Populated(MADV_POPULATE_WRITE))
        self.maps[key] = entry
        return entry

    def target(self, ref: SlotRef, rows: int, cols: int, dtype: torch.dtype) -> Tensor | None:
        """A ``rows x cols`` tensor of ``dtype`` over the slot, or None if it does not fit.
        Raises :class:`ShmError` if the slot cannot be used at all."""
        nbytes = rows * cols * dtype.itemsize
        if nbytes > ref.capacity:
            return None
        with self._lock:  # the view exists before expire() (same lock) may unmap the ring
            ring = self._open(ref)
            if ref.offset + ref.capacity > ring.size:
                raise ShmError(f"slot [{ref.offset}, +{ref.capacity}) is outside the ring "
                               f"({ring.size} bytes)")
            if nbytes == 0:
                return torch.empty((rows, cols), dtype=dtype)
            view = torch.frombuffer(ring.mm, dtype=torch.uint8, count=nbytes,
                                    offset=ref.offset).view(dtype).view(rows, cols)
        ring.populated.ensure(view.data_ptr(), nbytes)  # outside the lock: others go on
        return view

    def expire(self) -> None:
        """Unmap rings idle for ``idle_s`` (their trainers are likely gone)."""
        now = time.monotonic()
        with self._lock:
            for key, ring in list(self.maps.items()):
                if now - ring.last_used > self.idle_s:
                    try:
                        ring.mm.close()
                    except BufferError:
                        continue  # a tensor still views it (a request in progress)
                    del self.maps[key]

    def close(self) -> None:
        self.idle_s = -1.0
        self.expire()
