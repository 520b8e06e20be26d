"""Request/reply channel to one server over a DEALER socket (transport layer).

A channel may have several requests in flight; replies carry the request id and may arrive
in any order. Every receive has a deadline; errors name the endpoint and the setting to change.
"""

from __future__ import annotations

import itertools
from typing import Any

import zmq

from common import codec
from common.errors import PeerTimeoutError, ProtocolError, RemoteError
from common.messages import ErrorReply, Message
from common.sockets import Deadline, make_socket

_ids = itertools.count(1)


class RpcChannel:
    """A DEALER connected to ``endpoint``. Not thread-safe: one owner thread per channel."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, timeout_s: float, setting: str,
                 max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES, hwm: int = 1000):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.setting = setting
        self.max_message_bytes = max_message_bytes
        self.sock = make_socket(ctx, zmq.DEALER, endpoint, bind=False, hwm=hwm,
                                max_message_bytes=max_message_bytes)
        self.pending: set[int] = set()
        self.bytes_received = 0

    def send(self, msg: Message) -> int:
        rid = next(_ids)
        self.sock.send_multipart(codec.encode(msg, rid), copy=False)
        self.pending.add(rid)
        return rid

    def recv(self, timeout_s: float | None = None, waiting_for: str = "a reply") -> tuple[Message, int]:
        """Next reply to one of our pending requests; stale replies are dropped."""
        deadline = Deadline(self.timeout_s if timeout_s is None else timeout_s)
        while True:
            if not self.sock.poll(int(deadline.left() * 1000), zmq.POLLIN):
                raise PeerTimeoutError(
                    f"no reply from server {self.endpoint} within "
                    f"{self.timeout_s if timeout_s is None else timeout_s:.1f}s while waiting "
                    f"for {waiting_for}; check that the server is running and reachable, "
                    f"or raise {self.setting}")
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
                raise RemoteError(self.endpoint, msg.code, msg.message)
            return msg, rid

    def call(self, msg: Message, timeout_s: float | None = None, waiting_for: str = "") -> Message:
        rid = self.send(msg)
        while True:
            reply, got = self.recv(timeout_s, waiting_for or f"the reply to {msg.TYPE.name}")
            if got == rid:
                return reply

    def close(self) -> None:
        self.sock.close(0)


def expect(msg: Any, cls: type, endpoint: str) -> Any:
    if not isinstance(msg, cls):
        raise ProtocolError("unexpected_reply",
                            f"{endpoint} answered {type(msg).__name__}, expected {cls.__name__}")
    return msg
