"""One logging setup for every mfgserve process: lines on stderr, each prefixed with the
process's role (``trainer rank 1``, ``server part 0``, ``sampler 1 of part 0``), so that the
interleaved output of co-located processes stays attributable line by line.

Progress bars (tqdm) are drawn only on a terminal (:func:`bars_allowed`): in a captured log
their carriage-return updates would run into one long line mixed with log records.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname).1s [{role}] %(name)s: %(message)s"


def setup_logging(role: str, level: int = logging.INFO) -> None:
    """Send log records to stderr as ``time level [role] logger: message`` (replaces any
    handler set before, so a role learnt late, e.g. the DDP rank, still applies)."""
    logging.basicConfig(level=level, stream=sys.stderr, force=True,
                        format=FORMAT.format(role=role.replace("%", "%%")))


def bars_allowed(requested: bool, launcher_tty: bool = False) -> bool:
    """Whether to draw progress bars: asked for, and stderr is a terminal (or a launcher whose
    own stderr is a terminal forwards this process's bar updates in place)."""
    if not requested:
        return False
    try:
        return launcher_tty or sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
