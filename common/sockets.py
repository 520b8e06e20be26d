"""The socket factory and deadline-bounded receive: the transport layer's only zmq code
outside the server/client process wrappers. It knows nothing of graphs."""

from __future__ import annotations

import time
from typing import Any

import zmq

from common.errors import PeerTimeoutError


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool,
                hwm: int = 1000, linger_ms: int = 0, identity: bytes | None = None,
                max_message_bytes: int = -1) -> zmq.Socket:
    """One socket, bound or connected, with linger, high-water marks and a size cap set.

    ``linger_ms=0`` makes close() never block on unsent messages; ``max_message_bytes``
    (ZMQ_MAXMSGSIZE) makes libzmq drop peers that send anything larger.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if max_message_bytes > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    try:
        if bind:
            sock.bind(_wildcard(endpoint))
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(0)
        verb = "bind" if bind else "connect"
        raise OSError(f"cannot {verb} {endpoint}: {e}; choose another endpoint "
                      "(for tcp, port 0 picks a free one)") from e
    return sock


def _wildcard(endpoint: str) -> str:
    """tcp://HOST:0 means 'any free port', spelled tcp://HOST:* for zmq."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


def bound_endpoint(sock: zmq.Socket) -> str:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)


def recv_frames(sock: zmq.Socket, timeout_s: float, *, peer: str, waiting_for: str,
                setting: str) -> list[Any]:
    """Receive one multipart message (zero-copy frames) or raise PeerTimeoutError naming the
    peer, what was awaited and the setting that bounds the wait."""
    if not sock.poll(int(max(timeout_s, 0) * 1000), zmq.POLLIN):
        raise PeerTimeoutError(
            f"no reply from {peer} within {timeout_s:.1f}s while waiting for {waiting_for}; "
            f"check that it is running and reachable, or raise {setting}"
        )
    return sock.recv_multipart(copy=False)


class Deadline:
    """A point in time; ``left()`` is the seconds remaining (never negative)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end
