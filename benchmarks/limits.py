"""This machine's limits and each data-path stage's distance from them (one core each).

Measured, in this order:

* **memory bandwidth**: ``numpy.copyto`` of a large float32 array (``--mem-mib``, default
  1024 MiB) into another, best of ``--repeats``; ``copy_gbps`` = 2 x bytes / seconds, read
  and write both counted (the STREAM "copy" convention; write-allocate traffic not counted),
  10^9 bytes. numpy copies in one thread, so this is one core's bandwidth.
* **gather**: the feature rows of real batches' input nodes (the MFGs' ``input_nodes``, as
  the server gathers them) copied out of the feature matrix. Ours: the server's own gather,
  :meth:`sampler_server.partition_store.PartitionStore.gather` on the memory-mapped part,
  into a preallocated output (as into a trainer's ring slot) and into a new tensor (as onto
  the wire); DGL's: ``torch.index_select`` (what ``dgl.backend.gather_row`` calls for the
  DataLoader's feature prefetch) on the in-memory feature tensor DGL's graph holds, a new
  tensor each batch as DGL allocates it; ``index_select_into_out`` is the same kernel into
  preallocated rows (so the gap between the two is allocation and first-touch page faults,
  not the copy). Figures
  are payload GB/s (rows x row bytes / s); ``traffic_gbps`` = 2 x payload (each byte read
  and written once, the copy convention), and ``of_copy`` = traffic / copy bandwidth.
* **sampling**, nanoseconds per sampled edge (min(in-degree, fanout) summed over the nodes
  of a hop), per hop on exactly the same node sets (the frontiers of real batches, fanouts
  applied seeds-first as an MFG is built): ours seeded (the default: ``sample_seed`` >= 0,
  :mod:`sampler_server.seeded_sampler` through ``PartitionStore.sample_neighbors``), ours
  unseeded (DGL's C++ sampler on the server's bipartite part graph, the
  :mod:`sampler_server.neighbor_sampler` path without a seed), and
  ``dgl.sampling.sample_neighbors`` on DGL's full graph. And whole MFGs: our
  :func:`sampler_server.neighbor_sampler.sample_mfg` (seeded / unseeded, relabel included)
  vs DGL's ``NeighborSampler.sample_blocks`` (``to_block`` included), per sampled edge.

Every stage runs with torch at one thread (the server sets ``torch.set_num_threads(1)``),
and its CPU time (process time, all threads) is reported next to wall time; the headline
figures use CPU time, so they are per core. ``distance`` states each stage against its
limit: gather traffic vs the copy bandwidth, our sampling vs DGL's (ratio > 1: ours costs
more per edge), and a per-batch budget (sampling at our ns/edge + gather at the copy
bandwidth) giving the seeds per core-second the data path could reach.

Run alone: ``python -m benchmarks.limits --parts DIR`` (a table on stderr, JSON as the last
stdout line); without ``--parts`` only the memory bandwidth. From ``benchmarks.run``:
:func:`run_step`. A multi-part set is measured on part 0 (frontier nodes of other parts are
left out of the per-hop figures; whole-MFG figures need a 1-part set).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.report import int_list

STEP = "limits"


class LimitsError(RuntimeError):
    """A measurement could not run (bad input is named with the option to change)."""


@contextlib.contextmanager
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(best wall seconds, CPU seconds of that run) of ``fn()`` over ``repeats`` runs."""
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if wall < best[0]:
            best = (wall, cpu)
    return best


# ------------------------------------------------------------------ memory
def memory_bandwidth(mib: int = 1024, repeats: int = 5) -> dict:
    """numpy copy of ``mib`` MiB (float32), best of ``repeats``; see the module docstring."""
    n = (mib << 20) // 4
    src = np.ones(n, dtype=np.float32)  # written: every page really mapped
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch of dst, not timed
    wall, cpu = _timed(lambda: np.copyto(dst, src), repeats)
    nbytes = src.nbytes
    return {"array_mib": mib, "repeats": repeats, "best_s": round(wall, 4),
            "copy_gbps": round(2 * nbytes / wall / 1e9, 2),
            "convention": "copy: 2 x array bytes (read + write) / best seconds, 10^9 B/s, "
                          "1 thread (numpy)",
            "cpu_s": round(cpu, 4)}


