"""mfgserve-plot as a user runs it: a real short training run's directory in, valid PNG files
out; and clear errors (exit 2, naming the file and line) for what is not a run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import REPO

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss", "accuracy", "throughput", "stages")


def _plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.plot_cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)


def _assert_pngs(files: dict[str, str], out: Path) -> None:
    import matplotlib.image

    assert set(files) == set(PLOTS)
    for name in PLOTS:
        path = Path(files[name])
        assert path == out / f"{name}.png"
        assert path.read_bytes()[:8] == PNG_SIGNATURE, path
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, image.shape
        assert image.min() < image.max(), f"{path} is blank"


def _record(epoch: int, **extra) -> dict:
    """One epoch line as the run-directory contract writes it."""
    stages = {"server_sample_s": 0.5, "server_total_s": 1.5, "wire_s": 2.0, "decode_s": 0.01,
              "trainer_wait_s": 0.2, "forward_backward_s": 3.0}
    return {"epoch": epoch, "time": 1.8e9 + epoch, "loss": 1.0 / (epoch + 1), "lr": 0.003,
            "epoch_s": 3.5, "seeds_per_s": 1000.0 + epoch, "stages_s": stages,
            "bytes_received": 1 << 20, "cache_rows_from_cache": 0, **extra}


def _write_lines(path: Path, lines: list[str], tail: str = "") -> None:
    path.write_text("".join(line + "\n" for line in lines) + tail)


@pytest.mark.timeout(300)
def test_contract_file_to_pngs(tmp_path):
    """Every contract field, a NaN loss written as null, an epoch repeated by a resumed run
    and a last line still being written: four valid PNGs, the summary naming them."""
    run = tmp_path / "run"
    run.mkdir()
    records = [_record(0), _record(1, valid_acc=0.5, test_acc=0.45, eval="sampled"),
               _record(2, loss=None), _record(1, valid_acc=0.55, test_acc=0.5, eval="full"),
               _record(3, valid_acc=0.6, test_acc=0.58, eval="full")]
    _write_lines(run / "metrics.jsonl", [json.dumps(r) for r in records], tail='{"epoch": 4, ')
    (run / "summary.json").write_text(json.dumps({"dataset": "toy", "test_acc": 0.58}))
    proc = _plot(str(run), "--dpi", "60")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["epochs"] == 4  # 0..3: the repeated epoch once, the partial line left out
    _assert_pngs(result["files"], run / "plots")


@pytest.mark.timeout(300)
def test_bad_run_directories_exit_2_naming_file_and_line(tmp_path):
    missing = tmp_path / "nope"
    proc = _plot(str(missing))
    assert proc.returncode == 2 and f"run directory {missing} does not exist" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _plot(str(empty))
    assert proc.returncode == 2 and f"{empty / 'metrics.jsonl'} does not exist" in proc.stderr
    cases = {"not json": ["{\"epoch\": 0}", "{oops"], "no epoch": ["{\"loss\": 1.0}"],
             "bad loss": ["{\"epoch\": 0}", "{\"epoch\": 1, \"loss\": \"high\"}"]}
    for name, lines in cases.items():
        run = tmp_path / name.replace(" ", "_")
        run.mkdir()
        _write_lines(run / "metrics.jsonl", lines)
        proc = _plot(str(run))
        where = f"{run / 'metrics.jsonl'} line {len(lines)}"
        assert proc.returncode == 2 and where in proc.stderr, (name, proc.stderr)
        assert "Traceback" not in proc.stderr and not (run / "plots").exists()


def _train(work: Path, tmp: Path) -> dict:
    """A real 2-epoch worker-mode run on a tiny generated graph; its JSON summary."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.worker_mode", "--work-dir", str(work),
         "--synthetic-nodes", "2000", "--epochs", "2", "--batch-size", "256", "--hidden", "32",
         "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=400, env=env,
        stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_plots_of_a_real_training_run(tmp_path):
    """worker-mode writes the run directory; mfgserve-plot draws it (default --out)."""
    summary = _train(tmp_path / "work", tmp_path)
    run = Path(summary["run_dir"])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1]
    proc = _plot(str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["epochs"] == 2 and result["run_dir"] == str(run)
    _assert_pngs(result["files"], run / "plots")
