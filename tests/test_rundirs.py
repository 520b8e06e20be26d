"""common/rundirs.py: a run directory names its owner; a later start removes the directories
whose owner died (pid gone, or reused by a process that started at another time) and keeps
those of live owners, of other shapes, and without an owner file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from procs import REPO

from common.rundirs import OWNER_FILE, make_run_dir, remove_stale_run_dirs


def _made_by_a_process_that_exited(tmp: Path) -> Path:
    out = subprocess.run([sys.executable, "-c", "from common.rundirs import make_run_dir; "
                          "print(make_run_dir('node-'))"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def test_only_directories_of_dead_owners_go(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    mine = make_run_dir("samplers-")
    assert mine.name.startswith("mfgserve-samplers-") and (mine / OWNER_FILE).is_file()
    assert (mine.stat().st_mode & 0o777) == 0o700
    dead = _made_by_a_process_that_exited(tmp_path)
    (dead / "shutdown.token").write_text("x")
    reused = make_run_dir()  # our pid, but another start time: a reused pid
    (reused / OWNER_FILE).write_text(f"{os.getpid()} 12345.0")
    no_owner = tmp_path / "mfgserve-by-hand"
    no_owner.mkdir()
    garbled = make_run_dir()
    (garbled / OWNER_FILE).write_text("not a pid")
    other = tmp_path / "unrelated"
    other.mkdir()
    elsewhere = make_run_dir()  # a dead pid, but in another pid namespace: left alone
    (elsewhere / OWNER_FILE).write_text("999999999 1.0 1")
    old_format = make_run_dir()  # written before the namespace field: this namespace
    (old_format / OWNER_FILE).write_text("999999999 1.0")
    removed = remove_stale_run_dirs()
    assert sorted(removed) == sorted([str(dead), str(reused), str(old_format)])
    assert not dead.exists() and not reused.exists() and not old_format.exists()
    assert mine.is_dir() and no_owner.is_dir() and garbled.is_dir() and other.is_dir()
    assert elsewhere.is_dir()
    assert remove_stale_run_dirs() == []
