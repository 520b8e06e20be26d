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

from common.cli import run_main
from common.config import add_config_args, load_config
from common.errors import ConfigError
from common.jsonout import dumps_strict
from partition.config import PartitionConfig
from partition.outdir import PartitionError, check_out, describe_os_error

PROG = "partition-ogbn"
EPILOG = """examples:
  partition-ogbn --dataset-dir ../shared/datasets/cora --num-parts 2 --out parts/cora2
  partition-ogbn --dataset synthetic --num-nodes 200000 --num-parts 2 --out parts/syn
  partition-ogbn --dataset rmat --num-nodes 2100000 --avg-degree 28.6 --raw-out data/rmat
  partition-ogbn --dataset-dir data/rmat --num-parts 1 --out parts/rmat1
  partition-ogbn --dataset ogbn-arxiv --add-reverse-edges --num-parts 4 --out parts/arxiv4"""


class CliError(ConfigError):
    """An expected failure: printed without a traceback, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Partition an OGB node-property dataset (or any dataset in OGB's raw layout, csv "
            "or binary, or a generated graph: products-shaped 'synthetic' or skewed 'rmat') "
            "into the partition set that sampler servers load. Progress and a "
            "summary go to stderr; the last stdout line is a JSON summary."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p, PartitionConfig)
    return p


def _check_paths(cfg: PartitionConfig) -> None:
    """The checks of ``cfg`` that look at the filesystem (``validate`` did the rest)."""
    if cfg.dataset_dir:
        d = Path(cfg.dataset_dir)
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
    if cfg.out:
        try:
            check_out(Path(cfg.out), cfg.force)
        except PartitionError as e:
            raise CliError(str(e)) from e
    if cfg.synthetic.raw_out:
        r = Path(cfg.synthetic.raw_out)
        if r.exists() and not r.is_dir():
            raise CliError(f"--raw-out {r} exists and is not a directory; choose another path")
        if r.is_dir() and any(r.iterdir()):
            if not (r / "meta.json").is_file():
                raise CliError(
                    f"--raw-out {r} is not empty and not an OGB raw directory; choose an "
                    "empty or new directory"
                )
            if not cfg.force:
                raise CliError(f"--raw-out {r} already holds a dataset; pass --force to overwrite")


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


def _load(cfg: PartitionConfig, progress: bool):
    """The input graph: generated (``--dataset synthetic``) or loaded through ogb."""
    if cfg.dataset == "synthetic":
        from partition.synthetic import generate

        syn = cfg.synthetic.resolved()
        return generate(syn.num_nodes, avg_degree=syn.avg_degree, feat_dim=syn.feat_dim,
                        num_classes=syn.num_classes, seed=cfg.seed, homophily=syn.homophily,
                        train_frac=syn.train_frac, valid_frac=syn.valid_frac,
                        progress=progress)
    from partition.ogbn import load_ogb

    return load_ogb(name=cfg.dataset or None, root=cfg.root,
                    dataset_dir=cfg.dataset_dir or None,
                    add_reverse_edges=cfg.add_reverse_edges, work_dir=cfg.work_dir or None)


def _write_raw(data, raw_out: str, progress: bool) -> dict:
    from partition.synthetic import write_ogb_raw

    t = time.perf_counter()
    try:
        write_ogb_raw(data, raw_out, progress=progress)
    except OSError as e:
        raise CliError(describe_os_error(e, f"writing --raw-out {raw_out} failed")) from e
    took = round(time.perf_counter() - t, 3)
    print(f"{PROG}: wrote OGB raw layout to {raw_out} in {took:.1f} s (read it with "
          f"--dataset-dir {raw_out})", file=sys.stderr)
    return {"raw_out": str(Path(raw_out)), "raw_write_s": took}


def _partition(cfg: PartitionConfig, data, progress: bool, load_s: float, t0: float) -> dict:
    from partition.partitioner import partition_graph

    meta = partition_graph(data, cfg.num_parts, cfg.out, cfg.method, seed=cfg.seed,
                           progress=progress, overwrite=cfg.force, halo_hops=cfg.halo_hops,
                           presample_batches=cfg.presample_batches)
    for line in _summary_lines(meta, load_s, time.perf_counter() - t0):
        print(line, file=sys.stderr)
    st = meta.stats
    return dict(
        out=str(Path(cfg.out)), set_id=meta.set_id, num_parts=meta.num_parts,
        method=meta.method, feat_dim=meta.feat_dim, num_classes=meta.num_classes,
        edge_cut=meta.edge_cut, edge_cut_frac=round(st["edge_cut_frac"], 6),
        node_balance=round(st["node_balance"], 4), edge_balance=round(st["edge_balance"], 4),
        train_balance=round(st["train_balance"], 4), part_nodes=st["part_nodes"],
        part_edges=st["part_edges"], part_train=st["part_train"], halo_hops=meta.halo_hops,
        part_halo_nodes=st["part_halo_nodes"], part_halo_edges=st["part_halo_edges"],
        partition_s=st["elapsed_s"])


def _make_rmat(cfg: PartitionConfig, out_dir: str, progress: bool) -> dict:
    """Generate ``--dataset rmat`` and write it in OGB's binary layout to ``out_dir``."""
    from partition.rmat import generate_rmat, write_ogb_binary

    syn = cfg.synthetic.resolved("rmat")
    t = time.perf_counter()
    data = generate_rmat(syn.num_nodes, avg_degree=syn.avg_degree, feat_dim=syn.feat_dim,
                         num_classes=syn.num_classes, seed=cfg.seed, a=syn.rmat_a,
                         b=syn.rmat_b, c=syn.rmat_c, noise=syn.rmat_noise,
                         train_frac=syn.train_frac, valid_frac=syn.valid_frac,
                         progress=progress)
    gen_s = time.perf_counter() - t
    print(f"{PROG}: generated {data.name}: {data.num_nodes:,} nodes, {data.num_edges:,} "
          f"directed edges in {gen_s:.1f} s", file=sys.stderr)
    t = time.perf_counter()
    try:
        write_ogb_binary(data, out_dir, progress=progress)
    except OSError as e:
        raise CliError(describe_os_error(e, f"writing the OGB binary layout to {out_dir} "
                                            "failed")) from e
    took = time.perf_counter() - t
    print(f"{PROG}: wrote OGB binary layout to {out_dir} in {took:.1f} s", file=sys.stderr)
    return {"dataset": data.name, "generate_s": round(gen_s, 3), "raw_write_s": round(took, 3)}


