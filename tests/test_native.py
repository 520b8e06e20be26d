"""common/native.py: the native library builds with the machine's C compiler into the
configured directory, `python -m common.native` says what happened, and where it cannot be
built (no compiler) or is switched off (MFGSERVE_NATIVE=0) the reason is named and the numpy
paths run: a server still serves and says which in its `serving` line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


def _native_main(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "MFGSERVE_NATIVE_DIR": str(tmp_path / "lib"), **env}
    return subprocess.run([sys.executable, "-m", "common.native"], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=100)


def test_builds_into_the_configured_directory(tmp_path):
    proc = _native_main(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "native kernels: loaded" in proc.stderr
    built = list((tmp_path / "lib").glob("mfgserve-native-*.so"))
    assert len(built) == 1 and str(built[0]) in proc.stderr
    assert not list((tmp_path / "lib").glob("tmp*"))  # no temporary file left behind
    again = _native_main(tmp_path)  # reused, not rebuilt
    assert again.returncode == 0 and built[0].stat().st_mtime_ns == \
        list((tmp_path / "lib").glob("mfgserve-native-*.so"))[0].stat().st_mtime_ns


def test_a_missing_compiler_is_named(tmp_path):
    proc = _native_main(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert proc.returncode == 1
    assert "no-such-cc" in proc.stderr and "install a C compiler" in proc.stderr
    assert "numpy paths run instead" in proc.stderr


def test_switched_off(tmp_path):
    proc = _native_main(tmp_path, MFGSERVE_NATIVE="0")
    assert proc.returncode == 1
    assert "switched off (MFGSERVE_NATIVE=0)" in proc.stderr
    assert not (tmp_path / "lib").exists()
