"""``partition-ogbn``: turn an OGB dataset, an OGB-raw-layout directory or a synthetic graph
into a partition set (see ``docs/partitions.md``).

Progress and a human summary go to stderr; the last line on stdout is a one-line JSON
summary. Expected failures (bad arguments, missing or malformed files, METIS unavailable, an
unwritable or full ``--out``) exit with code 2 and a message naming what failed and what to
change, never a traceback. The set is written beside ``--out`` and renamed into place when
complete, so a failed run leaves nothing behind (see ``partition/outdir.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from common.jsonout import dumps_strict
from partition.graph_data import DatasetError
from partition.outdir import PartitionError, check_out, describe_os_error

PROG = "partition-ogbn"
EXIT_USAGE = 2
_SYNTH_DEFAULTS = {
    "num_nodes": 100_000,
    "avg_degree": 20.0,
    "feat_dim": 100,
    "num_classes": 47,
    "homophily": 0.8,
}


class CliError(Exception):
    """An expected failure: printed without a traceback, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Partition an OGB node-property dataset (or any dataset in OGB's raw layout, or a "
            "synthetic graph) into the partition set that sampler servers load. Progress and a "
            "summary go to stderr; the last stdout line is a JSON summary."
        ),
        epilog=(
            "examples:\n"
            "  partition-ogbn --dataset-dir ../shared/datasets/cora --num-parts 2 --out parts/cora2\n"
            "  partition-ogbn --dataset synthetic --num-nodes 200000 --num-parts 2 --out parts/syn\n"
            "  partition-ogbn --dataset ogbn-arxiv --add-reverse-edges --num-parts 4 --out parts/arxiv4"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--dataset",
        metavar="NAME",
        help="an OGB node-property dataset name (ogbn-arxiv, ogbn-products, ogbn-papers100M; "
        "downloaded into --root when missing), or 'synthetic' for a generated power-law graph. "
        "Exactly one of --dataset / --dataset-dir is required.",
    )
    src.add_argument(
        "--dataset-dir",
        metavar="DIR",
        help="a directory in OGB's raw layout (raw/*.csv.gz, split/, RELEASE_v1.txt, meta.json), "
        "e.g. ../shared/datasets/cora; it is only read, never written",
    )
    p.add_argument(
        "--root",
        metavar="DIR",
        default="./data/ogb",
        help="ogb download/cache directory for --dataset ogbn-* (default: %(default)s); "
        "offline, unzip the dataset to DIR/ogbn_<name>/ yourself",
    )
    p.add_argument(
        "--num-parts",
        type=int,
        default=1,
        metavar="N",
        help="number of partitions, >= 1 (default: %(default)s)",
    )
    p.add_argument(
        "--method",
        choices=["metis", "random"],
        default="metis",
        help="node assignment: 'metis' minimises the edge cut and balances nodes and training "
        "seeds (needs DGL with METIS; no silent fallback), 'random' deals nodes out evenly "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--halo-hops",
        type=int,
        default=0,
        metavar="K",
        help="also store, per part, the complete in-edges and features of other parts' nodes "
        "within K in-hops (0-3), so sampling hops 2..K+1 and their features need no "
        "server-to-server request when they stay inside the halo; costs the halo's size "
        "(default: %(default)s: the first hop is always local)",
    )
    p.add_argument(
        "--presample-batches",
        type=int,
        default=16,
        metavar="B",
        help="mini-batches of training seeds (fanouts 15,10,5, batch 1024) sampled to rank "
        "nodes by hotness for trainers' feature caches (hot_rank.npy); 0 skips it "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="output directory of the partition set; must be new or empty (required unless "
        "--raw-out is given). The set is written beside it and renamed into place when "
        "complete",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing partition set (or OGB raw directory for --raw-out) at the "
        "output path; only the set's own files are deleted, and a directory holding anything "
        "else is refused (default: refuse)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed for --method random and the synthetic generator (default: %(default)s)",
    )
    p.add_argument(
        "--add-reverse-edges",
        action="store_true",
        help="make a directed dataset (e.g. ogbn-arxiv) bidirected by adding every edge "
        "reversed; no-op for datasets ogb already stores with inverse edges (default: off)",
    )
    p.add_argument(
        "--work-dir",
        metavar="DIR",
        help="where ogb's temporary processing directory goes (default: --root for "
        "--dataset ogbn-*, the system temp dir for --dataset-dir)",
    )
    syn = p.add_argument_group("synthetic graph (--dataset synthetic)")
    syn.add_argument(
        "--num-nodes",
        type=int,
        metavar="N",
        help=f"number of nodes (default: {_SYNTH_DEFAULTS['num_nodes']})",
    )
    syn.add_argument(
        "--avg-degree",
        type=float,
        metavar="D",
        help="average number of directed edges per node, both directions of an undirected "
        f"edge counted (default: {_SYNTH_DEFAULTS['avg_degree']:g})",
    )
    syn.add_argument(
        "--feat-dim",
        type=int,
        metavar="D",
        help=f"node feature dimension (default: {_SYNTH_DEFAULTS['feat_dim']})",
    )
    syn.add_argument(
        "--num-classes",
        type=int,
        metavar="C",
        help=f"number of classes (default: {_SYNTH_DEFAULTS['num_classes']})",
    )
    syn.add_argument(
        "--homophily",
        type=float,
        metavar="H",
        help="fraction of edges joining nodes of the same class, in [0, 1] "
        f"(default: {_SYNTH_DEFAULTS['homophily']})",
    )
    syn.add_argument(
        "--raw-out",
        metavar="DIR",
        help="write the synthetic graph in OGB's raw layout to DIR (readable with "
        "--dataset-dir DIR); with --out as well, also partition it",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="hide progress bars (default: shown on stderr)",
    )
    return p


