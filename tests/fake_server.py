"""An in-process, scriptable sampler-server stand-in for the client's failure cases.

A real ROUTER socket on a real endpoint (TCP on 127.0.0.1, a free port, unless an ``ipc://``
endpoint is given), served by one thread. What it does with each request is scripted: a
:class:`Script` hands out one :class:`Action` per request, in arrival order, then its
``then`` action for every request after those. Several fakes may share one script (one
sequence over all of them), so a test need not know which replica a client picks first.

Actions: answer correctly (:data:`REPLY`), answer garbage (:func:`garbage`: a header that is
not msgpack, a wrong protocol version, tensor sizes that do not match the frames), answer
late (:func:`late`), answer twice with the same request id (:data:`TWICE`), never answer
(:data:`NEVER`), or close the socket, dropping every connection (:data:`CLOSE`; the fake
then serves nothing more, like a crashed server).

A correct answer is built with :mod:`common.codec`: a canned :class:`Pong` for a Ping, the
request's own ``nodes`` echoed as the label of a NodeDataReply (so a test can tell whose reply
it got), a few seeds for a SeedsRequest, empty stats for a StatsRequest.

:meth:`FakeServer.stop` ends the thread, which closes the socket, joins it and terminates the
fake's zmq context: nothing is left behind.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import torch
import zmq

from common import codec
from common.errors import ProtocolError
from common.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    Message,
    NodeDataReply,
    NodeDataRequest,
    Ping,
    Pong,
    SeedsReply,
    SeedsRequest,
    StatsReply,
    StatsRequest,
)

POLL_MS = 20  # how often the serving thread looks at the stop flag
GARBAGE_KINDS = ("bad_msgpack", "bad_version", "size_mismatch")


@dataclass(frozen=True)
class Action:
    """What the fake does with one request."""

    kind: str  # reply | late | twice | never | close | garbage
    delay_s: float = 0.0  # late: seconds between the request and its reply
    garbage: str = ""  # garbage: one of GARBAGE_KINDS


REPLY = Action("reply")
TWICE = Action("twice")
NEVER = Action("never")
CLOSE = Action("close")


def late(delay_s: float) -> Action:
    return Action("late", delay_s=delay_s)


def garbage(kind: str) -> Action:
    if kind not in GARBAGE_KINDS:
        raise ValueError(f"garbage kind {kind!r} is not one of {GARBAGE_KINDS}")
    return Action("garbage", garbage=kind)


class Script:
    """The actions for the next requests, in arrival order; ``then`` for all after them.
    Thread-safe: fakes sharing a script take turns on one sequence."""

    def __init__(self, *steps: Action, then: Action = REPLY):
        self._steps = deque(steps)
        self._then = then
        self._lock = threading.Lock()

    def next(self) -> Action:
        with self._lock:
            return self._steps.popleft() if self._steps else self._then


def canned_pong(**fields: Any) -> Pong:
    """A Pong for a one-part partition set; ``fields`` override (e.g. set_id, part_id)."""
    pong = Pong(part_id=0, num_parts=1, num_nodes=100, feat_dim=4, num_classes=2,
                node_offsets=[0, 100], feat_dtype="float32", dataset="fake", pid=os.getpid(),
                server_id="fake", set_id="0123456789abcdef")
    return replace(pong, **fields)


def answer(msg: Message, pong: Pong) -> Message:
    """The correct reply to ``msg`` (an ErrorReply for a type the fake does not serve)."""
    if isinstance(msg, Ping):
        return pong
    if isinstance(msg, NodeDataRequest):
        return NodeDataReply(feat=torch.zeros(msg.nodes.numel(), 0), label=msg.nodes.clone())
    if isinstance(msg, SeedsRequest):
        return SeedsReply(seeds=torch.arange(4, dtype=torch.int64))
    if isinstance(msg, StatsRequest):
        return StatsReply(values={})
    return ErrorReply(code="bad_request", message=f"the fake does not serve {msg.TYPE.name}")


def garbage_frames(kind: str, reply: Message, rid: int) -> list[bytes]:
    """``reply``'s frames for request ``rid``, spoiled the ``kind`` way (see GARBAGE_KINDS)."""
    frames = [bytes(f) for f in codec.encode(reply, rid)]
    if kind == "bad_msgpack":
        return [b"\xc1 is never valid msgpack", *frames[1:]]
    if kind == "bad_version":
        head = msgpack.unpackb(frames[0], raw=False)
        head["v"] = PROTOCOL_VERSION + 1
        return [msgpack.packb(head, use_bin_type=True), *frames[1:]]
    if len(frames) < 2 or not frames[-1]:  # needs a tensor to cut short
        frames = [bytes(f) for f in codec.encode(SeedsReply(seeds=torch.arange(4)), rid)]
    return [*frames[:-1], frames[-1][:-1]]  # the header promises one byte more


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    frames: list[bytes] = field(compare=False)


