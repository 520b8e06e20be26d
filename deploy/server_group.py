"""Sampler servers as child processes of a launcher (worker-mode, server-node): their
command lines, waiting until they answer, and shutting them down politely."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import zmq

from common.config import ServerConfig
from common.errors import MfgServeError
from common.messages import Ping, Shutdown
from common.rpc import RpcChannel
from deploy.processes import ProcessGroup


class LaunchError(MfgServeError):
    """A child failed or never became ready; the message names it."""


class Interrupted(Exception):
    """SIGINT/SIGTERM reached the launcher (raised from its signal handler)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_signals() -> None:
    """Turn SIGINT/SIGTERM into :class:`Interrupted` so launchers unwind through ``finally``
    (tearing their children down) instead of dying on the spot."""

    def on_signal(signum, _frame):
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def server_argv(s: ServerConfig, parts: str, part: int, endpoint: str,
                cluster_file: Path, token_file: str = "") -> list[str]:
    """The ``sampler-server`` command line for one part, carrying ``s``'s tunables;
    ``token_file`` (see :func:`common.sockets.new_token_file`) lets the launcher stop it."""
    argv = [sys.executable, "-m", "sampler_server.main", "--parts", parts, "--part-id",
            str(part), "--bind", endpoint, "--cluster", str(cluster_file),
            "--num-workers", str(s.num_workers), "--max-queue", str(s.max_queue),
            "--max-message-mb", str(s.max_message_mb),
            "--max-peer-backlog-mb", str(s.max_peer_backlog_mb), "--peer-timeout-s",
            str(s.peer_timeout_s), "--seed", str(s.seed + part),
            "--heartbeat-s", str(s.heartbeat_s), "--heartbeat-timeout-s",
            str(s.heartbeat_timeout_s)]
    if token_file:
        argv += ["--shutdown-token-file", token_file]
    if s.curve_secret_key:
        argv += ["--curve-secret-key", s.curve_secret_key,
                 "--curve-authorized-keys", s.curve_authorized_keys]
    return argv


def wait_ready(group: ProcessGroup, endpoints: list[tuple[str, str]], timeout_s: float) -> None:
    """Ping every server until it answers, failing fast if one exits."""
    ctx = zmq.Context()
    deadline = time.monotonic() + timeout_s
    try:
        for name, ep in endpoints:
            ch = RpcChannel(ctx, ep, timeout_s=1.0, setting="--startup-timeout-s")
            try:
                while True:
                    dead = group.failed() or next((c for c in group.children
                                                   if c.proc.poll() is not None), None)
                    if dead is not None:
                        raise LaunchError(
                            f"{dead.name} (pid {dead.pid}) exited with code "
                            f"{dead.proc.returncode} during startup; its last output:\n"
                            f"{dead.last_lines()}")
                    if time.monotonic() > deadline:
                        raise LaunchError(f"{name} at {ep} did not answer a ping within "
                                          f"{timeout_s:.0f}s; raise --startup-timeout-s")
                    try:
                        ch.call(Ping(), timeout_s=1.0)
                        break
                    except (TimeoutError, ConnectionError):
                        ch.close()  # drop the unanswered ping; start a fresh connection
                        ch = RpcChannel(ctx, ep, timeout_s=1.0, setting="--startup-timeout-s")
            finally:
                ch.close()
    finally:
        ctx.term()


def shutdown_servers(endpoints: list[tuple[str, str]], token: str = "") -> None:
    """Ask every server to stop (the launcher's token proves the request is its own)."""
    ctx = zmq.Context()
    try:
        chans = [RpcChannel(ctx, ep, timeout_s=2.0, setting="--shutdown-timeout-s")
                 for _, ep in endpoints]
        for ch in chans:
            ch.send(Shutdown(token=token))
        for ch in chans:
            try:
                ch.recv(timeout_s=2.0)
            except Exception:
                pass
            ch.close()
    finally:
        ctx.term()