def _check_args(args: argparse.Namespace) -> None:
    synthetic = args.dataset == "synthetic"
    if args.num_parts < 1:
        raise CliError(f"--num-parts {args.num_parts}: the number of parts must be >= 1")
    given_synth = [k for k in _SYNTH_DEFAULTS if getattr(args, k) is not None]
    if given_synth and not synthetic:
        opts = ", ".join("--" + k.replace("_", "-") for k in given_synth)
        raise CliError(f"{opts} only apply to --dataset synthetic; remove them")
    if args.raw_out and not synthetic:
        raise CliError("--raw-out only applies to --dataset synthetic; remove it or use --out")
    if args.out is None and args.raw_out is None:
        raise CliError("--out DIR is required (the directory to write the partition set to)")
    if synthetic:
        for k, v in _SYNTH_DEFAULTS.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        if args.num_nodes < 2:
            raise CliError(f"--num-nodes {args.num_nodes}: a synthetic graph needs >= 2 nodes")
        if args.num_parts > args.num_nodes:
            raise CliError(
                f"--num-parts {args.num_parts} exceeds --num-nodes {args.num_nodes}; use fewer parts"
            )
        if not 0.0 <= args.homophily <= 1.0:
            raise CliError(f"--homophily {args.homophily} must be within [0, 1]")
        if args.avg_degree < 0 or args.feat_dim < 1 or args.num_classes < 1:
            raise CliError(
                "--avg-degree must be >= 0, --feat-dim and --num-classes >= 1 "
                f"(got {args.avg_degree:g}, {args.feat_dim}, {args.num_classes})"
            )
    elif args.dataset is not None and not args.dataset.startswith("ogbn-"):
        raise CliError(
            f"--dataset {args.dataset!r}: expected an ogbn-* name (e.g. ogbn-arxiv) or "
            "'synthetic'; for a local directory use --dataset-dir DIR"
        )
    if args.dataset_dir is not None:
        d = Path(args.dataset_dir)
        if not d.is_dir():
            raise CliError(
                f"--dataset-dir {d} does not exist; pass a directory in OGB raw layout "
                "(raw/, split/, meta.json), e.g. ../shared/datasets/cora"
            )
        if not (d / "meta.json").is_file():
            raise CliError(
                f"--dataset-dir {d} has no meta.json, so it is not in OGB raw layout; add one "
                "(see ../shared/datasets/cora/meta.json) or point at the right directory"
            )
    if args.out is not None:
        _check_out_dir(Path(args.out), args.force)
    if args.raw_out is not None:
        r = Path(args.raw_out)
        if r.exists() and not r.is_dir():
            raise CliError(f"--raw-out {r} exists and is not a directory; choose another path")
        if r.is_dir() and any(r.iterdir()):
            if not (r / "meta.json").is_file():
                raise CliError(
                    f"--raw-out {r} is not empty and not an OGB raw directory; choose an "
                    "empty or new directory"
                )
            if not args.force:
                raise CliError(f"--raw-out {r} already holds a dataset; pass --force to overwrite")


def _check_out_dir(out: Path, force: bool) -> None:
    try:
        check_out(out, force)
    except PartitionError as e:
        raise CliError(str(e)) from e


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send everything written to stdout (Python or C level) to stderr meanwhile."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _fmt_bytes(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _summary_lines(meta, load_s: float, total_s: float) -> list[str]:
    st = meta.stats
    lines = [
        f"{PROG}: {meta.dataset}: {meta.num_nodes:,} nodes, {meta.num_edges:,} directed edges, "
        f"{meta.feat_dim}-dim features, {meta.num_classes} classes -> {meta.num_parts} part(s) "
        f"({meta.method}), set_id {meta.set_id}",
        f"  {'part':>4} {'nodes':>12} {'edges':>14} {'train':>10} {'cut edges':>12} "
        f"{'halo nodes':>12} {'halo edges':>12}",
    ]
    for i, info in enumerate(meta.parts):
        lines.append(
            f"  {info.id:>4} {info.num_nodes:>12,} {info.num_edges:>14,} {info.num_train:>10,} "
            f"{st['part_edge_cut'][i]:>12,} {info.num_halo_nodes:>12,} {info.num_halo_edges:>12,}"
        )
    lines += [
        f"  edge cut: {meta.edge_cut:,} of {meta.num_edges:,} directed edges "
        f"({100 * st['edge_cut_frac']:.2f}%)",
        f"  balance (max/mean): nodes {st['node_balance']:.3f}, edges {st['edge_balance']:.3f}, "
        f"train seeds {st['train_balance']:.3f}",
        f"  time: load {load_s:.1f} s, partition {st['elapsed_s']:.1f} s (assign "
        f"{st['assign_s']:.1f}, relabel {st['relabel_s']:.1f}, write {st['write_s']:.1f}), "
        f"total {total_s:.1f} s; peak memory {_fmt_bytes(st['peak_rss_bytes'])}",
    ]
    return lines


