"""The socket factory and deadline-bounded receive: the transport layer's only zmq code
outside the server/client process wrappers. It knows nothing of graphs."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from common.errors import ConfigError


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ keys of one socket: its own keypair and, for a client, the server's public key.

    Key files are those written by ``mfgserve-keys`` (zmq's certificate format):
    ``NAME.key`` holds a public key, ``NAME.key_secret`` the public and secret keys.
    """

    public: bytes
    secret: bytes
    server_public: bytes | None = None

    @classmethod
    def load(cls, secret_file: str, server_public_file: str | None = None) -> CurveKeys:
        public, secret = _load_cert(secret_file, need_secret=True)
        server = _load_cert(server_public_file, need_secret=False)[0] if server_public_file else None
        return cls(public, secret or b"", server)


def _load_cert(path: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"key file {p} does not exist; create keys with `mfgserve-keys`")
    try:
        public, secret = zmq.auth.load_certificate(str(p))
    except (ValueError, OSError) as e:
        raise ConfigError(f"key file {p} is not a CurveZMQ certificate: {e}") from e
    if need_secret and not secret:
        raise ConfigError(f"key file {p} holds no secret key; pass the NAME.key_secret file")
    return public, secret


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool,
                hwm: int = 1000, linger_ms: int = 0, identity: bytes | None = None,
                max_message_bytes: int = -1, curve: CurveKeys | None = None,
                heartbeat_s: float = 0.0, heartbeat_timeout_s: float = 0.0,
                monitor_events: int = 0) -> zmq.Socket:
    """One socket, bound or connected, with linger, high-water marks and a size cap set.

    ``monitor_events`` attaches a connection monitor (``sock.get_monitor_socket()`` then
    returns it) before the connect, so no event of the first connection attempt is missed.

    ``heartbeat_s`` > 0 makes libzmq ping the peer every ``heartbeat_s`` seconds and drop the
    connection when nothing comes back within ``heartbeat_timeout_s`` (ZMTP heartbeats, run
    by libzmq's IO thread): a dead or frozen peer then shows up as a disconnect. A new
    connection's handshake gets the same time (ZMQ_HANDSHAKE_IVL, libzmq's default 30 s):
    a reconnection to a frozen peer, which the kernel accepts but nothing answers, drops then
    too, so a request sent to it fails after the heartbeat timeout, not after 30 s.

    ``linger_ms=0`` makes close() never block on unsent messages; ``max_message_bytes``
    (ZMQ_MAXMSGSIZE) makes libzmq drop peers that send anything larger. With ``curve``, the
    socket is a CurveZMQ server (no ``server_public``) or client (with it): traffic is
    encrypted and a server accepts only clients its authenticator allows.
    """
    sock = ctx.socket(kind)
    if heartbeat_s > 0:
        timeout_ms = int(max(heartbeat_timeout_s, heartbeat_s) * 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        for option in (zmq.HEARTBEAT_TIMEOUT, zmq.HEARTBEAT_TTL, zmq.HANDSHAKE_IVL):
            sock.setsockopt(option, timeout_ms)
    if curve is not None:
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
        if curve.server_public is None:
            sock.curve_server = True
        else:
            sock.curve_serverkey = curve.server_public
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if max_message_bytes > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    monitor = sock.get_monitor_socket(monitor_events) if monitor_events else None
    try:
        if bind:
            sock.bind(_wildcard(endpoint))
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as e:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
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


def new_token_file(path: str | Path) -> str:
    """Write a fresh random token to ``path`` (mode 0600) and return it: the secret a
    launcher shares with the servers it starts (e.g. to let it send them Shutdown)."""
    token = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def read_token(path: str) -> str:
    """The token in ``path`` ("" for no path); errors name the file and the option."""
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read --shutdown-token-file {path}: {e}") from e
    if len(token) < 16:
        raise ConfigError(f"--shutdown-token-file {path} must hold a token of at least 16 "
                          "characters")
    return token


class Deadline:
    """A point in time; ``left()`` is the seconds remaining (never negative)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())
