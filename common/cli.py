"""One ``main`` wrapper for every console entry point: exit codes and one message format.

Exit codes:

* 0: done;
* 2: bad input: an :class:`~common.errors.MfgServeError` (a ConfigError, a missing or corrupt
  partition set, a server that answered with an error, ...) or an ``OSError``;
* 1: a child process failed (:class:`~common.errors.ChildFailedError`: its ``exit_code``), or
  an unexpected exception (a bug: its traceback is printed);
* 128 + N: stopped by signal N (SIGINT 130, SIGTERM 143) while :func:`raise_on_signals` was
  in force, or by Ctrl-C.

Expected errors print one line ``PROG: error: MESSAGE`` on stderr, never a traceback.
``SystemExit`` (``--help``, an argparse usage error: exit 2) passes through unchanged.
"""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Callable

from common.errors import MfgServeError


class Interrupted(Exception):
    """SIGINT/SIGTERM reached a launcher (raised from its signal handler). Not an
    MfgServeError, so no ``except MfgServeError`` on the way swallows it."""

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


def run_main(prog: str | Callable[[], str], body: Callable[[], int | None]) -> int:
    """Run ``body`` (a CLI's work) and return its exit code (None means 0), mapping every
    exception as the module docstring says. ``prog`` (or a function returning it, for a name
    known only once the options are parsed) starts each message."""
    def name() -> str:
        return prog if isinstance(prog, str) else prog()

    try:
        code = body()
    except Interrupted as e:
        return _fail(name(), f"interrupted by {e}", 128 + e.signum)
    except KeyboardInterrupt:
        return _fail(name(), "interrupted by SIGINT", 128 + signal.SIGINT)
    except MfgServeError as e:
        return _fail(name(), f"error: {e}", e.exit_code)
    except OSError as e:
        return _fail(name(), f"error: {e}", 2)
    except Exception:
        traceback.print_exc()
        return 1
    return 0 if code is None else code


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    return code
