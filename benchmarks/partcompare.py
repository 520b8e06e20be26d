"""``python -m benchmarks.partcompare``: the same graph partitioned by several methods (METIS,
the streaming Fennel / LDG, random), and what each partitioning costs and buys end to end.

One products-shaped graph of ``--nodes`` nodes is generated in OGB's raw layout (a
subprocess: ``partition-ogbn --dataset synthetic --raw-out RAW``, see
:mod:`benchmarks.scalerun`); then, for each of ``--methods``:

1. ``partition``: ``partition-ogbn --dataset-dir RAW --add-reverse-edges --num-parts P
   --method M [--max-memory-gb G] --out PARTS`` (a subprocess with a timeout; its process
   tree polled with psutil): edge cut, balance (nodes, edges, training seeds; max / mean),
   wall and partition time, peak RSS (partition-ogbn's own getrusage figure and the polled
   one), partition set size.
2. ``train``: ``worker-mode`` on PARTS, once per ``--batch-locality`` (default both
   ``global`` and ``part``, the trainer's ``--batch-locality``), for ``--epochs`` epochs over
   the whole training split (or ``--train-batches`` batches' worth of it, the same nodes for
   every method and locality; one server per part, one trainer, fanouts ``--fanouts``, batch
   ``--batch-size``), evaluated once after the last epoch on ``--eval-seeds`` valid and test
   seeds picked by a hash of their original node id, so every run is evaluated on the same
   nodes (the servers serve one view of PARTS per method, shared by its localities:
   :func:`benchmarks.scalerun.make_view`). Figures: seeds/s, test / valid accuracy, bytes
   the trainer received, and the server-to-server traffic: ``server_to_server_bytes`` (reply
   bytes the servers received from their peers while serving the training batches; the
   trainer's summary sums them from every reply's timings, sampler_server/sample_worker.py)
   and ``server_to_server_requests`` (peer requests), each also per epoch and per batch;
   server RSS / PSS / CPU as in :mod:`benchmarks.scalerun`.

What the cut can change: a batch goes to a server of the part owning most of its seeds
(trainer_client/loader.py) and that server fetches from its peers what it does not hold
(neighbour lists of other parts' nodes, features of other parts' input nodes). With
``global`` batches (all training seeds shuffled together) ~1/P of a batch's seeds are the
server's own whatever the partitioning, so most of the batch's neighbourhood lies in the
other parts for every method: measured here (1,000,000 nodes, products' degree, 4 parts, 20
batches of 1024, fanouts 15,10,5), METIS / Fennel / random cut 18 % / 28 % / 75 % of the
edges and the servers received 2,775 / 2,760 / 2,808 MB from their peers, the same within
2 %. With ``part`` batches (one part's seeds per batch, DistDGL's trainer-local seeds) the
seeds are all the server's own and only the cut edges reach into other parts, so the
traffic follows the cut; docs/partitions.md has both side by side.

Output: progress and a table on stderr; the LAST stdout line is one JSON object::

    {"machine", "config", "command", "wall_s",
     "generate": {...as benchmarks.scalerun's},
     "methods": {"<method>": {"partition": {...as scalerun's} | null,
                              "train": {"<locality>": {...as scalerun's, plus
                                        "batch_locality",
                                        "server_to_server_bytes_per_epoch",
                                        "server_to_server_requests_per_epoch",
                                        "server_to_server_requests_per_batch",
                                        "bytes_received_per_epoch"  # training batches
                                        } | null}}},
     "comparison": {"baseline": "<first method that partitioned and trained>",
                    "<method>": {"edge_cut_frac", "edge_cut_vs_baseline", "node_balance",
                                 "train_balance", "partition_wall_s", "partition_s",
                                 "partition_peak_rss_bytes",
                                 "partition_peak_rss_polled_bytes",
                                 "<locality>": {"batches", "s2s_bytes_per_epoch",
                                                "s2s_bytes_per_batch",
                                                "s2s_requests_per_epoch",
                                                "s2s_requests_per_batch",
                                                "s2s_bytes_vs_baseline", "seeds_per_s",
                                                "seeds_per_s_vs_baseline", "test_acc",
                                                "test_acc_minus_baseline"}},
                    "part_vs_global": {"<method>": {"s2s_bytes", "s2s_requests",
                                                    "seeds_per_s"}}},  # ratios part/global
     "errors": {"<method>:<step>" | "generate": "message"}}

Every ``<locality>`` key is one of ``--batch-locality``'s, in its order; a training run that
failed is ``null`` and its error is ``errors["<method>:train:<locality>"]``.

Exit code 0 when every step ran, 1 when one failed (its error in ``errors``; the other
methods still run), 2 for bad options, 130 / 143 after SIGINT / SIGTERM (the running
step stopped, the summary of what ran printed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.report import command_line, emit_summary, ratio
from benchmarks.scalerun import (
    MachineInfo,
    _attempt,
    _f,
    _gb,
    _remove,
    add_graph_args,
    check_args,
    config_of,
    make_view,
    step_generate,
    step_partition,
    table,
    train_on_view,
    train_rows,
)
from common.cli import Interrupted, raise_on_signals

LOCALITIES = ("global", "part")  # the trainer's --batch-locality choices


def locality_list(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in LOCALITIES]
    if not vals or bad or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(
            f"expected distinct values among {','.join(LOCALITIES)}, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.partcompare",
        description="Partition one generated graph with each method and compare edge cut, "
                    "balance, partition time and peak memory, and worker-mode training runs "
                    "on each, one per batch locality (server-to-server bytes and requests "
                    "per epoch, seeds/s, accuracy). Every step is a subprocess with a "
                    "timeout. The last stdout line is a JSON summary; a table goes to stderr.")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the generated graph")
    p.add_argument("--methods", default="metis,fennel,random",
                   help="comma-separated partition-ogbn --method values (default "
                        "metis,fennel,random)")
    p.add_argument("--batch-locality", type=locality_list, default=list(LOCALITIES),
                   help="comma-separated trainer --batch-locality values, each trained on "
                        "every method's partitions with the same seeds (default global,part: "
                        "'global' batches mix every part's seeds, 'part' batches hold one "
                        "part's seeds)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs per run (3)")
    p.add_argument("--train-batches", type=int, default=0,
                   help="train on this many batches' worth of training seeds per epoch, the "
                        "same original nodes for every method (default 0: the whole split)")
    add_graph_args(p)
    return p


def per_epoch(train: dict) -> None:
    """Add the per-epoch (and per-batch request) traffic figures to a ``train`` entry."""
    e = train.get("epochs_done") or 1
    for k in ("server_to_server_bytes", "server_to_server_requests"):
        v = train.get(k)
        train[f"{k}_per_epoch"] = round(v / e) if v is not None else None
    v, b = train.get("server_to_server_requests"), train.get("batches")
    train["server_to_server_requests_per_batch"] = round(v / b, 2) if v is not None and b \
        else None
    v = train.get("train_bytes_received")  # training batches only (metrics.jsonl)
    train["bytes_received_per_epoch"] = round(v / e) if v is not None else None


def step_train_locality(args: argparse.Namespace, view: dict, work: Path, locality: str,
                        name: str) -> dict:
    """worker-mode on the method's view (:func:`benchmarks.scalerun.make_view`, made once
    per method so both localities train and evaluate on the same seeds) with the trainer's
    ``--batch-locality locality``; otherwise as :func:`benchmarks.scalerun.step_train`."""
    res = train_on_view(args, view, work, work / f"run-{locality}", epochs=args.epochs,
                        name=name, extra=("--batch-locality", locality))
    res["batch_locality"] = locality
    per_epoch(res)
    return res


def _loc_row(t: dict) -> dict:
    return {"batches": t.get("batches"),
            "s2s_bytes_per_epoch": t.get("server_to_server_bytes_per_epoch"),
            "s2s_bytes_per_batch": t.get("server_to_server_bytes_per_batch"),
            "s2s_requests_per_epoch": t.get("server_to_server_requests_per_epoch"),
            "s2s_requests_per_batch": t.get("server_to_server_requests_per_batch"),
            "seeds_per_s": t.get("seeds_per_s"), "test_acc": t.get("test_acc")}


def compare(methods: dict[str, dict], localities: list[str]) -> dict:
    """Every method against the first one that partitioned and trained (the baseline), per
    locality; and, per method, the ``part`` run against the ``global`` one."""
    done = [m for m, r in methods.items()
            if r.get("partition") and any((r.get("train") or {}).values())]
    out: dict = {"baseline": done[0] if done else None}
    base = methods[done[0]] if done else None
    pvg: dict = {}
    for m, r in methods.items():
        p, trains = r.get("partition") or {}, r.get("train") or {}
        row: dict = {"edge_cut_frac": p.get("edge_cut_frac"),
                     "node_balance": p.get("node_balance"),
                     "train_balance": p.get("train_balance"),
                     "partition_wall_s": p.get("wall_s"), "partition_s": p.get("partition_s"),
                     "partition_peak_rss_bytes": p.get("peak_rss_bytes"),
                     "partition_peak_rss_polled_bytes": p.get("peak_rss_polled_bytes")}
        if base is not None:
            row["edge_cut_vs_baseline"] = ratio(p.get("edge_cut"),
                                                base["partition"].get("edge_cut"))
        for loc in localities:
            t = trains.get(loc)
            if t is None:
                row[loc] = None
                continue
            lr = _loc_row(t)
            bt = (base["train"].get(loc) if base is not None else None) or {}
            if bt:
                lr["s2s_bytes_vs_baseline"] = ratio(lr["s2s_bytes_per_epoch"],
                                                    bt.get("server_to_server_bytes_per_epoch"))
                lr["seeds_per_s_vs_baseline"] = ratio(lr["seeds_per_s"], bt.get("seeds_per_s"))
                lr["test_acc_minus_baseline"] = (
                    round(lr["test_acc"] - bt["test_acc"], 4)
                    if lr["test_acc"] is not None and bt.get("test_acc") is not None
                    else None)
            row[loc] = lr
        out[m] = row
        g, pt = trains.get("global"), trains.get("part")
        if g and pt:
            pvg[m] = {"s2s_bytes": ratio(pt.get("server_to_server_bytes_per_epoch"),
                                         g.get("server_to_server_bytes_per_epoch")),
                      "s2s_requests": ratio(pt.get("server_to_server_requests_per_epoch"),
                                            g.get("server_to_server_requests_per_epoch")),
                      "seeds_per_s": ratio(pt.get("seeds_per_s"), g.get("seeds_per_s"))}
    out["part_vs_global"] = pvg
    return out


def print_table(summary: dict) -> None:
    c, g = summary["config"], summary.get("generate") or {}
    locs = c["batch_locality"]
    print(f"\npartition methods on one graph: {c['nodes']:,} nodes, avg degree "
          f"{c['avg_degree']:.4g}, {c['feat_dim']}-dim features, {c['parts']} parts, "
          f"{c['epochs']} epoch(s) of {c['train_batches'] or 'all'} batches of "
          f"{c['batch_size']}, fanouts {c['fanouts']}; generated in {_f(g.get('wall_s'))} s",
          file=sys.stderr)
    head = ["method", "cut %", "node bal", "train bal", "part s", "peak GiB own/polled"]
    for loc in locs:
        head += [f"{loc}: s2s MB/ep", "s2s req/ep", "seeds/s", "test acc"]
    rows = [tuple(head)]
    for m, r in summary["methods"].items():
        p, trains = r.get("partition") or {}, r.get("train") or {}
        row = [m, _f(100 * p["edge_cut_frac"] if "edge_cut_frac" in p else None, ".2f"),
               _f(p.get("node_balance"), ".3f"), _f(p.get("train_balance"), ".3f"),
               _f(p.get("wall_s")),
               f"{_gb(p.get('peak_rss_bytes'))}/{_gb(p.get('peak_rss_polled_bytes'))}"]
        for loc in locs:
            t = trains.get(loc) or {}
            s2s = t.get("server_to_server_bytes_per_epoch")
            row += [_f(s2s / 1e6 if s2s is not None else None, ",.1f"),
                    _f(t.get("server_to_server_requests_per_epoch"), ",d"),
                    _f(t.get("seeds_per_s")), _f(t.get("test_acc"), ".4f")]
        rows.append(tuple(row))
    print(table(rows), file=sys.stderr)
    runs = [(f"{m} {loc}", t) for m, r in summary["methods"].items()
            for loc, t in (r.get("train") or {}).items() if t]
    if runs:
        print(train_rows(runs), file=sys.stderr)
    for k, e in summary["errors"].items():
        print(f"FAILED {k}: {e.splitlines()[0][:300] if e else ''}", file=sys.stderr)
    print(file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or len(set(methods)) != len(methods):
        parser.error(f"--methods needs distinct method names, got {args.methods!r}")
    if args.nodes < 100 or args.epochs < 1:
        parser.error("--nodes must be >= 100 and --epochs >= 1")
    localities = args.batch_locality
    t_start = time.perf_counter()
    root = Path(args.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    info = MachineInfo()
    config = config_of(args, (
        "nodes", "methods", "batch_locality", "epochs", "train_batches", "avg_degree",
        "feat_dim", "num_classes", "train_frac", "valid_frac", "labeled_frac", "feat_dtype",
        "parts", "max_memory_gb", "batch_size", "fanouts", "eval_seeds", "server_workers",
        "no_shm_ring", "presample_batches", "stream_passes", "seed", "poll_s",
        "step_timeout_s", "train_timeout_s"))
    config["methods"] = methods
    errors: dict[str, str] = {}
    results: dict[str, dict] = {m: {"partition": None, "train": None} for m in methods}
    raw = root / f"raw-{args.nodes}n"
    gen = None
    code = 0
    raise_on_signals()
    try:
        gen = _attempt(errors, "generate", lambda: step_generate(args, args.nodes, raw))
        for m in methods if gen is not None else []:
            parts, work = root / f"parts-{m}-{args.parts}", root / f"work-{m}"
            try:
                results[m]["partition"] = _attempt(
                    errors, f"{m}:partition",
                    lambda m=m, parts=parts, work=work: step_partition(args, raw, parts, m,
                                                                        work))
                if results[m]["partition"] is None:
                    continue
                caps = {"train": args.train_batches * args.batch_size or None,
                        "valid": args.eval_seeds or None,
                        "test": args.eval_seeds or None}
                view = _attempt(errors, f"{m}:view",
                                lambda parts=parts, work=work, caps=caps: make_view(
                                    parts, work / "view", caps, salt=args.seed))
                if view is None:
                    continue
                results[m]["train"] = {}
                for loc in localities:
                    results[m]["train"][loc] = _attempt(
                        errors, f"{m}:train:{loc}",
                        lambda m=m, work=work, view=view, loc=loc: step_train_locality(
                            args, view, work, loc, name=f"train {m} {loc}"))
            finally:
                _remove(parts, args.keep)
                _remove(work, args.keep)
    except Interrupted as e:  # the running step was stopped, its files removed
        errors["interrupted"] = f"stopped by {e}; the runs after it did not run"
        code = 128 + e.signum
    finally:
        _remove(raw, args.keep)
    summary = {"machine": info.result(), "config": config, "generate": gen, "methods": results,
               "comparison": compare(results, localities), "errors": errors,
               "wall_s": round(time.perf_counter() - t_start, 1),
               "command": command_line("benchmarks.partcompare", argv)}
    emit_summary(summary, args.out, print_table)
    return code or (1 if errors else 0)


if __name__ == "__main__":
    sys.exit(main())
