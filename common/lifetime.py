"""Child processes that die with their parent (used by launchers and by servers' workers)."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess.Popen: the kernel SIGKILLs the child when the thread
    that started it exits (the parent died or was killed). No-op off Linux."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: teardown still kills children on every normal exit path
