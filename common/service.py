"""The service runtime: one ROUTER socket, its loop, a handler table and one error mapping.

A server is a :class:`Service` plus handlers: ``service.handle(SampleRequest, fn)`` makes
``fn(msg, call)`` answer every decoded ``SampleRequest`` (adding a message type means one
message class in :mod:`common.messages` and one handler). A handler returns the reply, or
``None`` when it handed the request to the service's executor (:mod:`common.executors`:
inline, threads or processes), whose result is sent when it is ready. The loop::

    clients --> ROUTER --> decode --> pre-check --> handler --> reply --> PeerBacklog --> ROUTER
                                                       |                      ^
                                                       +--> executor ---------+ (results)

Every exception out of decoding or a handler becomes an :class:`ErrorReply` through
:func:`error_reply`, the one mapping: a :class:`ProtocolError` keeps its code, the documented
errors of a request that cannot be served (:class:`BadRequestError`, a peer server's timeout,
drop or error) get theirs, and anything else is a bug: code ``internal``, logged with its
traceback. The server goes on serving either way.

Replies leave through one :class:`~common.backlog.PeerBacklog` (bounded bytes per client);
counters live in one :class:`~common.stats.WindowedTally` of
:class:`~common.stats.ServerCounters` (totals, and the last minute's for rates); error replies
are also counted by code as they leave.
Domain code never imports zmq: the runtime owns the context, the sockets and CurveZMQ.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from common import codec
from common.backlog import PeerBacklog
from common.errors import (
    BadRequestError,
    MfgServeError,
    PeerDisconnectedError,
    PeerTimeoutError,
    ProtocolError,
    RemoteError,
    StoppingError,
)
from common.messages import ErrorReply, Message, MsgType
from common.sockets import CurveKeys, bound_endpoint, make_socket
from common.stats import ServerCounters, WindowedTally

log = logging.getLogger("mfgserve.server")
BURST = 64  # requests taken from the socket before results are looked at again
POLL_MS = 200

# Errors that say the request cannot be served as asked (not a bug), and their codes.
REQUEST_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (BadRequestError, "bad_request"),
    (PeerTimeoutError, "peer_timeout"),
    (PeerDisconnectedError, "peer_disconnected"),
    (RemoteError, "peer_error"),
    (StoppingError, "stopping"),
)


def error_reply(e: BaseException, where: str) -> ErrorReply:
    """The one exception-to-ErrorReply mapping (see the module docstring)."""
    code = e.code if isinstance(e, ProtocolError) else next(
        (c for cls, c in REQUEST_ERRORS if isinstance(e, cls)), None)
    if code is None:
        log.error("%s: internal error (a bug) serving a request", where, exc_info=e)
        return ErrorReply(code="internal", message=f"{type(e).__name__}: {e}")
    log.warning("%s: error reply [%s]: %s", where, code, e)
    return ErrorReply(code=code, message=str(e))


@dataclass(frozen=True)
class Transport:
    """Where and how a service listens."""

    bind: str
    max_message_bytes: int
    max_peer_backlog_bytes: int
    heartbeat_s: float = 0.0
    heartbeat_timeout_s: float = 0.0
    curve_secret_key: str = ""  # CurveZMQ: this server's secret key file ("" = off)
    curve_authorized_keys: str = ""  # CurveZMQ: directory of the allowed clients' keys


@dataclass
class Call:
    """One request being handled: who sent it, its id, and when it arrived."""

    client: Any  # the ROUTER identity frame of the sender
    rid: int
    t_in: float


Handler = Callable[[Any, Call], "Message | None"]


class Service:
    def __init__(self, transport: Transport, where: str):
        self.where = where  # names this server in logs and error messages
        self.max_bytes = transport.max_message_bytes
        self.ctx = zmq.Context()
        self.authenticator: Any = None
        keys = self._curve(transport) if transport.curve_secret_key else None
        self.frontend = make_socket(self.ctx, zmq.ROUTER, transport.bind, bind=True, hwm=10000,
                                    max_message_bytes=self.max_bytes, curve=keys,
                                    heartbeat_s=transport.heartbeat_s,
                                    heartbeat_timeout_s=transport.heartbeat_timeout_s)
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.endpoint = bound_endpoint(self.frontend)
        self.backlog = PeerBacklog(transport.max_peer_backlog_bytes)
        self.stats: WindowedTally[ServerCounters] = WindowedTally(ServerCounters())
        self.error_codes: dict[str, int] = {}  # error replies sent, by code (IO thread only)
        self.handlers: dict[MsgType, Handler] = {}
        self.precheck: Callable[[Message], None] | None = None  # runs before every handler
        self.executor: Any = None  # common.executors.Executor, see use()
        self.stop_event = threading.Event()
        self.fatal: str | None = None  # why the service stopped, if it broke

    def _curve(self, transport: Transport) -> CurveKeys:
        keys = CurveKeys.load(transport.curve_secret_key)
        if not Path(transport.curve_authorized_keys).is_dir():
            raise MfgServeError(f"--curve-authorized-keys {transport.curve_authorized_keys} "
                                "is not a directory of client public keys")
        from zmq.auth.thread import ThreadAuthenticator

        self.authenticator = ThreadAuthenticator(self.ctx)
        self.authenticator.start()
        self.authenticator.configure_curve(domain="*", location=transport.curve_authorized_keys)
        return keys

    # ------------------------------------------------------------------ composition
    def handle(self, cls: type[Message], handler: Handler) -> None:
        """Answer every decoded ``cls`` message with ``handler(msg, call)``."""
        self.handlers[cls.TYPE] = handler

    def use(self, executor) -> None:
        """Run offloaded requests (:meth:`offload`) on ``executor`` (started here)."""
        self.executor = executor
        executor.start(self)

    def offload(self, msg: Message, call: Call) -> bool:
        """Hand ``msg`` to the executor; False (counted as busy) when its queue is full."""
        if self.executor.submit(msg, call):
            return True
        self.stats.add(busy=1)
        return False

    # ------------------------------------------------------------------ the loop
    def serve_forever(self, ready_file: str = "") -> None:
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(self.endpoint)
            os.replace(tmp, ready_file)
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        results = self.executor.sockets() if self.executor else []
        for sock in results:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                events = dict(poller.poll(POLL_MS))
                if self.executor:
                    self.executor.tick()
                for sock in results:
                    if sock in events:
                        self.executor.drain(sock)
                if self.frontend in events:
                    self._burst()
        finally:
            self.close()

    def _burst(self) -> None:
        for _ in range(BURST):  # bounded, then look at results again
            try:
                frames = self.frontend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list) -> None:
        self.stats.add(requests=1)
        if len(frames) < 2:
            return  # no envelope to answer: nothing to do
        client, body = frames[0], frames[1:]
        rid = codec.peek_request_id(body[0])
        try:
            msg, rid = codec.decode(body, self.max_bytes)
            handler = self.handlers.get(msg.TYPE)
            if handler is None:
                raise ProtocolError("unexpected_type",
                                    f"a server does not accept {type(msg).__name__} messages")
            if self.precheck is not None:
                self.precheck(msg)
            reply = handler(msg, Call(client, rid, time.perf_counter()))
        except Exception as e:  # a bug must not take the server down for everyone else
            self.stats.add(errors=1)
            reply = error_reply(e, self.where)
        if reply is not None:
            self.send(client, codec.encode(reply, rid))

    def send(self, client: Any, frames: list) -> None:
        """Every reply leaves through here: counted (error replies also by code), and
        bounded per client (PeerBacklog)."""
        self.stats.add(bytes_out=sum(memoryview(f).nbytes if not isinstance(f, zmq.Frame)
                                     else len(f) for f in frames))
        code = codec.peek_error_code(frames)
        if code is not None:
            self.error_codes[code] = self.error_codes.get(code, 0) + 1
        self.backlog.send(self.frontend, client, frames)

    # ------------------------------------------------------------------ stopping
    def stop(self) -> None:
        self.stop_event.set()

    def fail(self, reason: str) -> None:
        """Stop because the service broke (a sampler died): the process exits with 1."""
        if self.fatal is None:
            self.fatal = reason
        self.stop_event.set()

    def close(self) -> None:
        self.stop_event.set()
        idle = self.executor.close() if self.executor else True
        self.frontend.close(0)
        if self.authenticator is not None:
            self.authenticator.stop()
        if idle:
            self.ctx.term()  # else a thread still holds a socket; process exit reclaims it