# ------------------------------------------------------------------ the workload
@dataclasses.dataclass
class Workload:
    """Real batches of one part: per batch the seeds, each hop's frontier and the input nodes
    of its MFG (seeded sampling, as the server does by default)."""

    seeds: list[torch.Tensor]
    frontiers: list[list[tuple[torch.Tensor, int]]]  # per batch: (nodes, fanout) per hop
    input_nodes: list[torch.Tensor]


def make_workload(store, fanouts: list[int], batch_size: int, num_batches: int,
                  seed: int) -> Workload:
    from sampler_server.neighbor_sampler import new_scratch, relabel

    train = store.seeds("train")
    if train.numel() == 0:
        raise LimitsError("part 0 has no training seeds; use a partition set with a train "
                          "split")
    g = torch.Generator().manual_seed(seed)
    perm = train[torch.randperm(train.numel(), generator=g)]
    scratch = new_scratch(store.meta.num_nodes)
    wl = Workload([], [], [])
    for i in range(num_batches):
        start = (i * batch_size) % max(perm.numel(), 1)
        seeds = perm[start:start + batch_size]
        nodes, hops = seeds, []
        for hop, fanout in enumerate(reversed(fanouts)):
            owned = nodes[store.is_local(nodes)]
            hops.append((owned, fanout))
            _, src = store.sample_neighbors(owned, fanout, seed * 7919 + i * 31 + hop)
            nodes, _ = relabel(nodes, src, scratch)
        wl.seeds.append(seeds)
        wl.frontiers.append(hops)
        wl.input_nodes.append(nodes)
    return wl


# ------------------------------------------------------------------ gather
def gather_bandwidth(store, dgl_feat: torch.Tensor | None, wl: Workload, repeats: int,
                     copy_gbps: float | None) -> dict:
    """Ours (PartitionStore.gather, into a preallocated slot and into a new tensor) vs
    torch.index_select on DGL's in-memory features, over every batch's input nodes."""
    ids = [n[store.is_local(n)] for n in wl.input_nodes]
    rows = sum(int(i.numel()) for i in ids)
    row_bytes = store.feat.shape[1] * store.feat.element_size()
    outs = [torch.empty((i.numel(), store.feat.shape[1]), dtype=store.feat.dtype) for i in ids]

    def ours_slot():
        for i, o in zip(ids, outs, strict=True):
            store.gather(i, True, False, out=o)

    def ours_new():
        for i in ids:
            store.gather(i, True, False)

    ways = {"ours_into_slot": ours_slot, "ours_new_tensor": ours_new}
    if dgl_feat is not None:
        ways["dgl_index_select"] = lambda: [torch.index_select(dgl_feat, 0, i) for i in ids]

        def into_out():  # the same kernel into preallocated rows: what allocation costs
            for i, o in zip(ids, outs, strict=True):
                torch.index_select(dgl_feat, 0, i, out=o)
        ways["index_select_into_out"] = into_out
    out: dict = {"batches": len(ids), "rows": rows, "row_bytes": row_bytes,
                 "payload_mb": round(rows * row_bytes / 1e6, 2), "torch_threads": 1,
                 "convention": "payload_gbps = rows x row bytes / s; traffic_gbps = 2 x "
                               "payload (read + write, as copy_gbps); of_copy = traffic / "
                               "copy bandwidth"}
    with _one_thread():
        for name, fn in ways.items():
            fn()  # warm: pages mapped, allocator primed
            wall, cpu = _timed(fn, repeats)
            payload = rows * row_bytes / wall / 1e9
            out[name] = {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                         "payload_gbps": round(payload, 3),
                         "traffic_gbps": round(2 * payload, 3),
                         "ns_per_row": round(wall / max(rows, 1) * 1e9, 1),
                         "of_copy": round(2 * payload / copy_gbps, 3) if copy_gbps else None}
    return out


# ------------------------------------------------------------------ sampling
def _hop_edges(wl: Workload, store) -> int:
    total = 0
    for hops in wl.frontiers:
        for nodes, fanout in hops:
            counts = store._expected_counts(store.graph, nodes - store.start, fanout)
            total += int(counts.sum())
    return total


