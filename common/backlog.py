"""Per-peer bound on reply bytes a server holds for clients that do not read them.

libzmq queues a ROUTER's outgoing messages per peer until its IO thread hands them to the
kernel; a client that never reads keeps them queued, and with large replies that is memory
without bound. Every reply frame of at least :data:`TRACK_MIN_BYTES` is sent tracked: its
tracker is done once libzmq released it (written to the kernel, or dropped because the peer
went away). A reply to a peer whose unreleased bytes exceed the limit is dropped and counted
(``replies_dropped`` in STATS); that client's request then times out on its side. Replies
to one peer are released in order, so only the oldest entries need checking.
"""

from __future__ import annotations

import logging
from collections import deque

import zmq

log = logging.getLogger("mfgserve.server")
TRACK_MIN_BYTES = 64 << 10  # smaller frames are copied by pyzmq and cost nothing to hold
SWEEP_EVERY = 256  # sends between sweeps of peers whose replies were all released


class PeerBacklog:
    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.queued: dict[bytes, tuple[deque, list[int]]] = {}  # peer -> (trackers, [bytes])
        self.dropped = 0
        self._sends = 0

    def _outstanding(self, peer: bytes) -> int:
        entry = self.queued.get(peer)
        if entry is None:
            return 0
        trackers, total = entry
        while trackers and all(t.done for t in trackers[0][0]):
            total[0] -= trackers.popleft()[1]
        return total[0]

    def send(self, sock: zmq.Socket, ident, frames: list) -> bool:
        """Send ``[ident, *frames]`` unless the peer's backlog is over the limit (then drop
        it and return False). ``frames`` are buffers or received :class:`zmq.Frame`\\ s."""
        peer = ident.bytes if isinstance(ident, zmq.Frame) else bytes(ident)
        bufs = [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]
        size = sum(memoryview(b).nbytes for b in bufs)
        outstanding = self._outstanding(peer)
        if outstanding and outstanding + size > self.limit:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("dropped a %d-byte reply to a client that is not reading its "
                            "replies (%d bytes queued for it, limit %d: the servers' "
                            "--max-peer-backlog-mb); %d dropped so far", size, outstanding,
                            self.limit, self.dropped)
            return False
        trackers = []
        sock.send(ident, zmq.SNDMORE, copy=False)
        for i, b in enumerate(bufs):
            flags = zmq.SNDMORE if i + 1 < len(bufs) else 0
            big = memoryview(b).nbytes >= TRACK_MIN_BYTES
            tracker = sock.send(b, flags, copy=False, track=big)
            if big:
                trackers.append(tracker)
        if trackers:
            trackers_q, total = self.queued.setdefault(peer, (deque(), [0]))
            trackers_q.append((trackers, size))
            total[0] += size
        self._sends += 1
        if self._sends % SWEEP_EVERY == 0:
            self.sweep()
        return True

    def sweep(self) -> None:
        """Forget peers with nothing queued (clients come and go; their ids are not reused)."""
        for peer in [p for p in self.queued if self._outstanding(p) == 0]:
            del self.queued[peer]

    def queued_bytes(self) -> int:
        return sum(self._outstanding(p) for p in list(self.queued))
