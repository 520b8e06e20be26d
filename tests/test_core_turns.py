"""--yield-cores (trainer_client/core_turns.py): the trainer's OpenMP workers found, pinned
and yielding during a window. Each case runs in a child process (it changes that process's
threads' affinity and scheduling policy); the worker-mode default path is checked in
tests/test_worker_mode.py::test_default_synthetic_dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _child(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores for 2 torch threads")
def test_workers_found_pinned_and_yielding_for_a_window():
    from trainer_client.core_turns import idle_is_reversible
    reversible = idle_is_reversible() == ""  # a throwaway thread's policy, back as it was
    out = _child("""
        import json, os, torch
        torch.set_num_threads(2)
        from trainer_client.core_turns import CoreTurns, find_omp_workers
        found = find_omp_workers()
        turns = CoreTurns.start("auto", True)
        got = {"found": found, "active": turns.active, "reason": turns.reason}
        if turns.active:
            turns.give()
            w = turns.workers[0]
            got["during"] = [os.sched_getscheduler(w), sorted(os.sched_getaffinity(w)),
                             sorted(os.sched_getaffinity(0))]
            turns.take()
            got["after"] = os.sched_getscheduler(w)
            turns.give(); turns.take()  # pinned once; a second window only switches policy
            got["summary"] = turns.summary()
        print(json.dumps(got))
    """)
    assert len(out["found"]) == 1, out  # 2 torch threads: the caller and one worker
    assert out["active"] == reversible, out
    if not reversible:
        assert "SCHED_IDLE" in out["reason"], out
        return
    assert out["during"] == [os.SCHED_IDLE, [CORES[1]], [CORES[0]]], out
    assert out["after"] == os.SCHED_OTHER, out
    assert out["summary"] == {"mode": "auto", "active": True, "reason": "", "omp_workers": 1,
                              "cores": CORES[:2], "windows": 2}, out


@pytest.mark.timeout(150)
def test_off_not_alternating_and_a_lost_worker_turn_it_off():
    out = _child("""
        import json, torch
        torch.set_num_threads(1)
        from trainer_client.core_turns import CoreTurns
        off = CoreTurns.start("off", True)
        alone = CoreTurns.start("auto", False)
        one = CoreTurns.start("auto", True)  # 1 torch thread: no worker to find
        lost = CoreTurns("auto")
        lost.active, lost.workers, lost.cores = True, [2 ** 22 + 12345], [0, 0]
        lost.give()  # the thread is gone: off, with the reason, and no exception
        lost.take()
        print(json.dumps([t.summary() for t in (off, alone, one, lost)]))
    """)
    off, alone, one, lost = out
    assert off["active"] is False and off["reason"] == "--yield-cores off", off
    assert alone["active"] is False and "does not alternate" in alone["reason"], alone
    assert one["active"] is False and "no OpenMP worker" in one["reason"], one
    assert lost["active"] is False and lost["reason"].startswith("stopped after 0 windows"), lost
