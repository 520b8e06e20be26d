"""One replica set: which server of a part a request goes to, and what happens when it does
not answer (transport layer). The trainer's ServerPool and the servers' WirePeers are both
built on :class:`ReplicaSet`, so they follow one policy with one setting, ``suspect_s``
(``--replica-suspect-s``):

* **Choice**: requests for a part go round-robin over its healthy replicas: connected (no
  drop since the last handshake) and not suspect. A replica not contacted yet counts as
  healthy (channels open on first use).
* **Suspects**: a replica that misses a request deadline but keeps its connection (busy,
  stuck, or frozen with heartbeats off) is avoided for ``suspect_s`` seconds.
* **Fallback**: with no healthy replica, a new request goes to the one that failed longest
  ago (it may have recovered) rather than failing at once.
* **Failover**: when a replica's connection drops (or it misses the deadline) with requests
  in flight, each is re-sent to another healthy replica of its part, at most once per
  replica. The old request id is forgotten, so a late reply to it is dropped: each request is
  answered exactly once. With no replica left the request fails with an error of the same
  kind (timeout or disconnect) naming the part, the endpoint and what to change.
* **Scatter-gather**: one request per part, all sent before any reply is awaited.

Replies arrive in any order; :meth:`ReplicaSet.wait` returns the one asked for and buffers
the others. A request that will never be answered keeps its error on its :class:`Handle`
(``wait`` raises it); an error reply fails only its own request. Not thread-safe: one owner
thread per set.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from common.errors import (
    MfgServeError,
    PeerDisconnectedError,
    PeerTimeoutError,
    RemoteError,
    StoppingError,
)
from common.messages import Message
from common.rpc import RECONNECT_GRACE_S, RpcChannel, expect
from common.sockets import Deadline

log = logging.getLogger("mfgserve.replicas")
SUSPECT_S = 30.0  # default of --replica-suspect-s


@dataclass
class Handle:
    """One request in flight: where it went, and what to re-send on failover."""

    part: int
    msg: Message
    channel: RpcChannel
    rid: int
    sent_at: float
    attempts: int = 1
    error: Exception | None = None  # why it will never be answered (wait() raises it)


class ReplicaSet:
    """The replicas of every part (``partitions``: part -> endpoints); ``connect(endpoint)``
    opens a channel to one. Every request with a ``set_id`` field is stamped with ``set_id``
    once it is known (the partition set the servers must serve)."""

    def __init__(self, partitions: Mapping[int, Sequence[str]],
                 connect: Callable[[str], RpcChannel], *, suspect_s: float = SUSPECT_S,
                 set_id: str = "", clock: Callable[[], float] = time.monotonic,
                 fail_fast: bool = False, stop: threading.Event | None = None):
        self.partitions = {p: list(eps) for p, eps in partitions.items()}
        self.connect = connect
        self.suspect_s = suspect_s
        self.set_id = set_id
        self.clock = clock  # of the suspect window; RpcChannel.last_disconnect's clock
        self.channels: dict[str, RpcChannel] = {}  # per endpoint, opened on first use
        self.failovers = 0
        self._next = dict.fromkeys(self.partitions, 0)  # round-robin position per part
        self._suspected_at: dict[str, float] = {}
        self._down: set[str] = set()  # endpoints whose drop was logged (see _note_down)
        self._buffered: dict[tuple[str, int], Message] = {}
        self._inflight: dict[tuple[str, int], Handle] = {}
        self._closed = False
        # A part left without servers ends every wait at once, not only waits on that part's
        # requests (a trainer cannot finish an epoch without every part; a request to another
        # part may be stuck behind a server waiting on the lost one for its peer timeout).
        self.fail_fast = fail_fast
        # Set when the owner stops (a server's SIGTERM): every wait ends within MEANWHILE_S
        # with StoppingError instead of running on to its deadline (a dead peer's request
        # would otherwise hold the stop up to --peer-timeout-s).
        self.stop = stop

    # ------------------------------------------------------------------ policy
    def channel(self, endpoint: str) -> RpcChannel:
        ch = self.channels.get(endpoint)
        if ch is None:
            ch = self.channels[endpoint] = self.connect(endpoint)
        return ch

    def replicas(self, part: int) -> list[str]:
        eps = self.partitions.get(part)
        if not eps:
            raise MfgServeError(f"the cluster file lists no server for part {part}")
        return eps

    def healthy(self, endpoint: str) -> bool:
        """Connected (or not contacted yet) and not suspect."""
        ch = self.channels.get(endpoint)
        if ch is not None:
            ch.poll_events()
            if not ch.up:
                self._note_down(ch)
                return False
            self._down.discard(endpoint)
        since = self._suspected_at.get(endpoint)
        return since is None or self.clock() - since >= self.suspect_s

    def _note_down(self, ch: RpcChannel) -> None:
        """Say once per drop that a replica is skipped: its connection dropped while nothing
        was in flight on it (so nothing is re-sent and no other line would say so)."""
        if ch.endpoint in self._down:
            return
        self._down.add(ch.endpoint)
        if ch.lost:  # requests were lost with it: their re-sends (or errors) will say so
            return
        part = next((p for p, eps in self.partitions.items() if ch.endpoint in eps), None)
        log.warning("the connection to server %s (part %s) dropped with no request in flight "
                    "on it (it missed heartbeats, or it exited); the part's requests go to its "
                    "other replicas until it connects again", ch.endpoint, part)

    def mark_suspect(self, endpoint: str) -> None:
        """Avoid ``endpoint`` for ``suspect_s`` (it missed a deadline, kept its connection)."""
        self._suspected_at[endpoint] = self.clock()

    def choose(self, part: int, avoid: str | None = None) -> str | None:
        """The next healthy replica of ``part`` in round-robin order, other than ``avoid``;
        None if there is none."""
        eps = self.replicas(part)
        start = self._next[part]
        for i in range(len(eps)):
            ep = eps[(start + i) % len(eps)]
            if ep != avoid and self.healthy(ep):
                self._next[part] = (start + i + 1) % len(eps)
                return ep
        return None

    def _fallback(self, part: int) -> str:
        """With none healthy: the replica of ``part`` that failed longest ago."""
        def failed_at(ep: str) -> float:
            ch = self.channels.get(ep)
            return max(ch.last_disconnect if ch is not None else 0.0,
                       self._suspected_at.get(ep, 0.0))
        return min(self.replicas(part), key=failed_at)

    # ------------------------------------------------------------------ requests
    def submit(self, part: int, msg: Message,
               before_send: Callable[[str, Any], Any] | None = None) -> Handle:
        """Send ``msg`` to a replica of ``part``; ``before_send(endpoint, msg)`` returns it
        adapted to the replica chosen (e.g. a shared-memory slot offered only to servers that
        can use it)."""
        endpoint = self.choose(part) or self._fallback(part)
        if self.set_id and hasattr(msg, "set_id"):
            msg = dataclasses.replace(msg, set_id=self.set_id)  # type: ignore[call-arg]
        if before_send is not None:
            msg = before_send(endpoint, msg)
        ch = self.channel(endpoint)
        handle = Handle(part, msg, ch, ch.send(msg), time.perf_counter())
        self._inflight[(endpoint, handle.rid)] = handle
        return handle

    def outstanding(self) -> int:
        """Requests sent whose replies have not been taken (:meth:`wait`) or cancelled."""
        return len(self._inflight)

    def wait(self, handle: Handle) -> Message:
        """The reply to ``handle``, failing over to replicas as needed (see module doc).
        Every call ends: with the reply, or with the error that ended the request."""
        while True:
            reply = self._take(handle)
            if reply is not None:
                return reply
            ch = handle.channel
            what = f"the reply to {handle.msg.TYPE.name} for part {handle.part}"
            try:
                self._receive(ch, what, meanwhile=partial(self._meanwhile, ch, what)
                              if self.fail_fast or self.stop is not None else None)
            except (PeerDisconnectedError, PeerTimeoutError) as e:
                if isinstance(e, PeerTimeoutError):
                    self.mark_suspect(ch.endpoint)
                self._failover_channel(ch, e)

    def scatter_gather(self, requests: Mapping[int, Message], reply_cls: type
                       ) -> dict[int, Any]:
        """One request per part, all sent first; their replies (each a ``reply_cls``). On an
        error the requests still in flight are cancelled."""
        handles = {part: self.submit(part, msg) for part, msg in requests.items()}
        try:
            return {part: expect(self.wait(h), reply_cls, h.channel.endpoint)
                    for part, h in handles.items()}
        finally:
            for h in handles.values():
                if (h.channel.endpoint, h.rid) in self._inflight:
                    self.cancel(h)

    def settle(self, handle: Handle, deadline: Deadline) -> bool:
        """Wait (until ``deadline``, never failing over) for the server ``handle`` was last
        sent to to finish with it. True when it answered (a reply or an error reply); False
        when it did not, or will not: the request is then cancelled."""
        while True:
            try:
                if self._take(handle) is not None:
                    return True
            except RemoteError:
                return True
            except MfgServeError:
                return False
            ch = handle.channel
            try:
                self._receive(ch, "a reply to an abandoned request", deadline.left())
            except PeerTimeoutError:
                self.cancel(handle)
                return False
            except PeerDisconnectedError as e:
                for h in [h for (ep, rid), h in list(self._inflight.items())
                          if ep == ch.endpoint and rid in ch.lost]:
                    self._fail(h, e)
                ch.forget(set(ch.lost))
                return False

    def cancel(self, handle: Handle) -> None:
        """Forget ``handle``: a late reply to it is dropped."""
        if handle.error is None:
            self._fail(handle, MfgServeError("cancelled"))

    # ------------------------------------------------------------------ internals
    def _meanwhile(self, awaited: RpcChannel, what: str) -> None:
        """Called while a wait on ``awaited`` sees nothing: give up if stopping, then (with
        ``fail_fast``) look at the other channels."""
        if self.stop is not None and self.stop.is_set():
            raise StoppingError(f"stopped waiting for {what} from {awaited.endpoint}: this "
                                "process is stopping")
        if self.fail_fast:
            self._check_others(awaited)

    def _check_others(self, awaited: RpcChannel) -> None:
        """While waiting on ``awaited``: fail over the requests of any other channel whose
        connection dropped, and raise at once if that leaves a part with no server."""
        for ep, ch in list(self.channels.items()):
            if ch is awaited or not any(e == ep for e, _ in self._inflight):
                continue
            ch.poll_events()
            if not ch.lost:
                continue
            victims = [h for (e, _), h in self._inflight.items() if e == ep]
            self._failover_channel(ch, PeerDisconnectedError(
                f"the connection to server {ep} dropped with {len(ch.lost)} request(s) "
                f"unanswered: {ch.diagnose(RECONNECT_GRACE_S, dropped=True)}"))
            lost = next((h.error for h in victims if h.error is not None), None)
            if lost is not None:
                raise lost

    def _receive(self, ch: RpcChannel, waiting_for: str, timeout_s: float | None = None,
                 meanwhile: Callable[[], None] | None = None) -> None:
        """Receive one reply on ``ch`` into the buffer; an error reply fails its own handle
        (which may not be the one awaited)."""
        try:
            reply, rid = ch.recv(timeout_s, waiting_for=waiting_for, meanwhile=meanwhile)
        except RemoteError as e:
            victim = self._inflight.get((ch.endpoint, e.rid))
            if victim is not None:
                self._fail(victim, e)
            return
        if (ch.endpoint, rid) in self._inflight:
            self._buffered[(ch.endpoint, rid)] = reply

    def _take(self, handle: Handle) -> Message | None:
        """The reply to ``handle`` if it arrived; raises its error if it failed."""
        if handle.error is not None:
            raise handle.error
        key = (handle.channel.endpoint, handle.rid)
        if key in self._buffered:
            self._inflight.pop(key, None)
            return self._buffered.pop(key)
        if key not in self._inflight:
            raise MfgServeError(f"request {handle.rid} to {handle.channel.endpoint} is no "
                                "longer in flight (it was cancelled)")
        return None

    def _fail(self, handle: Handle, error: Exception) -> None:
        """``handle`` will never be answered: stop tracking it and keep the reason."""
        handle.channel.forget({handle.rid})
        self._inflight.pop((handle.channel.endpoint, handle.rid), None)
        self._buffered.pop((handle.channel.endpoint, handle.rid), None)
        handle.error = error

    def _failover_channel(self, ch: RpcChannel, error: Exception) -> None:
        """Re-send every request in flight on ``ch`` to another replica of its part; a request
        that cannot be re-sent fails (its handle keeps the error, :meth:`wait` raises it)."""
        victims = [h for (ep, _), h in list(self._inflight.items()) if ep == ch.endpoint]
        self._down.add(ch.endpoint)  # the re-sends below say what happened to it
        for handle in victims:
            self._failover(handle, error)
        ch.forget(set(ch.lost) | set(ch.pending))

    def _failover(self, handle: Handle, error: Exception) -> None:
        old = handle.channel
        self._fail(handle, error)
        tried_all = handle.attempts >= len(self.replicas(handle.part))
        target = None if tried_all else self.choose(handle.part, avoid=old.endpoint)
        if target is None:
            handle.error = self._no_replica_left(handle.part, error)
            return
        log.warning("re-sending %s for part %d from %s to %s: %s", handle.msg.TYPE.name,
                    handle.part, old.endpoint, target, error)
        self.failovers += 1
        handle.error = None
        handle.msg = self.for_resend(handle.msg)
        ch = self.channel(target)
        handle.channel, handle.rid = ch, ch.send(handle.msg)
        handle.attempts += 1
        self._inflight[(target, handle.rid)] = handle

    def for_resend(self, msg: Message) -> Message:
        """``msg`` as re-sent to another replica (a subclass may strip what was meant for
        the first one only)."""
        return msg

    def _no_replica_left(self, part: int, error: Exception) -> Exception:
        """The error of a request of ``part`` with no replica left: the same kind as
        ``error`` (a timeout or a disconnect), saying what to change."""
        n = len(self.replicas(part))
        text = (f"part {part} has no server left to answer: {error}. "
                + (f"Its other replicas (the cluster file lists {n} servers for it) failed "
                   "too or are down" if n > 1
                   else "It has no replica (the cluster file lists 1 server for it)")
                + f"; restart the server(s) of part {part} or add replicas to the cluster file")
        out = type(error)(text)
        out.__cause__ = error
        return out

    # ------------------------------------------------------------------ teardown
    @property
    def bytes_received(self) -> int:
        """Reply bytes received from every replica so far."""
        return sum(ch.bytes_received for ch in self.channels.values())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for ch in self.channels.values():
                ch.close()
