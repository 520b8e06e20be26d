"""Typed statistics, from a sampler server's counters to a trainer's summary.

Every set of numbers is a dataclass of :class:`Numbers`: it adds field by field and has a
wire form (``dict[str, float]``, the STATS reply's ``values`` and an MFG reply's
``timings``) that is read back by field name, never by position. A set shared between
threads lives in a :class:`Tally`, whose :meth:`Tally.add` is the one (locked) way to
change it.

On the server: a sampler thread or process adds a :class:`SampleCounts` per request; the
IO thread adds ``requests``, ``errors``, ``busy`` and ``bytes_out`` to the same
:class:`ServerCounters`; a STATS request reads a :class:`ServerStats` (the counters plus
gauges: queue length, reply backlog, memory). Per reply, :class:`RequestTimings` travel to the
trainer, whose :class:`~trainer_client.loader.LoaderStats` sums them for the summary.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import psutil

N = TypeVar("N", bound="Numbers")


class Numbers:
    """Base of the stats dataclasses: field-wise addition and the wire form."""

    def add(self, other: Numbers) -> None:
        """Add ``other``'s fields to the same-named fields of this one (each of ``other``'s
        fields must exist here). Not locked: shared sets go through :class:`Tally`."""
        for f in dataclasses.fields(other):  # type: ignore[arg-type]
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_wire(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name))
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls: type[N], values: Mapping[str, float]) -> N:
        """The fields ``values`` names (others keep their default; unknown names, from a
        newer peer, are ignored)."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: (int(v) if kinds[k] in (int, "int") else float(v))
                      for k, v in values.items() if k in kinds})


@dataclass
class SampleCounts(Numbers):
    """What serving one sample request adds to its server's counters."""

    sample_requests: int = 0
    seeds_served: int = 0
    sample_s: float = 0.0
    gather_s: float = 0.0
    remote_s: float = 0.0
    remote_requests: int = 0
    remote_bytes: int = 0
    encode_s: float = 0.0
    errors: int = 0
    ring_replies: int = 0  # replies whose features went into the trainer's shared-memory ring
    ring_rows: int = 0  # feature rows written into rings


@dataclass
class ServerCounters(SampleCounts):
    """A server's totals since it started (sampler threads/processes and its IO thread)."""

    requests: int = 0
    busy: int = 0
    bytes_out: int = 0


@dataclass
class ServerStats(ServerCounters):
    """The STATS reply: the counters, then gauges read at the time of the request."""

    queue_len: int = 0  # sample requests queued or being served
    replies_dropped: int = 0  # replies to clients over --max-peer-backlog-mb
    backlog_bytes: int = 0  # reply bytes queued for clients, not yet sent
    mem_rss_bytes: int = 0  # memory of the server and its sampler processes (process_memory)
    mem_pss_bytes: int = 0
    mem_uss_bytes: int = 0
    sampler_processes: int = 0  # processes counted in mem_* (the server itself included)


@dataclass
class RequestTimings(Numbers):
    """Where one sample request's time went on its server (an MFG reply's ``timings``)."""

    sample_s: float = 0.0
    gather_s: float = 0.0
    remote_s: float = 0.0
    remote_requests: int = 0
    remote_bytes: int = 0
    cached_rows: int = 0  # input nodes left out because the trainer caches them
    queue_s: float = 0.0  # from arrival until a sampler took it
    shm_rows: int = 0  # feature rows written into the trainer's shared-memory ring
    encode_s: float = 0.0
    server_s: float = 0.0  # from arrival until the reply was encoded


T = TypeVar("T", bound=Numbers)


class Tally(Generic[T]):
    """A stats dataclass shared between threads: :meth:`add` is the only way to change it."""

    def __init__(self, value: T):
        self._value = value
        self._lock = threading.Lock()

    def add(self, delta: Numbers | None = None, **fields: float) -> None:
        """Add a stats dataclass (a subset of this one's fields) and/or named amounts."""
        with self._lock:
            self._apply(self._value, delta, fields)

    @staticmethod
    def _apply(target: Numbers, delta: Numbers | None, fields: Mapping[str, float]) -> None:
        if delta is not None:
            target.add(delta)
        for name, amount in fields.items():
            setattr(target, name, getattr(target, name) + amount)

    def snapshot(self) -> T:
        with self._lock:
            return dataclasses.replace(self._value)  # type: ignore[type-var]


class WindowedTally(Tally[T]):
    """A :class:`Tally` that also keeps what was added during each of the last ``seconds``
    seconds (a ring of per-second buckets, under the same lock), so rates over the last
    minute cost one more addition per change and nothing while idle."""

    def __init__(self, value: T, seconds: int = 60,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(value)
        self.seconds, self.clock = seconds, clock
        self.started = clock()
        self._buckets = [type(value)() for _ in range(seconds)]
        self._stamps = [-1] * seconds  # the second each bucket holds

    def add(self, delta: Numbers | None = None, **fields: float) -> None:
        with self._lock:
            self._apply(self._value, delta, fields)
            self._apply(self._bucket(int(self.clock())), delta, fields)

    def _bucket(self, sec: int) -> Numbers:
        i = sec % self.seconds
        if self._stamps[i] != sec:
            self._buckets[i], self._stamps[i] = type(self._value)(), sec
        return self._buckets[i]

    def window(self) -> tuple[T, float]:
        """The sum of what was added during the last ``seconds`` seconds (this one
        included) and how many seconds that covers (less for a younger tally)."""
        now = self.clock()
        sec = int(now)
        total = type(self._value)()
        with self._lock:
            for stamp, bucket in zip(self._stamps, self._buckets):
                if sec - self.seconds < stamp <= sec:
                    total.add(bucket)
        return total, min(now - self.started, now - sec + self.seconds - 1)


def process_memory(stats: ServerStats) -> bool:
    """Fill ``stats``'s memory gauges: this process and its children (psutil). rss sums
    resident pages (shared ones counted once per process), pss splits shared pages among the
    processes mapping them (the honest total), uss is what exiting them would free. Returns
    whether pss and uss were known for every process (not on every platform: rss stands in
    for them where they are not)."""
    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    stats.sampler_processes = len(procs)
    known = True
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except (psutil.Error, OSError):
            known = False
            continue
        known = known and hasattr(info, "pss") and hasattr(info, "uss")
        stats.mem_rss_bytes += info.rss
        stats.mem_pss_bytes += getattr(info, "pss", info.rss)
        stats.mem_uss_bytes += getattr(info, "uss", info.rss)
    return known
