"""Private run directories in the temporary directory, and removing those whose owner died.

A launcher (worker-mode, server-node) and a server with sampler processes each keep their
sockets, tokens and ready files in a directory of their own (``mkdtemp``: mode 0700), named
``mfgserve-<kind>...`` and holding an owner file: the creating process's pid and start time.
Killed with SIGKILL, a process runs no cleanup and leaves its directory behind; the next
launcher, server-node or server with sampler processes started by the same user calls
:func:`remove_stale_run_dirs`, which deletes every such directory whose owner no longer runs
(a pid that exists but started at another time is a reused pid: its directory goes too).
Directories without an owner file, of other users, or made in another pid namespace (a
container sharing this temporary directory: its pids mean nothing here) are never touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import psutil

RUN_DIR_PREFIX = "mfgserve-"
OWNER_FILE = "launcher.pid"


def make_run_dir(kind: str = "") -> Path:
    """A private (0700) directory ``mfgserve-<kind>XXXXXXXX`` in the temporary directory,
    recording this process's pid and start time so that a later start can tell it is stale."""
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX + kind))
    (run_dir / OWNER_FILE).write_text(
        f"{os.getpid()} {_start_time(os.getpid())} {_pid_namespace()}")
    return run_dir


def _pid_namespace() -> int:
    """This process's pid namespace (its inode; 0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def remove_stale_run_dirs(parent: str | None = None) -> list[str]:
    """Delete run directories left by processes that no longer run (killed with SIGKILL, so
    no cleanup ran); returns what was removed. Directories of live processes are kept."""
    removed = []
    for d in Path(parent or tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*"):
        owner = d / OWNER_FILE
        try:
            if not d.is_dir() or d.stat().st_uid != os.getuid() or not owner.is_file():
                continue
            fields = owner.read_text().split()
            pid, started = int(fields[0]), float(fields[1])
            namespace = int(fields[2]) if len(fields) > 2 else _pid_namespace()
        except (OSError, ValueError, IndexError):
            continue
        if namespace != _pid_namespace():
            continue  # another pid namespace's process: its pid cannot be checked here
        alive = psutil.pid_exists(pid) and abs(_start_time(pid) - started) < 1.0
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed
