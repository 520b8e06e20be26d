"""Sampler servers as child processes of a launcher (worker-mode, server-node): their
command lines, waiting until they answer, and shutting them down politely."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import zmq

from common.config import ServerConfig, to_argv
from common.errors import ChildFailedError
from common.messages import Ping, Shutdown
from common.rpc import RpcChannel
from deploy.processes import ProcessGroup


class LaunchError(ChildFailedError):
    """A child failed or never became ready; the message names it (exit code 1)."""


def server_argv(s: ServerConfig, parts: str, part: int, endpoint: str,
                cluster_file: Path, token_file: str = "", ready_file: str = "") -> list[str]:
    """The ``sampler-server`` command line for one part: every option of ``s`` (through
    :func:`common.config.to_argv`, so none is left out) with this server's place: part
    ``part`` of ``parts`` at ``endpoint``, seed ``s.seed + part``. ``token_file`` (see
    :func:`common.sockets.new_token_file`) lets the launcher stop it; the server writes
    ``ready_file`` once bound (see :func:`wait_ready`)."""
    own = dataclasses.replace(s, parts=parts, part_id=part, bind=endpoint,
                              cluster=str(cluster_file), seed=s.seed + part,
                              shutdown_token_file=token_file, ready_file=ready_file)
    return [sys.executable, "-m", "sampler_server.main", *to_argv(own)]


def wait_ready(group: ProcessGroup, endpoints: list[tuple[str, str]], timeout_s: float,
               ready_files: dict[str, Path] | None = None) -> None:
    """Ping every server until it answers, failing fast if one exits. With ``ready_files``
    (server name -> its --ready-file), a server is pinged only once it has bound: a TCP
    connect to a port nobody listens on yet can, inside the ephemeral port range, connect the
    socket to itself (simultaneous open) and take the port the server is about to bind."""
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
                    if ready_files and not ready_files[name].exists():
                        time.sleep(0.05)
                        continue
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


