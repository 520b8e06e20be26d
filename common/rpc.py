"""Request/reply channel to one server over a DEALER socket (transport layer).

A channel may have several requests in flight; replies carry the request id and may arrive
in any order. Every receive has a deadline; errors name the endpoint and the setting to change.

Liveness: a socket monitor reports when the connection to the server drops (the process died
or restarted: the kernel closes its sockets; or, with heartbeats on, it stopped answering
libzmq's pings within the heartbeat timeout: frozen, or unreachable). Requests in flight at that moment can never be
answered, so they move to :attr:`RpcChannel.lost` and :meth:`RpcChannel.recv` raises
:class:`PeerDisconnectedError` at once instead of waiting out the deadline. libzmq reconnects
by itself; a restarted server at the same endpoint is used again with no action needed.
Which server to ask, and what to do when one fails, is common/replicas.py's policy.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from common import codec
from common.errors import PeerDisconnectedError, PeerTimeoutError, ProtocolError, RemoteError
from common.messages import ErrorReply, Message
from common.sockets import CurveKeys, Deadline, make_socket

_ids = itertools.count(1)
_WATCHED = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CLOSED
            | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MEANWHILE_S = 0.25  # RpcChannel.recv's ``meanwhile`` period
RECONNECT_GRACE_S = 0.5  # after a drop, how long reconnect attempts are watched to say why
_FROZEN = ("it accepts connections but answers nothing (no heartbeat, no handshake): the "
           "server process is frozen (stopped or hung) or overloaded")


def _verdict(seen: list[int], dropped: bool) -> str | None:
    """A diagnosis from the events since the last disconnect, or None if not yet clear."""
    if zmq.EVENT_HANDSHAKE_FAILED_AUTH in seen or zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL in seen:
        return ("it refused this client's handshake (with CurveZMQ: check that this client's "
                "key is authorized and the cluster file's curve_server_key)")
    if zmq.EVENT_HANDSHAKE_SUCCEEDED in seen:
        return ("a server answers there again: it restarted" if dropped else
                "it is connected (heartbeats answered, if on) but sent no reply: the server "
                "is busy or its sampling is stuck")
    # a connection attempt closed before it connected: refused (a reconnect after a drop
    # also starts with CONNECT_RETRIED, so that event alone says nothing)
    if zmq.EVENT_CLOSED in seen and zmq.EVENT_CONNECTED not in seen:
        return ("connection refused, nothing listens there any more: the server process "
                "died or was stopped")
    return None


class RpcChannel:
    """A DEALER connected to ``endpoint``. Not thread-safe: one owner thread per channel."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, timeout_s: float, setting: str,
                 max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES, hwm: int = 1000,
                 curve: CurveKeys | None = None, heartbeat_s: float = 0.0,
                 heartbeat_timeout_s: float = 0.0):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.setting = setting
        self.max_message_bytes = max_message_bytes
        self.sock = make_socket(ctx, zmq.DEALER, endpoint, bind=False, hwm=hwm,
                                max_message_bytes=max_message_bytes, curve=curve,
                                heartbeat_s=heartbeat_s, heartbeat_timeout_s=heartbeat_timeout_s,
                                monitor_events=_WATCHED)
        # attached before the connect: a CONNECTED event missed would turn "frozen" into
        # "unreachable" in diagnose()
        self.monitor = self.sock.get_monitor_socket()
        self.pending: set[int] = set()
        self.lost: set[int] = set()
        # No disconnect since the last completed handshake. A frozen server still accepts
        # connections (the kernel does that), but never completes a handshake: it stays down.
        self.up = True
        self.last_disconnect = 0.0  # time.monotonic() of the last drop
        self.bytes_received = 0
        self.seen: list[int] = []  # connection events since the last disconnect (diagnosis)

    def poll_events(self) -> None:
        """Apply connection events seen so far (never blocks)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            self.seen = [] if event == zmq.EVENT_DISCONNECTED else self.seen[-15:] + [event]
            if event == zmq.EVENT_DISCONNECTED:
                self.up = False
                self.last_disconnect = time.monotonic()
                self.lost |= self.pending
                self.pending.clear()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = True

    def send(self, msg: Message) -> int:
        rid = next(_ids)
        self.sock.send_multipart(codec.encode(msg, rid), copy=False)
        self.pending.add(rid)
        return rid

    def recv(self, timeout_s: float | None = None, waiting_for: str = "a reply",
             meanwhile: Callable[[], None] | None = None) -> tuple[Message, int]:
        """Next reply to one of our pending requests; stale replies are dropped.

        Raises PeerDisconnectedError if the connection drops with requests unanswered,
        PeerTimeoutError at the deadline, RemoteError for an error reply. ``meanwhile`` is
        called every ``MEANWHILE_S`` while nothing arrives (it may raise to stop waiting).
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = Deadline(limit)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        # By the clock, not by quiet polls: while nothing listens at the endpoint, libzmq
        # retries the connection every 100 ms and each retry wakes the poll (monitor event),
        # so "call meanwhile when a poll saw nothing" would never call it.
        next_call = time.monotonic() + MEANWHILE_S
        while True:
            self.poll_events()
            if self.lost:
                raise PeerDisconnectedError(
                    f"the connection to server {self.endpoint} dropped with {len(self.lost)} "
                    f"request(s) unanswered while we waited for {waiting_for}: "
                    f"{self.diagnose(RECONNECT_GRACE_S, dropped=True)}")
            if meanwhile is not None and time.monotonic() >= next_call and deadline.left() > 0:
                meanwhile()
                next_call = time.monotonic() + MEANWHILE_S
            step = deadline.left()
            if meanwhile is not None:
                step = min(step, max(0.0, next_call - time.monotonic()))
            events = dict(poller.poll(int(step * 1000)))
            if self.sock not in events:
                if deadline.left() > 0:
                    continue
                raise PeerTimeoutError(
                    f"no reply from server {self.endpoint} within {limit:.1f}s while waiting "
                    f"for {waiting_for}: {self.diagnose(0.0, dropped=False)}; raise "
                    f"{self.setting} if it is only slow")
            frames = self.sock.recv_multipart(copy=False)
            self.bytes_received += sum(len(f) for f in frames)
            try:
                msg, rid = codec.decode(frames, self.max_message_bytes)
            except ProtocolError as e:
                raise ProtocolError(e.code, f"bad reply from {self.endpoint}: {e}") from None
            if rid not in self.pending:
                continue  # answer to a request we gave up on
            self.pending.discard(rid)
            if isinstance(msg, ErrorReply):
                raise RemoteError(self.endpoint, msg.code, msg.message, rid)
            return msg, rid

    def diagnose(self, grace_s: float, dropped: bool) -> str:
        """What the connection's events say about the server, watching libzmq's reconnect
        attempts for up to ``grace_s``: refused (nothing listens: the process died or was
        stopped), connected but silent (frozen), no answer at all (unreachable), or a
        handshake refused (CurveZMQ keys)."""
        deadline = Deadline(grace_s)
        while True:
            self.poll_events()
            verdict = _verdict(self.seen, dropped)
            if verdict is not None or deadline.left() <= 0:
                break
            self.monitor.poll(int(min(deadline.left(), 0.05) * 1000) + 1)
        if verdict is None:
            verdict = (_FROZEN if zmq.EVENT_CONNECTED in self.seen else
                       "it does not answer connection attempts: the host is unreachable or "
                       "down, or a firewall drops the packets")
        return verdict

    def forget(self, rids: set[int]) -> None:
        """Stop expecting replies to ``rids`` (their requests were re-sent elsewhere)."""
        self.pending -= rids
        self.lost -= rids

    def call(self, msg: Message, timeout_s: float | None = None, waiting_for: str = "") -> Message:
        """Send and wait for this one reply (use on a channel with nothing else in flight)."""
        rid = self.send(msg)
        while True:
            reply, got = self.recv(timeout_s, waiting_for or f"the reply to {msg.TYPE.name}")
            if got == rid:
                return reply

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def expect(msg: Any, cls: type, endpoint: str) -> Any:
    if not isinstance(msg, cls):
        raise ProtocolError("unexpected_reply",
                            f"{endpoint} answered {type(msg).__name__}, expected {cls.__name__}")
    return msg
