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
2. ``train``: ``worker-mode`` on PARTS for ``--epochs`` epochs over the whole training split
   (or ``--train-batches`` batches' worth of it, the same nodes for every method; one server
   per part, one trainer, fanouts ``--fanouts``, batch ``--batch-size``),
   evaluated once after the last epoch on ``--eval-seeds`` valid and test seeds picked by a
   hash of their original node id, so every method is evaluated on the same nodes (the
   servers serve a view of PARTS: :func:`benchmarks.scalerun.make_view`). Figures:
   seeds/s, test / valid accuracy, bytes the trainer received, and the server-to-server
   traffic: ``server_to_server_bytes`` (reply bytes the servers received from their peers
   while serving the training batches; the trainer's summary sums them from every reply's
   timings, sampler_server/sample_worker.py) and ``server_to_server_requests`` (peer
   requests), each also per epoch; server RSS / PSS / CPU as in :mod:`benchmarks.scalerun`.

What the cut can change: a batch goes to a server of the part owning most of its seeds
(trainer_client/loader.py) and that server fetches from its peers what it does not hold
(neighbour lists of other parts' nodes, features of other parts' input nodes). Batches are
drawn from the whole, globally shuffled training split, so ~1/P of a batch's seeds are the
server's own whatever the partitioning, and most of the batch's neighbourhood lies in the
other parts. Measured here (1,000,000 nodes, products' degree, 4 parts, 20 batches of 1024,
fanouts 15,10,5): METIS / Fennel / random cut 18 % / 28 % / 75 % of the edges and the
servers received 2,775 / 2,760 / 2,808 MB from their peers, the same within 2 %. The cut
would pay where batches hold seeds of one part (DistDGL's trainer-local seeds).

Output: progress and a table on stderr; the LAST stdout line is one JSON object::

    {"machine", "config", "command", "wall_s",
     "generate": {...as benchmarks.scalerun's},
     "methods": {"<method>": {"partition": {...as scalerun's} | null,
                              "train": {...as scalerun's, plus
                                        "server_to_server_bytes_per_epoch",
                                        "server_to_server_requests_per_epoch",
                                        "bytes_received_per_epoch"  # training batches
                                        } | null}},
     "comparison": {"baseline": "<first method that ran>",
                    "<method>": {"edge_cut_frac", "edge_cut_vs_baseline",
                                 "s2s_bytes_per_epoch", "s2s_bytes_vs_baseline",
                                 "seeds_per_s", "seeds_per_s_vs_baseline", "test_acc",
                                 "test_acc_minus_baseline", "partition_wall_s",
                                 "partition_peak_rss_bytes"}},
     "errors": {"<method>:<step>" | "generate": "message"}}

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
    step_generate,
    step_partition,
    step_train,
    table,
    train_rows,
)
from common.cli import Interrupted, raise_on_signals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.partcompare",
        description="Partition one generated graph with each method and compare edge cut, "
                    "balance, partition time and peak memory, and a worker-mode training run "
                    "on each (server-to-server bytes per epoch, seeds/s, accuracy). Every "
                    "step is a subprocess with a timeout. The last stdout line is a JSON "
                    "summary; a table goes to stderr.")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the generated graph")
    p.add_argument("--methods", default="metis,fennel,random",
                   help="comma-separated partition-ogbn --method values (default "
                        "metis,fennel,random)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs per method (3)")
    p.add_argument("--train-batches", type=int, default=0,
                   help="train on this many batches' worth of training seeds per epoch, the "
                        "same original nodes for every method (default 0: the whole split)")
    add_graph_args(p)
    return p


def per_epoch(train: dict) -> None:
    """Add the per-epoch traffic figures to a ``train`` entry."""
    e = train.get("epochs_done") or 1
    for k in ("server_to_server_bytes", "server_to_server_requests"):
        v = train.get(k)
        train[f"{k}_per_epoch"] = round(v / e) if v is not None else None
    v = train.get("train_bytes_received")  # training batches only (metrics.jsonl)
    train["bytes_received_per_epoch"] = round(v / e) if v is not None else None


def compare(methods: dict[str, dict]) -> dict:
    """Every method against the first one that partitioned and trained (the baseline)."""
    done = [m for m, r in methods.items() if r.get("partition") and r.get("train")]
    out: dict = {"baseline": done[0] if done else None}
    base = methods[done[0]] if done else None
    for m, r in methods.items():
        p, t = r.get("partition") or {}, r.get("train") or {}
        row = {"edge_cut_frac": p.get("edge_cut_frac"), "node_balance": p.get("node_balance"),
               "train_balance": p.get("train_balance"), "partition_wall_s": p.get("wall_s"),
               "partition_peak_rss_bytes": p.get("peak_rss_bytes"),
               "s2s_bytes_per_epoch": t.get("server_to_server_bytes_per_epoch"),
               "s2s_requests_per_epoch": t.get("server_to_server_requests_per_epoch"),
               "seeds_per_s": t.get("seeds_per_s"), "test_acc": t.get("test_acc")}
        if base is not None:
            bp, bt = base["partition"], base["train"]
            row["edge_cut_vs_baseline"] = ratio(p.get("edge_cut"), bp.get("edge_cut"))
            row["s2s_bytes_vs_baseline"] = ratio(row["s2s_bytes_per_epoch"],
                                                 bt.get("server_to_server_bytes_per_epoch"))
            row["seeds_per_s_vs_baseline"] = ratio(row["seeds_per_s"], bt.get("seeds_per_s"))
            row["test_acc_minus_baseline"] = (
                round(row["test_acc"] - bt["test_acc"], 4)
                if row["test_acc"] is not None and bt.get("test_acc") is not None else None)
        out[m] = row
    return out


def print_table(summary: dict) -> None:
    c, g = summary["config"], summary.get("generate") or {}
    print(f"\npartition methods on one graph: {c['nodes']:,} nodes, avg degree "
          f"{c['avg_degree']:.4g}, {c['feat_dim']}-dim features, {c['parts']} parts, "
          f"{c['epochs']} epoch(s); generated in {_f(g.get('wall_s'))} s", file=sys.stderr)
    rows = [("method", "cut %", "node bal", "edge bal", "train bal", "part s", "peak GiB",
             "s2s MB/epoch", "s2s req/epoch", "seeds/s", "test acc")]
    for m, r in summary["methods"].items():
        p, t = r.get("partition") or {}, r.get("train") or {}
        s2s = t.get("server_to_server_bytes_per_epoch")
        rows.append((m, _f(100 * p["edge_cut_frac"] if "edge_cut_frac" in p else None, ".2f"),
                     _f(p.get("node_balance"), ".3f"), _f(p.get("edge_balance"), ".3f"),
                     _f(p.get("train_balance"), ".3f"), _f(p.get("wall_s")),
                     _gb(p.get("peak_rss_bytes")),
                     _f(s2s / 1e6 if s2s is not None else None, ",.1f"),
                     _f(t.get("server_to_server_requests_per_epoch"), ",d"),
                     _f(t.get("seeds_per_s")), _f(t.get("test_acc"), ".4f")))
    print(table(rows), file=sys.stderr)
    runs = [(m, r["train"]) for m, r in summary["methods"].items() if r.get("train")]
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
    t_start = time.perf_counter()
    root = Path(args.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    info = MachineInfo()
    config = config_of(args, (
        "nodes", "methods", "epochs", "train_batches", "avg_degree", "feat_dim", "num_classes", "train_frac",
        "valid_frac", "labeled_frac", "feat_dtype", "parts", "max_memory_gb", "batch_size",
        "fanouts", "eval_seeds", "server_workers", "no_shm_ring", "presample_batches",
        "stream_passes", "seed", "poll_s", "step_timeout_s", "train_timeout_s"))
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
                results[m]["train"] = _attempt(
                    errors, f"{m}:train",
                    lambda m=m, parts=parts, work=work, caps=caps: step_train(
                        args, parts, work, epochs=args.epochs, caps=caps, name=f"train {m}"))
                if results[m]["train"] is not None:
                    per_epoch(results[m]["train"])
            finally:
                _remove(parts, args.keep)
                _remove(work, args.keep)
    except Interrupted as e:  # the running step was stopped, its files removed
        errors["interrupted"] = f"stopped by {e}; the methods after it did not run"
        code = 128 + e.signum
    finally:
        _remove(raw, args.keep)
    summary = {"machine": info.result(), "config": config, "generate": gen, "methods": results,
               "comparison": compare(results), "errors": errors,
               "wall_s": round(time.perf_counter() - t_start, 1),
               "command": command_line("benchmarks.partcompare", argv)}
    emit_summary(summary, args.out, print_table)
    return code or (1 if errors else 0)


if __name__ == "__main__":
    sys.exit(main())
