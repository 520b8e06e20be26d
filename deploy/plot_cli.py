"""``mfgserve-plot RUN_DIR``: draw one training run's per-epoch metrics as PNG files.

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per epoch, written by rank 0 as each epoch
ends) and, when the run has finished, ``RUN_DIR/summary.json`` (for the chart titles), and
writes into ``RUN_DIR/plots`` (or ``--out DIR``):

* ``loss.png``: training loss per epoch;
* ``accuracy.png``: validation and test accuracy of the evaluated epochs;
* ``throughput.png``: training seeds per second per epoch;
* ``stages.png``: per-stage seconds per epoch, stacked, in two panels: the trainer's own
  stages (they add up to most of the epoch; ``loss_read_s``, a part of ``forward_backward_s``,
  and ``h2d_copy_s``, time on the device's copy stream, are not stacked) and the request
  path (server stages and the wire: overlapped with training by prefetch, so they do not add
  to the epoch's time).

The last stdout line is JSON naming the files. A run still training can be plotted: a last
line without its newline yet (being written) is left out. A resumed run may repeat epochs in
the file; the last record of an epoch wins. Drawing uses matplotlib's Agg backend: no display
is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common.cli import run_main
from common.config import PlotConfig, add_config_args, load_config
from common.errors import ConfigError
from common.jsonout import dumps_strict

PROG = "mfgserve-plot"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLOTS = ("loss", "accuracy", "throughput", "stages")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a training run's output directory (--run-dir; the run's JSON summary "
                        "names it as run_dir)")
    add_config_args(p, PlotConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mfgserve-plot`` (errors mapped by :func:`common.cli.run_main`)."""
    return run_main(PROG, lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(PlotConfig, None, args)
    run_dir = Path(args.run_dir)
    records = read_metrics(run_dir)
    summary = read_summary(run_dir)
    out = Path(cfg.out) if cfg.out else run_dir / "plots"
    files = render(records, out, dpi=cfg.dpi, title=_title(run_dir, summary))
    print(dumps_strict({"run_dir": str(run_dir), "epochs": len(records),
                        "files": {name: str(path) for name, path in files.items()}}))
    return 0


# ---------------------------------------------------------------- reading


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The epoch records of ``run_dir/metrics.jsonl``, one per epoch (the last record of an
    epoch wins), sorted by epoch. A malformed line is a ConfigError naming file and line."""
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist; pass the directory a "
                          "training run wrote (its summary's run_dir, or --run-dir)")
    path = run_dir / METRICS
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: {run_dir} is not a run directory, or the "
                          "run has not finished its first epoch yet")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # the line being written right now: not complete yet
    by_epoch: dict[int, dict[str, Any]] = {}
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            rec = _parse_record(line, path, lineno)
            by_epoch[rec["epoch"]] = rec
    if not by_epoch:
        raise ConfigError(f"{path} holds no epoch record yet; plot again after the first "
                          "epoch ends")
    return [by_epoch[e] for e in sorted(by_epoch)]


def _parse_record(line: str, path: Path, lineno: int) -> dict[str, Any]:
    where = f"{path} line {lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); each "
                          "line must be one epoch's JSON object") from None
    if not isinstance(rec, dict):
        raise ConfigError(f"{where} is a JSON {type(rec).__name__}, not an epoch object")
    epoch = rec.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ConfigError(f"{where} has no valid 'epoch' (an integer >= 0), got {epoch!r}")
    for key in ("loss", "seeds_per_s", "epoch_s", "valid_acc", "test_acc", "valid_rocauc",
                "test_rocauc"):
        if key in rec and not _is_number_or_null(rec[key]):
            raise ConfigError(f"{where}: {key!r} must be a number or null, got {rec[key]!r}")
    stages = rec.get("stages_s", {})
    if not isinstance(stages, dict) or not all(_is_number_or_null(v) for v in stages.values()):
        raise ConfigError(f"{where}: 'stages_s' must map stage names to seconds, got "
                          f"{stages!r}")
    return rec


def _is_number_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def read_summary(run_dir: Path) -> dict[str, Any]:
    """``run_dir/summary.json`` ({} while the run is still going)."""
    path = run_dir / SUMMARY
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); remove it or rerun the "
                          "training") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(summary).__name__}")
    return summary


def _title(run_dir: Path, summary: dict[str, Any]) -> str:
    parts = [run_dir.resolve().name]
    if summary.get("dataset"):
        parts.append(str(summary["dataset"]))
    for key in ("test_acc", "test_rocauc"):  # the dataset's eval metric
        if isinstance(summary.get(key), (int, float)):
            parts.append(f"{key} {summary[key]:.4f}")
    return " | ".join(parts)


# ---------------------------------------------------------------- drawing


def render(records: list[dict[str, Any]], out: Path, *, dpi: int = 100,
           title: str = "") -> dict[str, Path]:
    """Write the four PNG files for ``records`` into ``out``; returns {name: path}."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    out.mkdir(parents=True, exist_ok=True)
    drawers = {"loss": _draw_loss, "accuracy": _draw_accuracy,
               "throughput": _draw_throughput, "stages": _draw_stages}
    files = {}
    for name in PLOTS:
        fig = drawers[name](records)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        files[name] = out / f"{name}.png"
        fig.savefig(files[name], dpi=dpi, format="png")
        _close(fig)
    return files


def _close(fig: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(epochs, values) of the records where ``key`` is a number (null and absent skipped)."""
    pairs = [(r["epoch"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [e for e, _ in pairs], [v for _, v in pairs]


def _line_figure(records: list[dict[str, Any]], keys: dict[str, str], ylabel: str) -> Any:
    """One axes with a line per key of ``keys`` ({metric key: legend label})."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for key, label in keys.items():
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, f"no {ylabel} recorded", ha="center", va="center",
                transform=ax.transAxes)
    elif len(keys) > 1:
        ax.legend()
    _epoch_axis(ax)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig


def _epoch_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_loss(records: list[dict[str, Any]]) -> Any:
    return _line_figure(records, {"loss": "training loss"}, "loss")


def _draw_accuracy(records: list[dict[str, Any]]) -> Any:
    """Validation and test accuracy, or ROC-AUC for a multi-label dataset's run."""
    if any("valid_rocauc" in r or "test_rocauc" in r for r in records):
        return _line_figure(records, {"valid_rocauc": "validation", "test_rocauc": "test"},
                            "ROC-AUC")
    return _line_figure(records, {"valid_acc": "validation", "test_acc": "test"}, "accuracy")


def _draw_throughput(records: list[dict[str, Any]]) -> Any:
    return _line_figure(records, {"seeds_per_s": "training seeds/s"}, "seeds per second")


def _overlapped(stage: str) -> bool:
    """Stages on the request path: prefetch overlaps them with training."""
    return stage.startswith("server_") or stage == "wire_s"


# Stages that are no host time of their own: loss_read_s is a part of forward_backward_s,
# h2d_copy_s the copies' time on the device's copy stream.
_NOT_STACKED = frozenset({"loss_read_s", "h2d_copy_s"})


def _draw_stages(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    names = sorted({k for r in records for k in r.get("stages_s", {})
                    if not k.endswith("total_s") and k not in _NOT_STACKED})
    fig, (own, path) = plt.subplots(1, 2, figsize=(11, 4))
    _stack(own, records, [n for n in names if not _overlapped(n)],
           "trainer stages (add up to the epoch)")
    _stack(path, records, [n for n in names if _overlapped(n)],
           "request path (overlapped by prefetch)")
    xs, ys = _series(records, "epoch_s")
    if xs:
        own.plot(xs, ys, color="black", marker="_", linestyle="none", markersize=14,
                 label="epoch_s")
        own.legend(fontsize=7)
    return fig


def _stack(ax: Any, records: list[dict[str, Any]], stages: list[str], title: str) -> None:
    """Stacked bars: one bar per epoch, one segment per stage."""
    epochs = [r["epoch"] for r in records]
    bottom = [0.0] * len(records)
    for stage in stages:
        values = [float(r.get("stages_s", {}).get(stage) or 0.0) for r in records]
        ax.bar(epochs, values, bottom=bottom, label=stage.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    if stages:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no stage times recorded", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_title(title, fontsize=9)
    _epoch_axis(ax)
    ax.set_ylabel("seconds")


if __name__ == "__main__":
    sys.exit(main())
