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