def sampling_cost(store, dgl_g, wl: Workload, fanouts: list[int], repeats: int,
                  seed: int) -> dict:
    """ns per sampled edge per hop (same frontiers) and per whole MFG, ours vs DGL's."""
    from common.dgl_compat import import_dgl
    from sampler_server.neighbor_sampler import (
        DistributedNeighbors,
        Timings,
        new_scratch,
        sample_mfg,
    )

    dgl = import_dgl()
    edges = _hop_edges(wl, store)

    def ours(seeded: bool):
        def run():
            for b, hops in enumerate(wl.frontiers):
                for h, (nodes, fanout) in enumerate(hops):
                    store.sample_neighbors(nodes, fanout, (seed + b * 31 + h) if seeded else -1)
        return run

    ways = {"ours_seeded": ours(True), "ours_unseeded": ours(False)}
    if dgl_g is not None:
        def dgl_hops():
            for hops in wl.frontiers:
                for nodes, fanout in hops:
                    dgl.sampling.sample_neighbors(dgl_g, nodes, fanout)
        ways["dgl_sample_neighbors"] = dgl_hops
    out: dict = {"sampled_edges": edges, "batches": len(wl.frontiers), "torch_threads": 1,
                 "per_hop": {}, "mfg": {}}
    with _one_thread():
        for name, fn in ways.items():
            fn()
            wall, cpu = _timed(fn, repeats)
            out["per_hop"][name] = {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                                    "ns_per_edge_wall": round(wall / max(edges, 1) * 1e9, 2),
                                    "ns_per_edge_cpu": round(cpu / max(edges, 1) * 1e9, 2)}
        if store.meta.num_parts == 1:
            scratch = new_scratch(store.meta.num_nodes)
            mfg_edges = 0
            for s in wl.seeds:
                mfg = sample_mfg(s, fanouts, DistributedNeighbors(store, None, Timings(),
                                                                  scratch), seed)
                mfg_edges += sum(int(rel.indices.numel()) for layer in mfg.layers
                                 for rel in layer.rels)

            def ours_mfg(seeded: bool):
                def run():
                    for b, s in enumerate(wl.seeds):
                        sample_mfg(s, fanouts, DistributedNeighbors(store, None, Timings(),
                                                                    scratch),
                                   seed + b if seeded else -1)
                return run

            mways = {"ours_seeded": ours_mfg(True), "ours_unseeded": ours_mfg(False)}
            if dgl_g is not None:
                sampler = dgl.dataloading.NeighborSampler(list(fanouts))

                def dgl_mfg():
                    for s in wl.seeds:
                        sampler.sample_blocks(dgl_g, s)
                mways["dgl_sample_blocks"] = dgl_mfg
            out["mfg"]["sampled_edges"] = mfg_edges
            for name, fn in mways.items():
                fn()
                wall, cpu = _timed(fn, repeats)
                out["mfg"][name] = {
                    "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                    "ns_per_edge_wall": round(wall / max(mfg_edges, 1) * 1e9, 2),
                    "ns_per_edge_cpu": round(cpu / max(mfg_edges, 1) * 1e9, 2),
                    "seeds_per_cpu_s": round(sum(int(s.numel()) for s in wl.seeds)
                                             / max(cpu, 1e-9), 1)}
    return out


