"""mfgserve's native kernels (common/native.c): built once per machine with the C compiler,
loaded with ctypes.

Why: the per-batch work of a sampler (a seeded hop's draws turned into sources, relabelling
a hop's sampled sources: ~10^5-10^6 ids) is a handful of scattered reads and writes per id.
numpy does each as its own pass over memory, with the GIL held between passes; one C loop
does them all in a single pass with the GIL released, fetching the next rows' memory ahead
(measured in docs/benchmarks.md, "Native relabel" and "session 21"). Kernels:
``mfg_relabel`` (sampler_server/neighbor_sampler.py), ``mfg_relation_runs``
(sampler_server/partition_store.py), ``mfg_row_runs``, ``mfg_draw_picks``
and ``mfg_gather_rows`` (sampler_server/seeded_sampler.py), ``mfg_copy_rows``
(sampler_server/partition_store.py), ``mfg_assemble_rows`` (trainer_client/feature_cache.py:
a CPU trainer's cached and received feature rows into one matrix), ``mfg_transpose_csc``
(common/mfg.py) and ``mfg_split_bags`` (trainer_client/model.py), ``mfg_owners`` and
``mfg_copy_part_rows`` (common/mfg.py SourceRows: a multi-part set's rows read in place).

Build: the first use compiles ``native.c`` with ``$CC`` (else the compiler Python was built
with, else ``cc``) into ``$MFGSERVE_NATIVE_DIR`` (default ``~/.cache/mfgserve``; a private
temporary directory if that is not writable), under a name that hashes the source and the
flags, so an edited source is rebuilt and concurrent builders (several servers starting at
once) each write their own temporary file and rename it into place. ``deploy/install.sh``
builds it at install time (``python -m common.native``).

Not silent: where the library cannot be built or loaded (no compiler, or
``MFGSERVE_NATIVE=0`` to switch it off), :func:`load` returns None, :func:`status` says why,
servers log it at start and report it in their ``serving`` line, and callers run the
equivalent numpy code, which gives identical results (tests/test_native.py checks both).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
CFLAGS = ["-O3", "-shared", "-fPIC", "-std=c99"]
ENV_SWITCH = "MFGSERVE_NATIVE"  # "0": do not build or load, use the numpy paths
ENV_DIR = "MFGSERVE_NATIVE_DIR"
BAD_ID, NO_MEMORY = -1, -2  # the kernels' error returns (MFG_BAD_ID, MFG_NO_MEMORY in native.c)

_lock = threading.Lock()
_state: dict[str, object] = {}


class NativeError(RuntimeError):
    """The native library could not be built or loaded (the message says why)."""


def compiler() -> list[str]:
    """The C compiler command: ``$CC``, else the one this Python was built with, else cc."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _cache_dir() -> Path:
    configured = os.environ.get(ENV_DIR)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mfgserve"


def library_path(directory: Path | None = None) -> Path:
    """Where the library built from the current source and flags lives."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS + compiler() + [sys.platform]).encode())
    return (directory or _cache_dir()) / f"mfgserve-native-{h.hexdigest()[:16]}.so"


def build(directory: Path | None = None) -> Path:
    """Compile the library unless it is already built; its path. NativeError on failure."""
    target = library_path(directory)
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        if directory is None and os.environ.get(ENV_DIR) is None:  # fall back to a private tmp
            return build(Path(tempfile.mkdtemp(prefix="mfgserve-native-")))
        raise NativeError(f"cannot write the native library to {target.parent}: {e}; set "
                          f"{ENV_DIR} to a writable directory") from e
    cmd = [*compiler(), *CFLAGS, "-o", tmp, str(SOURCE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise NativeError(f"C compiler {cmd[0]!r} could not run ({e}); install a C compiler "
                          "(e.g. gcc) or set CC") from e
    if proc.returncode != 0:
        os.unlink(tmp)
        raise NativeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}): "
                          f"{proc.stderr.strip()[-500:]}")
    os.replace(tmp, target)  # atomic: a concurrent builder's copy is identical
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mfg_relabel.restype = i64
    lib.mfg_relabel.argtypes = [p, i64, p, i64, i64, p, p, p]
    lib.mfg_draw_picks.restype = i64
    lib.mfg_draw_picks.argtypes = [p, p, i64, i64, p, p]
    lib.mfg_copy_rows.restype = i64
    lib.mfg_copy_rows.argtypes = [p, i64, i64, p, i64, p, ctypes.c_int32]
    lib.mfg_row_runs.restype = i64
    lib.mfg_row_runs.argtypes = [p, i64, p, i64, p, p]
    lib.mfg_relation_runs.restype = i64
    lib.mfg_relation_runs.argtypes = [p, i64, p, i64, p, i64, i64, p, p]
    lib.mfg_gather_rows.restype = i64
    lib.mfg_gather_rows.argtypes = [p, p, i64, i64, p, i64, p, i64, ctypes.c_int32, p]
    lib.mfg_assemble_rows.restype = i64
    lib.mfg_assemble_rows.argtypes = [p, i64, i64, p, i64, p, p, i64, p, i64, p]
    lib.mfg_transpose_csc.restype = i64
    lib.mfg_transpose_csc.argtypes = [p, i64, p, i64, i64, p, p, p, p]
    lib.mfg_split_bags.restype = i64
    lib.mfg_split_bags.argtypes = [p, i64, p, i64, p, p, i64, p, i64, p, p, p, p]
    lib.mfg_owners.restype = i64
    lib.mfg_owners.argtypes = [p, i64, p, p, i64, p, p]
    lib.mfg_copy_part_rows.restype = i64
    lib.mfg_copy_part_rows.argtypes = [p, p, i64, i64, p, p, i64, p]
    return lib


def load() -> ctypes.CDLL | None:
    """The loaded library, or None where it is switched off or cannot be built (see
    :func:`status`). Built and loaded once per process."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        if os.environ.get(ENV_SWITCH, "1") == "0":
            _state["why"] = f"switched off ({ENV_SWITCH}=0)"
        else:
            try:
                path = build()
                lib = _bind(ctypes.CDLL(str(path)))
                _state["why"], _state["path"] = "loaded", path
            except (NativeError, OSError, AttributeError) as e:
                _state["why"] = f"unavailable: {e}"
                log.warning("native kernels %s; the numpy paths run instead (slower)",
                            _state["why"])
        _state["lib"] = lib
        return lib


def status() -> str:
    """"loaded", or why the numpy paths run (after :func:`load`)."""
    load()
    return str(_state["why"])


def main() -> int:
    """``python -m common.native``: build (if needed) and load the library; exit 1 if not."""
    lib = load()
    where = f" ({_state['path']})" if lib is not None else ""
    print(f"native kernels: {status()}{where}", file=sys.stderr)
    return 0 if lib is not None else 1


if __name__ == "__main__":
    sys.exit(main())