class FakeServer:
    """A scripted ROUTER served by a thread; see the module doc. Use as a context manager or
    call :meth:`stop`."""

    def __init__(self, script: Script | None = None, *, endpoint: str = "tcp://127.0.0.1",
                 pong: Pong | None = None):
        self.script = script or Script()
        self.pong = pong or canned_pong()
        self.requests: list[tuple[int, Message]] = []  # (request id, message), as received
        self.replies_sent = 0  # frames sets sent, duplicates and garbage included
        self.bad_requests: list[ProtocolError] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("ipc://"):
            self._sock.bind(endpoint)
            self.endpoint = endpoint
        else:
            port = self._sock.bind_to_random_port(endpoint)
            self.endpoint = f"{endpoint}:{port}"
        self._due: list[_Due] = []  # late replies, soonest first
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"fake-server {self.endpoint}")
        self._thread.start()  # from here on only the thread touches the socket

    # ------------------------------------------------------------------ serving thread
    def _serve(self) -> None:
        try:
            while not self._stop.is_set() and not self._sock.closed:
                self._send_due()
                wait_ms = POLL_MS
                if self._due:
                    wait_ms = min(wait_ms, max(0, int((self._due[0].at - time.monotonic())
                                                      * 1000) + 1))
                if self._sock.poll(wait_ms, zmq.POLLIN):
                    self._handle(*self._sock.recv_multipart())
        finally:
            if not self._sock.closed:
                self._sock.close(0)

    def _send_due(self) -> None:
        while self._due and self._due[0].at <= time.monotonic():
            self._send(heapq.heappop(self._due).frames)

    def _send(self, frames: list[bytes]) -> None:
        self._sock.send_multipart(frames)
        self.replies_sent += 1

    def _handle(self, ident: bytes, *frames: bytes) -> None:
        try:
            msg, rid = codec.decode(frames)
        except ProtocolError as e:  # the client under test sent something malformed
            self.bad_requests.append(e)
            rid = codec.peek_request_id(frames[0]) if frames else 0
            self._send([ident, *codec.encode(ErrorReply(code=e.code, message=str(e)), rid)])
            return
        self.requests.append((rid, msg))
        action = self.script.next()
        reply = answer(msg, self.pong)
        out = [ident, *(bytes(f) for f in codec.encode(reply, rid))]
        if action.kind == "reply":
            self._send(out)
        elif action.kind == "twice":
            self._send(out)
            self._send(out)
        elif action.kind == "late":
            heapq.heappush(self._due, _Due(time.monotonic() + action.delay_s, next(self._seq),
                                           out))
        elif action.kind == "garbage":
            self._send([ident, *garbage_frames(action.garbage, reply, rid)])
        elif action.kind == "close":
            self._sock.close(0)
        elif action.kind != "never":
            raise ValueError(f"unknown action {action.kind!r}")

    # ------------------------------------------------------------------ test side
    def wait_sent(self, count: int, timeout_s: float = 5.0) -> None:
        """Block until ``count`` replies have gone out (e.g. a late one)."""
        deadline = time.monotonic() + timeout_s
        while self.replies_sent < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.endpoint} sent {self.replies_sent} replies within "
                                     f"{timeout_s}s, expected {count}")
            time.sleep(0.01)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread (it closes the socket), join it, terminate the context."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"fake server {self.endpoint} did not stop within {timeout_s}s")
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