# ------------------------------------------------------------------ distance
def _get(d: dict, *path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def distance(mem: dict, gather: dict | None, samp: dict | None, wl: Workload | None,
             row_bytes: int | None) -> dict:
    """Each stage against its limit (see the module docstring)."""
    out: dict = {"copy_gbps": mem["copy_gbps"]}
    if gather:
        for k in ("ours_into_slot", "ours_new_tensor", "dgl_index_select",
                  "index_select_into_out"):
            if k in gather:
                out[f"gather_{k}_of_copy"] = gather[k]["of_copy"]
        out["gather_ours_vs_dgl"] = _ratio(_get(gather, "ours_into_slot", "payload_gbps"),
                                           _get(gather, "dgl_index_select", "payload_gbps"))
    if samp:
        dgl_hop = _get(samp, "per_hop", "dgl_sample_neighbors", "ns_per_edge_cpu")
        for k in ("ours_seeded", "ours_unseeded"):
            out[f"sample_{k}_vs_dgl"] = _ratio(_get(samp, "per_hop", k, "ns_per_edge_cpu"),
                                               dgl_hop)
            out[f"mfg_{k}_vs_dgl"] = _ratio(_get(samp, "mfg", k, "ns_per_edge_cpu"),
                                            _get(samp, "mfg", "dgl_sample_blocks",
                                                 "ns_per_edge_cpu"))
    if samp and wl is not None and row_bytes:
        n = len(wl.seeds)
        seeds = sum(int(s.numel()) for s in wl.seeds) / n
        rows = sum(int(i.numel()) for i in wl.input_nodes) / n
        edges = (_get(samp, "mfg", "sampled_edges") or samp["sampled_edges"]) / n
        ns = (_get(samp, "mfg", "ours_seeded", "ns_per_edge_cpu")
              or _get(samp, "per_hop", "ours_seeded", "ns_per_edge_cpu"))
        sample_s = edges * ns / 1e9 if ns else None
        gather_limit_s = 2 * rows * row_bytes / (mem["copy_gbps"] * 1e9)
        gather_ours_s = (rows * row_bytes / (gather["ours_into_slot"]["payload_gbps"] * 1e9)
                         if gather and "ours_into_slot" in gather else None)
        out["per_batch"] = {
            "seeds": round(seeds, 1), "input_rows": round(rows, 1),
            "sampled_edges": round(edges, 1),
            "sample_ms": round(sample_s * 1e3, 3) if sample_s else None,
            "gather_ms": round(gather_ours_s * 1e3, 3) if gather_ours_s else None,
            "gather_at_copy_bw_ms": round(gather_limit_s * 1e3, 3),
            "seeds_per_core_s_ours": (round(seeds / (sample_s + gather_ours_s), 1)
                                      if sample_s and gather_ours_s else None),
            "seeds_per_core_s_gather_at_bw": (round(seeds / (sample_s + gather_limit_s), 1)
                                              if sample_s else None),
        }
    return out


# ------------------------------------------------------------------ the step
@dataclasses.dataclass
class Settings:
    fanouts: list[int]
    batch_size: int
    num_batches: int = 4
    repeats: int = 3
    mem_mib: int = 1024
    mem_repeats: int = 5
    seed: int = 0
    dgl: bool = True

    @classmethod
    def from_args(cls, args) -> Settings:
        g = getattr
        return cls(fanouts=list(args.fanouts), batch_size=int(args.batch_size),
                   num_batches=int(g(args, "limits_batches", 4) or 4),
                   repeats=int(g(args, "limits_repeats", 3) or 3),
                   mem_mib=int(g(args, "mem_mib", 1024) or 1024),
                   seed=int(g(args, "seed", 0) or 0))


def measure(parts: str | Path | None, s: Settings, log=None) -> dict[str, dict]:
    """``{name: figures}``: limits-memory, and with ``parts`` limits-gather,
    limits-sampling, limits-distance."""
    def note(msg: str) -> None:
        if log is not None:
            log(msg)

    note(f"memory bandwidth: numpy copy of {s.mem_mib} MiB, best of {s.mem_repeats}")
    mem = memory_bandwidth(s.mem_mib, s.mem_repeats)
    results = {f"{STEP}-memory": mem}
    if parts is None:
        results[f"{STEP}-distance"] = distance(mem, None, None, None, None)
        return results
    from sampler_server.partition_store import PartitionStore

    store = PartitionStore(str(parts), 0, seed=s.seed)
    fg = None
    if s.dgl:
        from benchmarks.dgl_pipeline import load_full_graph

        note("loading the full graph for DGL")
        fg = load_full_graph(parts)
    note(f"workload: {s.num_batches} batches of {s.batch_size}, fanouts {s.fanouts}")
    with _one_thread():
        wl = make_workload(store, s.fanouts, s.batch_size, s.num_batches, s.seed)
    copy = mem["copy_gbps"]
    note("gather: ours vs torch.index_select")
    gather = gather_bandwidth(store, fg.g.ndata["feat"] if fg else None, wl, s.repeats, copy)
    note("sampling: ours (seeded, unseeded) vs dgl.sampling.sample_neighbors")
    samp = sampling_cost(store, fg.g if fg else None, wl, s.fanouts, s.repeats, s.seed)
    results.update({f"{STEP}-gather": gather, f"{STEP}-sampling": samp,
                    f"{STEP}-distance": distance(mem, gather, samp, wl, gather["row_bytes"])})
    del fg, store
    gc.collect()
    return results


def run_step(parts: Path, args) -> dict[str, dict]:
    """benchmarks.run's step: ``{"limits-memory", "limits-gather", "limits-sampling",
    "limits-distance"}``. ``args`` fields used: fanouts, batch_size, seed; optional:
    limits_batches (4), limits_repeats (3), mem_mib (1024)."""
    from benchmarks.report import logger

    return measure(parts, Settings.from_args(args), logger(STEP))


# ------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.limits",
        description="This machine's memory bandwidth (numpy copy), the feature gather's "
                    "bandwidth (ours vs torch.index_select) and sampling ns per sampled edge "
                    "(ours vs DGL's), one core each, and each stage's distance from its limit. "
                    "Table on stderr, JSON as the last stdout line.")
    p.add_argument("--parts", help="partition set directory (partition-ogbn); without it, only "
                   "the memory bandwidth is measured")
    p.add_argument("--fanouts", type=int_list, default=[15, 10, 5],
                   help="neighbours per layer, input layer first (default 15,10,5)")
    p.add_argument("--batch-size", type=int, default=1024, help="seeds per batch (1024)")
    p.add_argument("--num-batches", type=int, default=4,
                   help="batches whose frontiers and input nodes are measured (4)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed passes over those batches per measurement; best kept (3)")
    p.add_argument("--mem-mib", type=int, default=1024,
                   help="array size of the memory copy in MiB (1024; needs twice that free)")
    p.add_argument("--mem-repeats", type=int, default=5, help="memory copies; best kept (5)")
    p.add_argument("--no-dgl", action="store_true", help="skip DGL's figures")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--out", help="also write the JSON summary to this file")
    return p


def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table(summary: dict) -> None:
    r, err = summary["results"], sys.stderr
    mem = r[f"{STEP}-memory"]
    print(f"\nlimits (one core)\n  memory copy: {mem['copy_gbps']} GB/s ({mem['convention']})",
          file=err)
    g = r.get(f"{STEP}-gather")
    if g:
        print(f"  gather of {g['rows']} rows x {g['row_bytes']} B "
              "(payload GB/s | traffic GB/s | of copy bw):", file=err)
        for k in ("ours_into_slot", "ours_new_tensor", "dgl_index_select",
                  "index_select_into_out"):
            if k in g:
                v = g[k]
                print(f"    {k:<22}{_f(v['payload_gbps'], '.3f'):>9} |"
                      f"{_f(v['traffic_gbps'], '.3f'):>8} | {_f(v['of_copy'], '.1%')}",
                      file=err)
    s = r.get(f"{STEP}-sampling")
    if s:
        print(f"  sampling ns per sampled edge, CPU (per hop: {s['sampled_edges']} edges; "
              f"whole MFG: {s['mfg'].get('sampled_edges', '-')} edges):", file=err)
        for k in ("ours_seeded", "ours_unseeded", "dgl_sample_neighbors", "dgl_sample_blocks"):
            hop = _get(s, "per_hop", k, "ns_per_edge_cpu")
            mfg = _get(s, "mfg", k, "ns_per_edge_cpu")
            if hop is not None or mfg is not None:
                print(f"    {k:<22} per hop {_f(hop):>8}   whole MFG {_f(mfg):>8}", file=err)
    d = r.get(f"{STEP}-distance", {})
    print("  distance from the limit:", file=err)
    for k, v in d.items():
        if k != "per_batch":
            print(f"    {k:<40}{v}", file=err)
    for k, v in d.get("per_batch", {}).items():
        print(f"    per batch {k:<30}{v}", file=err)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("batch_size", "num_batches", "repeats", "mem_mib", "mem_repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not args.fanouts or any(f == 0 or f < -1 for f in args.fanouts):
        raise SystemExit("--fanouts: positive integers (or -1 for all), e.g. 15,10,5")
    if args.parts:
        from partition.layout import PartitionFormatError, PartitionSetMeta

        try:
            PartitionSetMeta.load(args.parts)
        except PartitionFormatError as e:
            raise SystemExit(f"--parts {args.parts}: {e}") from e
    from benchmarks.report import logger

    s = Settings(fanouts=args.fanouts, batch_size=args.batch_size,
                 num_batches=args.num_batches, repeats=args.repeats, mem_mib=args.mem_mib,
                 mem_repeats=args.mem_repeats, seed=args.seed, dgl=not args.no_dgl)
    results = measure(args.parts, s, logger(STEP))
    summary = {"config": {**dataclasses.asdict(s), "parts": args.parts,
                          "cores": os.cpu_count()}, "results": results}
    table(summary)
    line = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
