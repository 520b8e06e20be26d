"""Static checks as part of the suite: ruff on the whole tree, mypy on common/."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from procs import REPO


@pytest.mark.timeout(120)
def test_ruff_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.timeout(300)
def test_mypy_common():
    if shutil.which("mypy") is None and subprocess.run(
            [sys.executable, "-m", "mypy", "--version"], capture_output=True).returncode != 0:
        pytest.fail("mypy is not installed: install the test extras (pip install -e .[test])")
    proc = subprocess.run([sys.executable, "-m", "mypy", "common", "--ignore-missing-imports",
                           "--no-error-summary"], cwd=REPO, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


_PACKAGES = ("common", "partition", "sampler_server", "trainer_client", "benchmarks")


@pytest.mark.timeout(240)
def test_every_module_imports():
    """Every module of the packages imports: a name moved or removed in one module and still
    imported by another (which ruff cannot see across files) fails here, not only in the one
    test that happens to run that module."""
    code = (
        "import importlib, pathlib, sys, traceback\n"
        f"pkgs = {_PACKAGES!r}\n"
        "bad = []\n"
        "for pkg in pkgs:\n"
        "    for f in sorted(pathlib.Path(pkg).glob('*.py')):\n"
        "        mod = pkg + '.' + f.stem if f.stem != '__init__' else pkg\n"
        "        try:\n"
        "            importlib.import_module(mod)\n"
        "        except Exception:\n"
        "            bad.append(mod + ': ' + traceback.format_exc(limit=2))\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=220, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