def _run(args: argparse.Namespace) -> dict:
    from partition.partitioner import partition_graph, peak_rss_bytes

    t0 = time.perf_counter()
    progress = not args.no_progress
    if args.dataset == "synthetic":
        from partition.synthetic import generate, write_ogb_raw

        data = generate(
            args.num_nodes,
            avg_degree=args.avg_degree,
            feat_dim=args.feat_dim,
            num_classes=args.num_classes,
            seed=args.seed,
            homophily=args.homophily,
            progress=progress,
        )
    else:
        from partition.ogbn import load_ogb

        data = load_ogb(
            name=args.dataset,
            root=args.root,
            dataset_dir=args.dataset_dir,
            add_reverse_edges=args.add_reverse_edges,
            work_dir=args.work_dir,
        )
    load_s = time.perf_counter() - t0
    print(
        f"{PROG}: loaded {data.name}: {data.num_nodes:,} nodes, {data.num_edges:,} directed "
        f"edges in {load_s:.1f} s",
        file=sys.stderr,
    )
    result: dict = {
        "dataset": data.name,
        "num_nodes": data.num_nodes,
        "num_edges": data.num_edges,
        "load_s": round(load_s, 3),
    }
    if args.raw_out is not None:
        t = time.perf_counter()
        try:
            write_ogb_raw(data, args.raw_out, progress=progress)
        except OSError as e:
            raise CliError(describe_os_error(e, f"writing --raw-out {args.raw_out} failed")) from e
        result["raw_out"] = str(Path(args.raw_out))
        result["raw_write_s"] = round(time.perf_counter() - t, 3)
        print(
            f"{PROG}: wrote OGB raw layout to {args.raw_out} in {result['raw_write_s']:.1f} s "
            f"(read it with --dataset-dir {args.raw_out})",
            file=sys.stderr,
        )
    if args.out is not None:
        meta = partition_graph(
            data,
            args.num_parts,
            args.out,
            args.method,
            seed=args.seed,
            progress=progress,
            overwrite=args.force,
            halo_hops=args.halo_hops,
            presample_batches=args.presample_batches,
        )
        total_s = time.perf_counter() - t0
        for line in _summary_lines(meta, load_s, total_s):
            print(line, file=sys.stderr)
        st = meta.stats
        result.update(
            out=str(Path(args.out)),
            set_id=meta.set_id,
            num_parts=meta.num_parts,
            method=meta.method,
            feat_dim=meta.feat_dim,
            num_classes=meta.num_classes,
            edge_cut=meta.edge_cut,
            edge_cut_frac=round(st["edge_cut_frac"], 6),
            node_balance=round(st["node_balance"], 4),
            edge_balance=round(st["edge_balance"], 4),
            train_balance=round(st["train_balance"], 4),
            part_nodes=st["part_nodes"],
            part_edges=st["part_edges"],
            part_train=st["part_train"],
            halo_hops=meta.halo_hops,
            part_halo_nodes=st["part_halo_nodes"],
            part_halo_edges=st["part_halo_edges"],
            partition_s=st["elapsed_s"],
        )
    result["total_s"] = round(time.perf_counter() - t0, 3)
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``partition-ogbn``; returns (and, as a script, exits with) the status."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a usage message on malformed arguments
    try:
        _check_args(args)
        with _stdout_to_stderr():
            result = _run(args)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (DatasetError, FileExistsError, ImportError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        print(
            f"{PROG}: error: out of memory; use a machine with more memory, or a smaller "
            "dataset (--num-nodes / --avg-degree / --feat-dim for synthetic graphs)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except ValueError as e:  # PartitionError, PartitionFormatError
        from partition.layout import PartitionFormatError

        if isinstance(e, (PartitionError, PartitionFormatError)):
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise
    except OSError as e:  # e.g. an unreadable dataset file or --work-dir
        print(f"{PROG}: error: {describe_os_error(e, 'a file operation failed')}",
              file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    print(dumps_strict(result, separators=(",", ":")), flush=True)
    return 0


def _script() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _script()