def _run_rmat(cfg: PartitionConfig, progress: bool, t0: float) -> dict:
    """``--dataset rmat``: generate into ``--raw-out`` (or a temporary directory), then, with
    ``--out``, partition it read back through ogb exactly as ``--dataset-dir`` would."""
    import shutil
    import tempfile

    from partition.ogbn import load_ogb

    raw_dir = cfg.synthetic.raw_out
    tmp = None
    if not raw_dir:
        if cfg.work_dir:
            Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="mfgserve-rmat-", dir=cfg.work_dir or None)
        raw_dir = tmp
    try:
        result = _make_rmat(cfg, raw_dir, progress)
        if cfg.synthetic.raw_out:
            result["raw_out"] = str(Path(raw_dir))
            print(f"{PROG}: read it with --dataset-dir {raw_dir}", file=sys.stderr)
        if not cfg.out:
            return result
        t = time.perf_counter()
        data = load_ogb(dataset_dir=raw_dir, work_dir=cfg.work_dir or None)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    load_s = time.perf_counter() - t
    print(f"{PROG}: loaded {data.name} through ogb: {data.num_nodes:,} nodes, "
          f"{data.num_edges:,} directed edges in {load_s:.1f} s", file=sys.stderr)
    result.update(num_nodes=data.num_nodes, num_edges=data.num_edges, load_s=round(load_s, 3))
    result.update(_partition(cfg, data, progress, time.perf_counter() - t0, t0))
    return result


def _run(cfg: PartitionConfig) -> dict:
    from partition.partitioner import peak_rss_bytes

    t0 = time.perf_counter()
    progress = not cfg.no_progress
    if cfg.dataset == "rmat":
        result = _run_rmat(cfg, progress, t0)
    else:
        data = _load(cfg, progress)
        load_s = time.perf_counter() - t0
        print(f"{PROG}: loaded {data.name}: {data.num_nodes:,} nodes, {data.num_edges:,} "
              f"directed edges in {load_s:.1f} s", file=sys.stderr)
        result = {"dataset": data.name, "num_nodes": data.num_nodes,
                  "num_edges": data.num_edges, "load_s": round(load_s, 3)}
        if cfg.synthetic.raw_out:
            result.update(_write_raw(data, cfg.synthetic.raw_out, progress))
        if cfg.out:
            result.update(_partition(cfg, data, progress, load_s, t0))
    result["total_s"] = round(time.perf_counter() - t0, 3)
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``partition-ogbn``; returns (and, as a script, exits with) the status
    (errors mapped by :func:`common.cli.run_main`)."""
    return run_main(PROG, lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 with a usage message on malformed arguments
    cfg = load_config(PartitionConfig, None, args)
    _check_paths(cfg)
    try:
        with _stdout_to_stderr():
            result = _run(cfg)
    except MemoryError:
        raise CliError("out of memory; use a machine with more memory, or a smaller dataset "
                       "(--num-nodes / --avg-degree / --feat-dim for generated graphs)") from None
    except ImportError as e:  # e.g. METIS (DGL) unavailable
        raise CliError(str(e)) from e
    except FileExistsError as e:
        raise CliError(str(e)) from e
    except OSError as e:  # e.g. an unreadable dataset file or --work-dir
        raise CliError(describe_os_error(e, "a file operation failed")) from e
    print(dumps_strict(result, separators=(",", ":")), flush=True)
    return 0


def _script() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _script()
