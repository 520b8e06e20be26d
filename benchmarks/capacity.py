"""``python -m benchmarks.capacity``: a capacity model for mfgserve, calibrated here.

Three steps (docs/scaling.md has the equations and the figures):

* ``measure --out FILE.json``: calibrate on a small generated products-shaped graph
  (:func:`partition.synthetic.generate`, written in OGB's binary layout and partitioned by
  ``partition-ogbn`` in subprocesses): per-layer shape of a sampled batch (destination nodes,
  sampled edges per destination, input nodes) and the effective population that fits the
  measured input-node count; one real sampler server's CPU-ms per batch (psutil, over the timed
  batches only) split into sampling and gathering; reply bytes per
  batch on the socket; server-to-server bytes and CPU with 2 parts; partition bytes per node
  and per edge (from the files); ``partition-ogbn`` wall time and peak RSS at several graph
  sizes, fitted as ``fixed + per edge + per feature byte`` for each method measured.
* ``predict --dataset ogbn-products|ogbn-papers100M|custom --servers K --trainers K
  --bandwidth-gbps B [--calibration FILE.json]``: memory per server, partitioning time and
  peak, bytes on the wire per epoch and the epoch time bound by sampling cores, network and
  GPU compute, and which bound binds. Without ``--calibration`` it reads
  ``benchmarks/calibration/default.json`` (measured on this repository's machine). The
  partitioning peak of the streaming methods comes from the pipeline's own memory plan
  (:func:`plan_peak`), not from a line fitted to small runs.
* ``check [--calibration FILE] --runs RUNS.json``: predicted vs measured for runs made here
  (``benchmarks.scalerun``'s JSON), error in %, flagged beyond 25 %.

Every step prints a table on stderr and one JSON object as the last stdout line. Bad input
(missing or malformed calibration, unknown dataset, impossible sizes) exits 2 with a message
naming the option to change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import REPO, command_line, int_list, logger, process_cpu_s
from common.errors import ConfigError

log = logger("capacity")

CALIBRATION_FORMAT = "mfgserve-capacity-calibration"
CALIBRATION_VERSION = 1

PRODUCTS_NODES = 2_449_029
PRODUCTS_EDGES = 61_859_140  # undirected; stored both ways: 123,718,280 directed
PRODUCTS_TRAIN = 196_615
PRODUCTS_AVG_DEGREE = 2 * PRODUCTS_EDGES / PRODUCTS_NODES

# Published sizes (OGB paper, Hu et al. 2020, and the ogb dataset pages). papers100M stores
# 1,615,685,872 directed citation edges once; partitioned with --add-reverse-edges (as mfgserve
# does), the graph holds both directions: 3,231,371,744 directed edges.
DATASETS = {
    "ogbn-products": {"nodes": PRODUCTS_NODES, "directed_edges": 2 * PRODUCTS_EDGES,
                      "feat_dim": 100, "train_nodes": PRODUCTS_TRAIN, "feat_bytes": 4},
    "ogbn-papers100M": {"nodes": 111_059_956, "directed_edges": 2 * 1_615_685_872,
                        "feat_dim": 128, "train_nodes": 1_207_179, "feat_bytes": 4},
}

# GPU step time assumed when --gpu-step-ms is not given. SALIENT (Kaler et al., "Accelerating
# Training and Inference of Graph Neural Networks with Fast Sampling and Pipelining", MLSys
# 2022, https://proceedings.mlsys.org/paper/2022/hash/35f4a8d465e6e1edc05f3d8ab658c551-Abstract.html):
# 3-layer GraphSAGE, fanouts (15,10,5), ogbn-papers100M, 2.0 s per epoch on 16 GPUs, an 8x
# parallel speedup over its single-GPU run, i.e. ~16 s per epoch on one GPU; assuming batches
# of 1024 seeds (not stated in the abstract), ceil(1,207,179 / 1024) = 1,179 batches:
# <= 13.6 ms per batch for the whole pipelined step. The model scales it by the batch's predicted input nodes relative to a
# papers100M batch (the step's work grows with the MFG).
GPU_REF = {"step_ms": 16.0 * 1000 / 1179, "dataset": "ogbn-papers100M", "batch_size": 1024,
           "fanouts": [15, 10, 5], "gpu": "one of 16 GPUs (single-GPU time = 8 x 2.0 s)",
           "source": "SALIENT, Kaler et al., MLSys 2022: papers100M GraphSAGE (15,10,5) "
                     "2.0 s/epoch on 16 GPUs, 8x over 1 GPU -> ~16 s/epoch / 1,179 batches"}

FLAG_PCT = 25.0
GIB = 1 << 30  # --max-memory-gb counts GiB, as partition-ogbn does


class CapacityError(ConfigError):
    """Bad input to the calculator: printed without a traceback, exit code 2."""


# ------------------------------------------------------------------------------ the model


def layer_walk(seeds: float, fanouts: list[int], phis: list[float], n_eff: float
               ) -> list[dict]:
    """Expected shape of one sampled batch, hop by hop from the seeds outwards.

    Hop h samples the in-neighbours of every node gathered so far (DGL's block convention:
    a layer's destination nodes are all nodes of the previous hop), ``phi_h`` edges per
    destination node on average (the fanout, less where degrees are smaller). New distinct
    nodes follow an occupancy law over an effective population ``n_eff``: after ``m``
    degree-biased draws ``n_eff * (1 - exp(-m / n_eff))`` distinct nodes are expected. The
    draws already made are recovered from the current count, so the seeds (distinct by
    construction) count as the draws that produce them. Returns, per hop (seed side first),
    ``{"fanout", "dst", "edges", "src"}``.
    """
    out = []
    nodes = float(seeds)
    for fanout, phi in zip(reversed(fanouts), reversed(phis), strict=True):
        dst = nodes
        edges = dst * phi
        frac = min(dst / n_eff, 1 - 1e-12)
        drawn = -n_eff * math.log1p(-frac)
        nodes = max(dst, n_eff * -math.expm1(-(drawn + edges) / n_eff))
        out.append({"fanout": fanout, "dst": dst, "edges": edges, "src": nodes})
    return out


def neff_of(sampling: dict, nodes: float) -> float:
    """The calibration's effective population for a graph of ``nodes`` nodes."""
    return sampling["neff_coef"] * nodes ** sampling["neff_exp"]


def fit_alpha(nodes: int, seeds: float, fanouts: list[int], phis: list[float],
              input_nodes: float) -> float:
    """The ``alpha = n_eff / nodes`` whose :func:`layer_walk` gives ``input_nodes``
    (bisection on log alpha; clamped to [1e-4, 1e3])."""
    lo, hi = math.log(1e-4), math.log(1e3)

    def final(a: float) -> float:
        return layer_walk(seeds, fanouts, phis, math.exp(a) * nodes)[-1]["src"]

    if final(hi) <= input_nodes:
        return math.exp(hi)
    if final(lo) >= input_nodes:
        return math.exp(lo)
    for _ in range(80):
        mid = (lo + hi) / 2
        if final(mid) < input_nodes:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


# E[max of K independent standard normals], K = 1..8 (for the seeds' majority part)
_MAX_NORMAL = (0.0, 0.5642, 0.8463, 1.0294, 1.1630, 1.2672, 1.3522, 1.4236)


def seed_share(num_parts: int, batch: float) -> float:
    """Expected share of a batch's seeds owned by the part that serves it. A trainer sends
    each batch to the part owning most of its seeds (trainer_client.loader); a shuffled batch
    of ``batch`` seeds spreads over the parts like a multinomial, whose largest count is about
    ``batch / K + sd * E[max of K normals]``."""
    k = num_parts
    if k <= 1:
        return 1.0
    z = _MAX_NORMAL[k - 1] if k <= len(_MAX_NORMAL) else math.sqrt(2 * math.log(k))
    sd = math.sqrt(batch * (1 / k) * (1 - 1 / k))
    return min(1.0, (batch / k + sd * z) / batch)


def locality(num_parts: int, cut: float, walk: list[dict], first: float = 1.0) -> list[float]:
    """Fraction of each hop's destination nodes owned by the part that serves the batch, then
    the fraction for the input nodes (last entry). ``first``: the share of the seeds it owns
    (1 when the seeds are all its own, as in ``measure``'s server run; :func:`seed_share` for a
    trainer's shuffled batches).

    A new node reached over an edge from a local node is local with probability ``1 - cut``,
    from a remote node with ``cut / (K - 1)`` (the cut spread evenly over the other parts).
    Random assignment has ``cut = (K - 1) / K``: every node after the seeds is local with
    probability 1/K; with seeds spread evenly (``first = 1/K``) so is every node, whatever
    the cut."""
    if num_parts <= 1:
        return [1.0] * (len(walk) + 1)
    total = float(walk[0]["dst"])
    local = first * total
    fracs = []
    for hop in walk:
        p = local / total if total else 1.0
        fracs.append(p)
        new = max(hop["src"] - hop["dst"], 0.0)
        p_new = p * (1 - cut) + (1 - p) * cut / (num_parts - 1)
        local += new * p_new
        total += new
    fracs.append(local / total if total else 1.0)
    return fracs


def reply_bytes(walk: list[dict], seeds: float, feat_dim: int, feat_bytes: int) -> float:
    """Bytes of one MFG reply as the codec sends it: input node ids and features, per layer a
    CSC (indptr over destinations, int64 source positions), seed ids and labels (int64)."""
    input_nodes = walk[-1]["src"]
    csc = sum(8 * (h["dst"] + 1) + 8 * h["edges"] for h in walk)
    return input_nodes * (8 + feat_dim * feat_bytes) + csc + 16 * seeds


def remote_bytes(walk: list[dict], fracs: list[float], feat_dim: int, feat_bytes: int
                 ) -> float:
    """Server-to-server bytes of one batch, the answers' direction (what the asking server
    receives; the requests carry 8 bytes per remote node, a few percent of this): per hop the
    remote destination nodes' sampled neighbours (a count per node, an id per edge), then the
    remote input nodes' features."""
    b = 0.0
    for hop, p in zip(walk, fracs, strict=False):
        b += (1 - p) * (hop["dst"] * 8 + hop["edges"] * 8)
    return b + (1 - fracs[-1]) * walk[-1]["src"] * feat_dim * feat_bytes


def fit_linear(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares of ``ys`` on ``rows`` (scipy's NNLS): no negative cost per
    edge or byte from noise on a few small runs."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.asarray(rows, dtype=float)
    y = np.asarray(ys, dtype=float)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns of very different size
    coef, _ = nnls(a / scale, y)
    return [float(c) for c in coef / scale]


def _target(args: argparse.Namespace) -> dict:
    """The graph to predict for: a named dataset's published sizes, or --nodes ... (custom);
    explicit options override the named dataset's figures."""
    if args.dataset in DATASETS:
        t = dict(DATASETS[args.dataset])
    elif args.dataset == "custom":
        missing = [f"--{k.replace('_', '-')}" for k in ("nodes", "edges", "feat_dim",
                                                        "train_nodes")
                   if getattr(args, k) is None]
        if missing:
            raise CapacityError(f"--dataset custom needs {', '.join(missing)} (the graph's "
                                "size); or choose --dataset ogbn-products / ogbn-papers100M")
        t = {"feat_bytes": 4}
    else:
        raise CapacityError(f"--dataset {args.dataset!r} is unknown; choose one of "
                            f"{', '.join([*DATASETS, 'custom'])} (custom needs --nodes, "
                            "--edges, --feat-dim, --train-nodes)")
    if args.nodes is not None:
        t["nodes"] = args.nodes
    if args.edges is not None:  # undirected edges; the partitions store both directions
        t["directed_edges"] = 2 * args.edges
    if args.feat_dim is not None:
        t["feat_dim"] = args.feat_dim
    if args.train_nodes is not None:
        t["train_nodes"] = args.train_nodes
    if args.feat_dtype:
        t["feat_bytes"] = 2 if args.feat_dtype == "float16" else 4
    t["dataset"] = args.dataset
    if t["nodes"] < 2 or t["directed_edges"] < 0 or t["feat_dim"] < 1 \
            or not 0 < t["train_nodes"] <= t["nodes"]:
        raise CapacityError(f"impossible graph: {t['nodes']} nodes, {t['directed_edges']} "
                            f"directed edges, {t['feat_dim']}-dim features, "
                            f"{t['train_nodes']} training nodes; fix --nodes / --edges / "
                            "--feat-dim / --train-nodes")
    return t


def partition_fit(cal: dict, method: str) -> tuple[str, dict]:
    """The fitted partitioning costs of ``method`` in the calibration, else of the method
    measured (fennel preferred, then random) with a note saying so."""
    fits = cal["partition"]["fit"]
    if method in fits:
        return method, fits[method]
    for m in ("fennel", "random"):
        if m in fits:
            return m, fits[m]
    raise CapacityError(f"the calibration has no partitioning fit (methods: {sorted(fits)}); "
                        "re-run `python -m benchmarks.capacity measure`")


def predict(cal: dict, t: dict, *, servers: int, trainers: int, bandwidth_gbps: float,
            gpu_step_ms: float | None = None, server_cores: int = 16, method: str = "fennel",
            edge_cut: float | None = None, max_memory_gb: float | None = None,
            input_nodes: float | None = None, server_threads: int | None = None,
            shm_ring: bool = False, inflight: int | None = None,
            batches_by_part: bool = False) -> dict:
    """Every predicted figure for graph ``t`` (nodes, directed_edges, feat_dim, feat_bytes,
    train_nodes) on ``servers`` server nodes and ``trainers`` trainer nodes; see
    docs/scaling.md for the equations. ``shm_ring``: trainers share the servers' node and
    take features through the shared-memory ring (worker mode), so a reply's socket bytes and
    encoding leave the features out. ``batches_by_part``: every batch holds seeds of one part
    only (not what trainer_client.loader does today: it shuffles all seeds and sends a batch to
    the part owning most of them), so the partition's edge cut sets the remote share."""
    if servers < 1 or trainers < 1:
        raise CapacityError("--servers and --trainers must be >= 1")
    if bandwidth_gbps <= 0:
        raise CapacityError(f"--bandwidth-gbps {bandwidth_gbps:g} must be > 0 (Gbit/s per "
                            "node, e.g. 10 or 100)")
    if server_cores < 1:
        raise CapacityError("--server-cores must be >= 1")
    s = cal["sampling"]
    n, e, d, fb = t["nodes"], t["directed_edges"], t["feat_dim"], t["feat_bytes"]
    k = servers
    b = s["batch_size"]
    fanouts, phis = s["fanouts"], s["phi"]
    seeds = min(b, t["train_nodes"])
    walk = layer_walk(seeds, fanouts, phis, neff_of(s, n))
    if input_nodes is not None:  # a measured figure given: rescale the walk to it
        walk = layer_walk(seeds, fanouts, phis,
                          fit_alpha(n, seeds, fanouts, phis, input_nodes) * n)
    cut_used = edge_cut if edge_cut is not None else (
        (k - 1) / k if method == "random" else cal.get("cut_by_parts", {}).get(
            str(k), (k - 1) / k))
    if not 0 <= cut_used <= 1:
        raise CapacityError(f"--edge-cut {cut_used:g} must be within [0, 1]")
    fracs = locality(k, cut_used, walk, 1.0 if batches_by_part else seed_share(k, seeds))
    in_nodes = walk[-1]["src"]
    edges = sum(h["edges"] for h in walk)
    feat_bytes_batch = in_nodes * d * fb
    reply = reply_bytes(walk, seeds, d, fb) * s["reply_overhead"]
    if shm_ring:
        reply = max(reply - feat_bytes_batch, 0.0)
    remote = remote_bytes(walk, fracs, d, fb) * s.get("remote_overhead", 1.0)

    # memory: a server maps its part; anonymous memory = fixed + relabel scratch + batches
    pb = cal["partition"]["bytes"]
    part_node_bytes = pb["per_node_nonfeat"] + d * fb
    graph = n * part_node_bytes + e * pb["per_edge"]
    m = cal["server_memory"]
    threads = server_threads or m["threads"]
    scratch = threads * 4 * n
    # per batch in flight: its gathered features, its encoded reply and what peers sent it
    work = (inflight or m["inflight"]) * (feat_bytes_batch + reply + remote)
    server_mem = graph / k + m["fixed_anon_bytes"] + scratch + work

    # partitioning: time from the fit; peak from the streaming pipeline's own plan
    pm, pf = partition_fit(cal, method)
    feat_total = n * d * fb
    work_bytes = 16 * e + feat_total
    part_cpu_s = pf["time"][0] + pf["time"][1] * work_bytes
    # wall on a node of its own: the pipeline is one thread of numpy and file I/O, so its
    # CPU time is its wall time less I/O waits. The calibration's wall fit also carries the
    # waits for a core of that moment on this shared machine (shown, not predicted)
    wall_fit = pf.get("time_wall") or pf["time"]
    part_wall_load_s = wall_fit[0] + wall_fit[1] * work_bytes
    part_wall_s = part_cpu_s
    budget = max_memory_gb * GIB if max_memory_gb else None
    min_need = _min_budget(method if method in _STREAM else pm, n, e, d, fb, k)
    phases = None
    if method in _STREAM and _memplan() is not None:
        phases = plan_peak(method, n, e, d, fb, k, int(budget) if budget else None,
                           *plan_params(cal))
        part_peak = phases["peak"]
    else:  # metis (in memory), or no partition.memplan here: the fitted line
        cap_e = pf.get("edge_chunk_cap", float("inf"))
        part_peak = pf["peak"][0] + pf["peak"][1] * min(e, cap_e) + pf["peak"][2] * e
        if min_need is not None and part_peak < min_need:
            part_peak = float(min_need)  # never below what partition.memplan says it needs

    # epoch
    batches = math.ceil(t["train_nodes"] / b)
    per_trainer = math.ceil(batches / trainers)
    c = cal["server_cpu"]
    # server-to-server: each peer holding some of a hop's frontier gets a request per hop
    requests = (k - 1) * c.get("remote_requests_per_peer", 0.0) if remote > 0 else 0.0
    ring = c.get("ring") if shm_ring else None
    if ring:  # worker mode: the ring's own calibration (features written, not encoded)
        cpu_ms = (ring["ms_per_sampled_edge"] * edges
                  + ring["ms_per_feature_byte"] * feat_bytes_batch
                  + ring["ms_per_remote_byte"] * remote)
    else:
        cpu_ms = (c["ms_per_sampled_edge"] * edges
                  + c["ms_per_feature_byte"] * feat_bytes_batch
                  + c["ms_per_reply_byte"] * reply + c["ms_per_remote_byte"] * remote
                  + c.get("ms_per_remote_request", 0.0) * requests)
    sampling_s = batches * cpu_ms / 1000 / (k * server_cores)
    link = bandwidth_gbps * 1e9 / 8
    server_out = batches / k * (reply + remote)  # replies to trainers + answers to peers
    trainer_in = per_trainer * reply
    network_s = max(server_out, trainer_in) / link
    gpu = gpu_step_ms if gpu_step_ms is not None else None
    gpu_source = "--gpu-step-ms (given)"
    if gpu is None:
        ref = cal.get("gpu_ref_input_nodes")
        gpu = GPU_REF["step_ms"] * (in_nodes / ref if ref else 1.0)
        gpu_source = (f"{GPU_REF['source']}; scaled by input nodes {in_nodes:,.0f} / "
                      f"{ref:,.0f} (predicted papers100M batch)" if ref else GPU_REF["source"])
    gpu_s = per_trainer * gpu / 1000
    bounds = {"sampling_cores": sampling_s, "network": network_s, "gpu": gpu_s}
    binds = max(bounds, key=bounds.get)  # type: ignore[arg-type]
    return {
        "dataset": t["dataset"], "nodes": n, "directed_edges": e, "feat_dim": d,
        "feat_bytes": fb, "train_nodes": t["train_nodes"], "servers": k, "trainers": trainers,
        "bandwidth_gbps": bandwidth_gbps, "server_cores": server_cores, "shm_ring": shm_ring,
        "batch_size": b, "fanouts": fanouts,
        "batch": {"input_nodes": round(in_nodes), "sampled_edges": round(edges),
                  "layers": [{kk: round(v) for kk, v in h.items()} for h in walk],
                  "reply_bytes": round(reply), "remote_bytes": round(remote),
                  "local_fraction": [round(f, 4) for f in fracs],
                  "server_cpu_ms": round(cpu_ms, 2),
                  "server_cpu_model": "ring (worker mode)" if ring else "socket"},
        "edge_cut": round(cut_used, 4), "batches_by_part": batches_by_part,
        "graph_bytes": round(graph), "server_memory_bytes": round(server_mem),
        "server_memory_parts": {"part_files": round(graph / k),
                                "fixed_anon": round(m["fixed_anon_bytes"]),
                                "relabel_scratch": round(scratch),
                                "batches_in_flight": round(work)},
        "partition": {"method": pm, "method_asked": method,
                      # CPU: the pipeline's work, its wall time on a node of its own (plus
                      # file I/O waits); wall at the calibration's load: as the calibration
                      # runs met this shared machine
                      "cpu_s": round(part_cpu_s, 1), "wall_s": round(part_wall_s, 1),
                      "wall_s_at_calibration_load": round(part_wall_load_s, 1),
                      "input_bytes": round(work_bytes),
                      "peak_rss_bytes": round(part_peak),
                      "max_memory_bytes": round(budget) if budget else None,
                      "fits_budget": None if budget is None else part_peak <= budget,
                      "min_budget_bytes": min_need,
                      "peak_model": "plan" if phases else "fit",
                      "peak_phases": phases["phases"] if phases else None,
                      "peak_phase": phases["phase"] if phases else None},
        "epoch": {"batches": batches, "batches_per_trainer": per_trainer,
                  "wire_bytes": round(batches * (reply + remote)),
                  "reply_bytes": round(batches * reply),
                  "server_to_server_bytes": round(batches * remote),
                  "bounds_s": {kk: round(v, 2) for kk, v in bounds.items()},
                  "time_s": round(bounds[binds], 2), "binds": binds,
                  "gpu_step_ms": round(gpu, 2), "gpu_step_source": gpu_source},
    }


_STREAM = ("random", "fennel", "ldg")


def _memplan():
    """partition.memplan where this checkout has it (the streaming pipeline's plan)."""
    try:
        from partition import memplan
    except ImportError:
        return None
    return memplan


def plan_peak(method: str, n: int, e: int, d: int, fb: int, k: int,
              budget_bytes: int | None, base_bytes: float, chunk_factor: float = 1.0) -> dict:
    """Peak RSS of ``partition-ogbn --method {random,fennel,ldg} --max-memory-gb`` from the
    streaming pipeline's own plan: the largest, over its phases, of ``base_bytes`` (the
    interpreter and libraries, calibrated) + the per-node arrays live in that phase + that
    phase's buffers, sized for this graph and budget by the pipeline's planning functions
    (:func:`partition.memplan.stream_plan`, :func:`partition.streamassign._num_buckets`,
    imported, not copied). ``e``: directed edges (each stored edge and its reverse).
    ``chunk_factor`` scales memplan's bytes per edge-chunk row (its planning figure, an upper
    bound: not every temporary it counts is alive at once); it and ``base_bytes`` are
    calibrated on small runs (:func:`fit_plan`).

    Phases (docs/scaling.md, "Partitioning peak"):

    * ``assign: bucket edges`` (fennel / ldg): the assigner appends every edge key to the
      bucket files of its source range; its write buffers (an eighth of what its budget
      leaves beyond its node arrays) hold up to ``min(8 e, buffers)`` bytes, and a bucket
      that fills is concatenated into one block before it is written (a second copy of one
      bucket's buffer). Either one edge chunk's temporaries are alive beside the buffers
      (mid-stream) or the concatenated copy (the flush).
    * ``assign: passes``: the part array and seed mask (9 bytes per node) and one group of
      consecutive buckets of sorted edge keys (up to half of the assigner's budget).
    * ``bucket by part`` / ``sort parts`` / ``write rows``: the pipeline's per-node arrays
      (``memplan.STREAM_BYTES_PER_NODE``) with one edge chunk and the part buckets' write
      buffers, then the largest part's keys (capped by the plan's sort budget), then one
      feature chunk and its reordered copy.
    """
    mp = _memplan()
    if mp is None:
        raise CapacityError("partition.memplan is not importable here: no plan to model")
    n, e, d, fb, k = int(n), int(e), int(d), int(fb), max(1, int(k))
    plan = mp.stream_plan(method, n, e, d, fb, k, budget_bytes)
    stored = -(-e // 2)  # stored edges; each chunk of them is streamed with its reverses
    chunk = chunk_factor * mp.EDGE_CHUNK_BYTES_PER_ROW * min(plan.edge_rows, stored)
    key_bytes = 8 * e
    nodes = mp.STREAM_BYTES_PER_NODE * n
    phases = {}
    if method == "random":
        phases["assign: random"] = mp.RANDOM_ASSIGN_BYTES_PER_NODE * n + n
    elif k > 1:
        from partition import streamassign as sa

        rest = int(plan.assign_budget_bytes) - sa._NODE_BYTES * n
        group_bytes = rest // 2
        nb = sa._num_buckets(n, e, group_bytes)
        block = sa.auto_block_nodes(n)
        span = sa._ceil_div(sa._ceil_div(n, nb), block) * block  # whole blocks, as it does
        nb = sa._ceil_div(n, span)
        per_bucket = key_bytes / nb
        buf = max(rest // 8, 1 << 20)
        cap_b = 8 * max(4096, buf // (8 * nb))  # one bucket's buffer, as BucketFiles sizes it
        buffered = min(key_bytes, nb * cap_b)
        flush_copy = min(per_bucket, cap_b)
        phases["assign: bucket edges"] = n + buffered + max(chunk, flush_copy)
        per_group = max(1, min(nb, int((group_bytes // 8) // max(per_bucket / 8, 1))))
        block_tmp = sa._BLOCK_EDGE * block * e / max(n, 1)
        phases["assign: passes"] = n + sa._NODE_BYTES * n + per_group * per_bucket + block_tmp
    part_buf = 8 * max(4096, plan.bucket_buffer_bytes // (8 * k))
    phases["bucket by part"] = (nodes + chunk + min(key_bytes, k * part_buf)
                                + min(key_bytes / k, part_buf))
    eps = 0.05
    if method in ("fennel", "ldg"):
        from partition.streamassign import DEFAULT_EPSILON as eps
    part_keys = min(key_bytes / k * (1 + eps) if k > 1 else key_bytes, plan.sort_bytes)
    phases["sort parts"] = nodes + part_keys + 2 * 8 * n / k * (1 + eps)
    phases["write rows"] = nodes + 3 * plan.feat_rows * d * max(fb, 4)
    phases = {name: float(base_bytes + v) for name, v in phases.items()}
    phase = max(phases, key=phases.get)  # type: ignore[arg-type]
    return {"peak": phases[phase], "phase": phase, "phases": phases,
            "base_bytes": float(base_bytes), "chunk_factor": float(chunk_factor),
            "plan": {"edge_rows": plan.edge_rows, "sort_bytes": plan.sort_bytes,
                     "bucket_buffer_bytes": plan.bucket_buffer_bytes,
                     "assign_budget_bytes": plan.assign_budget_bytes}}


def _plan_runs(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r.get("method") in _STREAM and r.get("peak_rss_bytes")
            and r.get("nodes") and r.get("directed_edges") and r.get("feat_dim")]


def _plan_run_peak(r: dict, base: float, factor: float) -> float:
    gb = r.get("max_memory_gb")
    return plan_peak(r["method"], r["nodes"], r["directed_edges"], r["feat_dim"],
                     int(r.get("feat_bytes") or 4), int(r.get("num_parts") or 1),
                     int(gb * GIB) if gb else None, base, factor)["peak"]


def fit_plan(runs: list[dict]) -> dict | None:
    """The two calibrated terms of :func:`plan_peak` from partition runs made for the
    calibration (never the runs being checked): ``chunk_factor`` on a grid of 0.2..1.2 and,
    for each, ``base_bytes`` = the median of measured peak less the plan's figure; the pair
    with the least squared relative error over the runs. None without streaming runs."""
    import statistics

    use = _plan_runs(runs)
    if not use or _memplan() is None:
        return None
    best = None
    for i in range(4, 25):
        f = i / 20
        base = statistics.median(r["peak_rss_bytes"] - _plan_run_peak(r, 0.0, f) for r in use)
        base = max(base, 0.0)
        errs = [(_plan_run_peak(r, base, f) - r["peak_rss_bytes"]) / r["peak_rss_bytes"]
                for r in use]
        obj = sum(x * x for x in errs)
        if best is None or obj < best[0]:
            best = (obj, f, base, errs)
    _obj, f, base, errs = best
    return {"base_bytes": float(base), "chunk_factor": f, "runs": len(use),
            "max_abs_error_pct": round(100 * max(abs(x) for x in errs), 1),
            "errors_pct": [round(100 * x, 1) for x in errs]}


def plan_params(cal: dict) -> tuple[float, float]:
    """(base_bytes, chunk_factor) of :func:`plan_peak`: the calibration's ``partition.plan``,
    else fitted on its partition runs, else memplan's BASE_BYTES and its chunk figure."""
    part = cal.get("partition") or {}
    fitted = part.get("plan") or fit_plan(part.get("runs") or [])
    if fitted:
        return float(fitted["base_bytes"]), float(fitted["chunk_factor"])
    mp = _memplan()
    return (float(mp.BASE_BYTES) if mp is not None else 200.0 * (1 << 20)), 1.0


def _min_budget(method: str, n: int, e: int, d: int, fb: int, k: int) -> int | None:
    """partition.memplan's minimum budget for ``method`` where that module exists."""
    try:
        from partition import memplan  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        return int(memplan.min_bytes(method, n, e, d, fb, k))
    except Exception:  # an older / newer signature: the figure is optional
        return None


# ------------------------------------------------------------------------------ calibration


# measured on this machine by `python -m benchmarks.capacity measure` (its "command" and
# "date" say how and when); predict and check read it when --calibration is not given
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "calibration" / "default.json"


def load_calibration(path: str | None) -> dict:
    if not path:
        if not DEFAULT_CALIBRATION.is_file():
            raise CapacityError(f"no --calibration given and the default {DEFAULT_CALIBRATION} "
                                "is missing; make one with `python -m benchmarks.capacity "
                                "measure --out FILE.json`")
        path = str(DEFAULT_CALIBRATION)
    p = Path(path)
    if not p.is_file():
        raise CapacityError(f"--calibration {p} does not exist; make it with "
                            f"`python -m benchmarks.capacity measure --out {p}`")
    try:
        cal = json.loads(p.read_text().strip().splitlines()[-1])
    except (OSError, IndexError, json.JSONDecodeError) as e:
        raise CapacityError(f"--calibration {p} is not a calibration JSON ({e}); re-make it "
                            "with `python -m benchmarks.capacity measure`") from e
    if not isinstance(cal, dict) or cal.get("format") != CALIBRATION_FORMAT:
        raise CapacityError(f"--calibration {p} is not a capacity calibration (format "
                            f"{cal.get('format') if isinstance(cal, dict) else None!r}); "
                            "pass the file `benchmarks.capacity measure --out` wrote")
    if cal.get("version") != CALIBRATION_VERSION:
        raise CapacityError(f"--calibration {p} has version {cal.get('version')}, this "
                            f"calculator reads {CALIBRATION_VERSION}; re-run measure")
    for key in ("sampling", "server_cpu", "server_memory", "partition"):
        if key not in cal:
            raise CapacityError(f"--calibration {p} lacks {key!r}; re-run measure")
    return cal


def _rusage_children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _partition_cli_methods() -> set[str]:
    """The --method choices this checkout's partition-ogbn offers."""
    import dataclasses

    from partition.config import PartitionConfig

    for f in dataclasses.fields(PartitionConfig):
        if f.name == "method":
            return set(f.metadata.get("choices") or ())
    return set()


def _edge_chunk_cap() -> int:
    """Directed edges in the streaming pipeline's largest edge chunk (its stored rows, each
    with its reverse under --add-reverse-edges), from partition.memplan where it exists."""
    try:
        from partition.memplan import MAX_EDGE_ROWS
    except ImportError:
        MAX_EDGE_ROWS = 1 << 22  # noqa: N806 (the module's constant when it is missing)
    return 2 * int(MAX_EDGE_ROWS)


def _poll_peak_rss(proc: subprocess.Popen, timeout_s: float, interval_s: float = 0.05
                   ) -> int:
    """Wait for ``proc``, polling the RSS of its process tree (psutil); the peak sum."""
    import psutil

    peak = 0
    deadline = time.monotonic() + timeout_s
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:
        root = None
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        if root is not None:
            rss = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    rss += p.memory_info().rss
            except psutil.Error:
                pass
            peak = max(peak, rss)
        time.sleep(interval_s)
    return peak


def _run_partition(raw: Path, out: Path, parts: int, method: str, max_memory_gb: float | None,
                   timeout_s: float, add_reverse_edges: bool = False) -> dict:
    """``partition-ogbn --dataset-dir raw`` in a subprocess: wall time and peak RSS.

    The peak is what psutil sees: this function's poll of the process tree and the CLI's own
    sampled peak (``peak_rss_sampled_bytes`` in metadata.json). The CLI's getrusage figure is
    kept apart (``peak_rss_getrusage_bytes``): Linux carries a parent's high-water mark into
    a child across fork and exec, so it is never below this process's RSS at the spawn."""
    argv = [sys.executable, "-m", "partition.cli", "--dataset-dir", str(raw), "--num-parts",
            str(parts), "--out", str(out), "--method", method, "--no-progress"]
    if max_memory_gb:
        argv += ["--max-memory-gb", f"{max_memory_gb:g}"]
    if add_reverse_edges:
        argv.append("--add-reverse-edges")
    t0 = time.perf_counter()
    cpu0 = _rusage_children_cpu()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
                                stdin=subprocess.DEVNULL)
        polled = _poll_peak_rss(proc, timeout_s)
        wall = time.perf_counter() - t0
        cpu = _rusage_children_cpu() - cpu0  # the child was waited for: its CPU is in
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip()[-1500:]
            raise RuntimeError(f"{' '.join(argv[2:])} exited {proc.returncode}: {tail}")
    from partition.layout import PartitionSetMeta

    meta = PartitionSetMeta.load(out)
    st = meta.stats
    sampled = int(st.get("peak_rss_sampled_bytes") or 0)
    return {"method": method, "num_parts": parts, "nodes": meta.num_nodes,
            "directed_edges": meta.num_edges, "feat_dim": meta.feat_dim,
            "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "partition_s": st.get("elapsed_s"),
            "peak_rss_bytes": max(polled, sampled), "peak_rss_polled_bytes": polled,
            "peak_rss_sampled_bytes": sampled,
            "peak_rss_getrusage_bytes": st.get("peak_rss_bytes"),
            "edge_cut_frac": round(st.get("edge_cut_frac", 0.0), 5),
            "max_memory_gb": max_memory_gb}


def _layer_stats(parts: Path, fanouts: list[int], batch: int, batches: int, seed: int) -> dict:
    """Sample ``batches`` MFGs in this process from a 1-part set: per hop (seed side first)
    mean destination nodes, sampled edges and source nodes; mean input nodes."""
    import torch

    from sampler_server.neighbor_sampler import (
        DistributedNeighbors,
        Timings,
        new_scratch,
        sample_mfg,
    )
    from sampler_server.partition_store import PartitionStore

    store = PartitionStore(str(parts), 0, seed=seed)
    scratch = new_scratch(store.meta.num_nodes)
    train = store.seeds("train")
    g = torch.Generator().manual_seed(seed)
    hops = len(fanouts)
    dst, edges, src = [0.0] * hops, [0.0] * hops, [0.0] * hops
    seeds_total = 0
    for i in range(batches):
        perm = train[torch.randperm(train.numel(), generator=g)[:batch]]
        mfg = sample_mfg(perm, fanouts, DistributedNeighbors(store, None, Timings(), scratch),
                         seed + i)
        seeds_total += perm.numel()
        for h, layer in enumerate(reversed(mfg.layers)):  # seed side first
            dst[h] += layer.num_dst[0]
            src[h] += layer.num_src[0]
            edges[h] += sum(int(r.indices.numel()) for r in layer.rels)
    per = [{"fanout": f, "dst": dst[h] / batches, "edges": edges[h] / batches,
            "src": src[h] / batches} for h, f in enumerate(reversed(fanouts))]
    return {"nodes": store.meta.num_nodes, "seeds": seeds_total / batches, "layers": per,
            "input_nodes": per[-1]["src"],
            "phi_seed_side_first": [p["edges"] / p["dst"] for p in per]}


def _shape_point(n: int, args: argparse.Namespace) -> dict:
    """Batch shape on a generated ``n``-node graph of the calibration's shape (features of
    one dimension: they do not change the shape), sampled by DGL's NeighborSampler (uniform,
    without replacement, destination nodes first: the MFG mfgserve's servers build) from
    shuffled training seeds; per hop (seed side first) mean destination nodes, edges and
    source nodes."""
    import numpy as np
    import torch

    from common.dgl_compat import import_dgl
    from partition.synthetic import generate

    dgl = import_dgl()
    data = generate(n, avg_degree=args.avg_degree, feat_dim=1, num_classes=47,
                    seed=args.seed, train_frac=args.train_frac, valid_frac=0.005,
                    progress=False)
    g = dgl.graph((torch.from_numpy(data.src), torch.from_numpy(data.dst)), num_nodes=n)
    train = torch.from_numpy(np.asarray(data.train, dtype=np.int64))
    del data
    sampler = dgl.dataloading.NeighborSampler(list(args.fanouts))
    gen = torch.Generator().manual_seed(args.seed)
    hops = len(args.fanouts)
    acc = [[0.0, 0.0, 0.0] for _ in range(hops)]
    seeds_total = 0
    for _ in range(args.layer_batches):
        seeds = train[torch.randperm(train.numel(), generator=gen)[:args.batch_size]]
        _inp, _out, blocks = sampler.sample_blocks(g, seeds)
        seeds_total += seeds.numel()
        for h, blk in enumerate(reversed(blocks)):  # seed side first
            acc[h][0] += blk.num_dst_nodes()
            acc[h][1] += blk.num_edges()
            acc[h][2] += blk.num_src_nodes()
    nb = args.layer_batches
    layers = [{"fanout": f, "dst": a_[0] / nb, "edges": a_[1] / nb, "src": a_[2] / nb}
              for f, a_ in zip(reversed(args.fanouts), acc, strict=True)]
    return {"nodes": n, "seeds": seeds_total / nb, "layers": layers,
            "input_nodes": layers[-1]["src"]}


def fit_neff(points: list[dict], fanouts: list[int], phis: list[float],
             max_fill: float = 0.75) -> dict:
    """The effective population law ``n_eff = coef * nodes ** exp`` from batch shapes at
    several graph sizes: each point's ``n_eff`` is the one whose :func:`layer_walk` gives its
    measured input nodes (:func:`fit_alpha`); a log-log line through the points whose batches
    fill at most ``max_fill`` of the graph (near-saturated points say little; all points when
    fewer than two qualify)."""
    import numpy as np

    for pt in points:
        pt["n_eff"] = fit_alpha(pt["nodes"], pt["seeds"], fanouts, phis,
                                pt["input_nodes"]) * pt["nodes"]
        pt["fill"] = pt["input_nodes"] / pt["nodes"]
    use = [pt for pt in points if pt["fill"] <= max_fill]
    if len(use) < 2:
        use = points
    if len(use) == 1:
        return {"coef": use[0]["n_eff"] / use[0]["nodes"], "exp": 1.0, "points_used": 1}
    x = np.log([pt["nodes"] for pt in use])
    y = np.log([pt["n_eff"] for pt in use])
    exp, lncoef = np.polyfit(x, y, 1)
    return {"coef": float(np.exp(lncoef)), "exp": float(exp), "points_used": len(use)}


def _server_run(parts: Path, fanouts: list[int], batch: int, batches: int, seed: int,
                threads: int, inflight: int, warmup: int = 2) -> dict:
    """Real sampler servers (one per part) and this process as their client, as
    :func:`benchmarks.server_only.measure_server` runs them, without the ring (every byte
    through the socket, as for a trainer on another node): ``inflight`` requests outstanding
    on part 0's server until ``batches`` replies have arrived after ``warmup``. Figures: the
    servers' CPU seconds over the timed replies (psutil, all servers), reply bytes and input
    nodes per batch, every server's STATS (part 0's ``remote_bytes``: what its peers sent
    it), and the servers' polled peak memory."""
    import psutil
    import zmq

    from benchmarks.scale_steps import ChildRssPoller
    from benchmarks.server_only import (
        _batches,
        _spawn_servers,
        _stop,
        _train_seeds,
        _wait_ready,
    )
    from common.messages import MFGReply, SampleRequest, StatsReply, StatsRequest
    from common.rpc import RpcChannel, expect
    from common.stats import ServerStats
    from deploy.processes import ProcessGroup
    from partition.layout import PartitionSetMeta

    meta = PartitionSetMeta.load(parts)
    run_dir = Path(tempfile.mkdtemp(prefix="mfgserve-capacity-srv-"))
    group = ProcessGroup()
    ctx = zmq.Context()
    endpoints: list[str] = []
    token = ""
    ch = None
    res: dict = {}
    try:
        ready, token = _spawn_servers(group, parts, meta.num_parts, run_dir,
                                      server_workers=threads, inflight=inflight,
                                      max_message_mb=2048, seed=seed, sampler_procs=0)
        endpoints = _wait_ready(group, ready, 300.0)
        procs = [psutil.Process(c.proc.pid) for c in group.children]

        def cpu() -> float:  # to the nanosecond: a tiny graph's few batches take ms
            return sum(process_cpu_s(p) for p in procs)

        ep = endpoints[0]
        ch = RpcChannel(ctx, ep, timeout_s=300.0, setting="--step-timeout-s",
                        max_message_bytes=2048 << 20)
        stream = _batches(_train_seeds(ch, ep, parts), batch, seed)
        total = warmup + batches
        sent = received = 0
        in_nodes = 0
        cpu0 = bytes0 = t0 = 0.0
        with ChildRssPoller(0.1) as poll:
            while sent < min(inflight, total):
                ch.send(SampleRequest(seeds=next(stream), fanouts=list(fanouts)))
                sent += 1
            while received < total:
                msg, _rid = ch.recv(waiting_for="a sampled MFG")
                mfg = expect(msg, MFGReply, ep).mfg
                received += 1
                if received == warmup:
                    cpu0, bytes0, t0 = cpu(), ch.bytes_received, time.perf_counter()
                elif received > warmup:
                    in_nodes += mfg.input_nodes.numel()
                del mfg, msg
                if sent < total:
                    ch.send(SampleRequest(seeds=next(stream), fanouts=list(fanouts)))
                    sent += 1
            elapsed = time.perf_counter() - t0
            cpu_s = cpu() - cpu0
            nbytes = ch.bytes_received - bytes0
        peak = dict(poll.peak)
        rss = anon = 0  # one more sample now: a short run can end before the first poll
        for proc_ in procs:
            mi = proc_.memory_info()
            shared = getattr(mi, "shared", 0)
            rss, anon = rss + mi.rss, anon + mi.rss - shared
        peak["rss"], peak["anon"] = max(peak["rss"], rss), max(peak["anon"], anon)
        peak["file"] = max(peak["file"], rss - anon)
        stats = []
        for e in endpoints:
            sc = RpcChannel(ctx, e, timeout_s=60.0, setting="stats")
            try:
                stats.append(ServerStats.from_wire(
                    expect(sc.call(StatsRequest()), StatsReply, e).values).to_wire())
            finally:
                sc.close()
        res = {"parts": meta.num_parts, "batches": batches, "warmup": warmup,
               "threads": threads, "inflight": inflight, "elapsed_s": round(elapsed, 3),
               "cpu_s": round(cpu_s, 4), "cpu_ms_per_batch": 1000 * cpu_s / batches,
               "wall_ms_per_batch": 1000 * elapsed / batches,
               "bytes_per_batch": nbytes / batches, "input_nodes_per_batch": in_nodes / batches,
               "remote_bytes_per_request": stats[0].get("remote_bytes", 0.0)
               / max(stats[0].get("sample_requests", 1.0), 1.0),
               "stats": stats, "peak": peak}
    finally:
        if ch is not None:
            ch.close()
        stop = _stop(ctx, group, endpoints, token)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
    if not stop.get("clean_exit"):
        raise RuntimeError(f"sampler servers did not exit cleanly: {stop}")
    return res


def _graph(n: int, args: argparse.Namespace, degree: float, raw: Path) -> dict:
    """Write the products-shaped graph in OGB's binary layout at ``raw``: by
    :func:`partition.biggen.write_synthetic_binary` (each undirected edge stored once, as
    ogbn-papers100M ships and as ``benchmarks.scalerun`` writes it; partitioned with
    ``--add-reverse-edges``) where this checkout has it, else generated in memory
    (:func:`partition.synthetic.generate`) and written with both directions stored."""
    t0 = time.perf_counter()
    try:
        from partition.biggen import write_synthetic_binary
    except ImportError:
        write_synthetic_binary = None
    if write_synthetic_binary is not None:
        write_synthetic_binary(raw, num_nodes=n, avg_degree=degree, feat_dim=args.feat_dim,
                               num_classes=47, train_frac=args.train_frac, valid_frac=0.005,
                               seed=args.seed, progress=False)
        return {"nodes": n, "avg_degree": degree, "writer": "partition.biggen",
                "add_reverse_edges": True, "seconds": round(time.perf_counter() - t0, 2)}
    import numpy as np

    from partition.rmat import write_ogb_binary
    from partition.synthetic import generate

    data = generate(n, avg_degree=degree, feat_dim=args.feat_dim, num_classes=47,
                    seed=args.seed, train_frac=args.train_frac, valid_frac=0.005,
                    progress=False)
    data.test = np.sort(data.test[: max(1, round(0.005 * n))])
    write_ogb_binary(data, raw, progress=False)
    return {"nodes": n, "directed_edges": int(data.num_edges), "avg_degree": degree,
            "writer": "partition.rmat.write_ogb_binary", "add_reverse_edges": False,
            "seconds": round(time.perf_counter() - t0, 2)}


def _part_bytes(parts: Path) -> dict:
    """Bytes per node (without features) and per directed edge of a set's part files."""
    from partition.layout import PartitionSetMeta

    meta = PartitionSetMeta.load(parts)
    feat = edge = other = 0
    for f in parts.glob("part-*/*.npy"):
        size = f.stat().st_size
        if f.stem == "feat":
            feat += size
        elif f.stem == "indices":
            edge += size
        else:
            other += size
    other += sum(f.stat().st_size for f in parts.glob("*.npy"))  # orig_to_new, hot_rank
    return {"per_node_nonfeat": other / meta.num_nodes, "per_edge": edge / meta.num_edges,
            "feat_per_node": feat / meta.num_nodes, "total": feat + edge + other}


def _remote_requests(run: dict) -> float:
    """Server-to-server requests per batch of a server run (part 0's STATS)."""
    st = run["stats"][0]
    return st.get("remote_requests", 0.0) / max(st.get("sample_requests", 1.0), 1.0)


def fit_remote_cpu(one: dict, multi: dict, large: dict) -> dict:
    """Servers' extra CPU per batch over a 1-part run, per server-to-server request and per
    byte (non-negative least squares over the multi-part runs). Each K-part run's extra is
    its CPU less its graph's 1-part CPU scaled to its input nodes."""
    pts = []
    for base, runs in ((one, multi), (large.get(1), {k: r for k, r in large.items() if k > 1})):
        if not base:
            continue
        per_node = base["cpu_ms_per_batch"] / max(base["input_nodes_per_batch"], 1.0)
        for k, r in runs.items():
            extra = r["cpu_ms_per_batch"] - per_node * r["input_nodes_per_batch"]
            pts.append({"parts": k, "nodes": r.get("nodes"), "requests": _remote_requests(r),
                        "bytes": r["remote_bytes_per_request"], "extra_ms": extra})
    per_peer = [p["requests"] / (p["parts"] - 1) for p in pts if p["parts"] > 1]
    if len(pts) >= 2:
        a, b = fit_linear([[p["requests"], p["bytes"]] for p in pts],
                          [max(p["extra_ms"], 0.0) for p in pts])
    else:  # one point: all of it per byte
        a, b = 0.0, (max(pts[0]["extra_ms"], 0.0) / max(pts[0]["bytes"], 1.0) if pts else 0.0)
    return {"ms_per_remote_request": a, "ms_per_remote_byte": b,
            "remote_requests_per_peer": (sorted(per_peer)[len(per_peer) // 2]
                                         if per_peer else 0.0),
            "points": pts, "terms": "extra ms = a * requests + b * bytes (per batch)"}


def _ring_runs(args: argparse.Namespace, sets: dict, work: Path) -> dict[int, dict]:
    """worker-mode (``benchmarks.scalerun``'s train step: one trainer, the shared-memory ring
    on, every server of the set on this node) on ``sets[k]`` for each k, ``args.ring_batches``
    training batches and ``args.ring_eval_seeds`` valid / test seeds each: the servers' CPU
    per batch (psutil, from the trainer's start) and the server-to-server bytes per batch,
    as the scale runs measure them."""
    from benchmarks import scalerun

    sargs = scalerun.build_parser().parse_args([
        "--work-dir", str(work), "--fanouts", ",".join(map(str, args.fanouts)),
        "--batch-size", str(args.batch_size), "--seed", str(args.seed),
        "--train-timeout-s", repr(float(args.step_timeout_s)),
        "--eval-seeds", str(args.ring_eval_seeds)])
    caps = {"train": args.ring_batches * args.batch_size,
            "valid": args.ring_eval_seeds or None, "test": args.ring_eval_seeds or None}
    out = {}
    for k, parts in sorted(sets.items()):
        log(f"worker mode, {k} part(s) of {parts.name}, ring on: {args.ring_batches} batches")
        view = scalerun.make_view(parts, work / f"view-{k}", caps, salt=args.seed)
        res = scalerun.train_on_view(sargs, view, work, work / f"run-{k}", epochs=1,
                                     name=f"worker-mode {k} part(s)")
        out[k] = {key: res.get(key) for key in (
            "batches", "eval_batches", "server_cpu_ms_per_batch",
            "server_to_server_bytes_per_batch", "bytes_per_batch", "stage_ms_per_batch",
            "seeds_per_s", "shm_ring", "server_pss_max_bytes", "server_rss_max_bytes")}
        out[k]["parts"] = k
        if not res.get("server_cpu_ms_per_batch"):
            raise RuntimeError(f"worker-mode on {k} part(s) reported no server CPU per batch "
                               f"({res.get('servers')})")
        shutil.rmtree(work / f"view-{k}", ignore_errors=True)
        shutil.rmtree(work / f"run-{k}", ignore_errors=True)
    return out


def fit_ring_cpu(runs: dict[int, dict], walk: list[dict], feat_dim: int, feat_bytes: int
                 ) -> dict:
    """Servers' CPU per batch with the ring (worker mode), from ``runs`` (:func:`_ring_runs`)
    on one graph whose batch shape is ``walk``: the 1-part run's CPU split by its sampling /
    gathering stage times into a cost per sampled edge and per gathered feature byte (features
    written into the ring, not encoded), and the K-part run's extra CPU over it per
    server-to-server byte (the same batches; the peers' gather, encode and send, the
    requester's receive and scatter)."""
    one = runs[1]
    many = runs[max(runs)]
    local = one["server_cpu_ms_per_batch"]
    st = one.get("stage_ms_per_batch") or {}
    sample, gather = st.get("server_sample", 0.0), st.get("server_gather", 0.0)
    share = sample / (sample + gather) if sample + gather > 0 else 0.5
    edges = sum(h["edges"] for h in walk)
    featb = walk[-1]["src"] * feat_dim * feat_bytes
    s2s = many.get("server_to_server_bytes_per_batch") or 0.0
    extra = many["server_cpu_ms_per_batch"] - local
    return {"ms_per_sampled_edge": local * share / max(edges, 1.0),
            "ms_per_feature_byte": local * (1 - share) / max(featb, 1.0),
            "ms_per_remote_byte": max(extra, 0.0) / s2s if s2s > 0 else 0.0,
            "cpu_ms_per_batch_1part": local,
            f"cpu_ms_per_batch_{max(runs)}parts": many["server_cpu_ms_per_batch"],
            "sample_share": share, "model_edges": edges, "model_feature_bytes": featb,
            "runs": runs,
            "terms": "ms = a_E * sampled edges + a_F * feature bytes + a_S * server-to-server "
                     "bytes (per batch, all servers)"}


def measure(args: argparse.Namespace) -> dict:
    """The calibration (module docstring); ``args`` from the ``measure`` sub-parser."""
    n = args.nodes
    if n < 1000:
        raise CapacityError(f"--nodes {n}: calibrate on at least 1000 nodes")
    work = Path(tempfile.mkdtemp(prefix="mfgserve-capacity-", dir=args.work_dir or None))
    t_start = time.perf_counter()
    methods_cli = _partition_cli_methods()
    methods = [m for m in args.methods if m in methods_cli]
    skipped = [m for m in args.methods if m not in methods_cli]
    if skipped:
        log(f"partition-ogbn here has no --method {', '.join(skipped)} (offers "
            f"{', '.join(sorted(methods_cli))}): not calibrated")
    if not methods:
        raise CapacityError(f"none of --methods {','.join(args.methods)} is offered by "
                            f"partition-ogbn here ({', '.join(sorted(methods_cli))})")
    deg = args.avg_degree
    try:
        # graphs: N at the products degree (sampling, server, 1 and 2 parts), N/2 at the
        # same degree and N/2 at half the degree (partition cost: edges vs node bytes)
        shapes = [("full", n, deg), ("half", n // 2, deg), ("sparse", n // 2, deg / 2)]
        if args.partition_nodes and args.partition_nodes > n:
            # one larger graph, partitioned only: the peak stops growing linearly once the
            # pipeline's edge chunk reaches its cap (partition.memplan.MAX_EDGE_ROWS)
            shapes.append(("large", args.partition_nodes, deg))
        graphs = {}
        for tag, nn, dd in shapes:
            log(f"generating {tag}: {nn:,} nodes, avg degree {dd:.3g}")
            graphs[tag] = _graph(nn, args, dd, work / f"raw-{tag}")
        runs = []
        sets = {}
        failed = {}
        for method in methods:
            try:
                for tag, _nn, _dd in shapes:
                    ks = [4] if tag != "full" else [2, 4]
                    if tag == "full" and method == methods[0]:
                        ks = [1, 2, 4]  # the 1- and 2-part sets also serve the server runs
                    if tag == "large" and method == methods[0]:
                        ks = [1, 4]  # the server runs' per-remote-byte cost at scale
                    for k in ks:
                        out = work / f"parts-{tag}-{method}-{k}"
                        log(f"partition-ogbn {tag} -> {k} part(s), --method {method}")
                        r = _run_partition(work / f"raw-{tag}", out, k, method,
                                           args.max_memory_gb, args.step_timeout_s,
                                           graphs[tag]["add_reverse_edges"])
                        r["graph"] = tag
                        runs.append(r)
                        sets[(tag, method, k)] = out
                        log(f"  {r['wall_s']:.1f} s, peak {r['peak_rss_bytes'] / 2**20:,.0f} "
                            f"MiB, cut {r['edge_cut_frac']:.3f}")
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                if method == methods[0]:
                    raise
                failed[method] = str(e)[:2000]
                runs = [r for r in runs if r["method"] != method]
                log(f"--method {method} failed, not calibrated: {str(e)[:400]}")
        methods = [m for m in methods if m not in failed]
        # the plan-based peak's calibration: the same graph at smaller budgets, where the
        # pipeline's buffers (sized from the budget) shrink
        plan_m = next((m for m in methods if m in ("fennel", "ldg")), methods[0])
        for gb in args.plan_budgets:
            out = work / f"parts-full-{plan_m}-4-{gb:g}gb"
            log(f"partition-ogbn full -> 4 parts, --method {plan_m} --max-memory-gb {gb:g}")
            try:
                r = _run_partition(work / "raw-full", out, 4, plan_m, gb, args.step_timeout_s,
                                   graphs["full"]["add_reverse_edges"])
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log(f"  skipped: {str(e)[:300]}")
                continue
            r["graph"] = "full"
            r["plan_only"] = True
            runs.append(r)
            shutil.rmtree(out, ignore_errors=True)
            log(f"  {r['wall_s']:.1f} s, peak {r['peak_rss_bytes'] / 2**20:,.0f} MiB")
        fit = {}
        for method in methods:
            rs = [r for r in runs if r["method"] == method and not r.get("plan_only")]
            work_bytes = [[1, 16 * r["directed_edges"] + r["nodes"] * r["feat_dim"] * 4]
                          for r in rs]
            cap_e = _edge_chunk_cap()
            fit[method] = {
                # CPU seconds, not wall: on a shared machine the wall time of a small run is
                # mostly waiting for a core; the CPU time is the work itself (the pipeline
                # is single-threaded numpy plus file I/O)
                "time": fit_linear(work_bytes, [max(r["cpu_s"], 1e-3) for r in rs]),
                "time_wall": fit_linear(work_bytes, [r["wall_s"] for r in rs]),
                # total edges, not edges per part: measured here, the peak does not move
                # with the part count (1, 2 or 4 parts: within 3 %), but grows with the
                # edges of the input (read through memory-mapped npz members) and the nodes
                "peak": fit_linear([[1, min(r["directed_edges"], cap_e), r["directed_edges"]]
                                    for r in rs], [r["peak_rss_bytes"] for r in rs]),
                "edge_chunk_cap": cap_e,
                "runs": len(rs),
                "terms": {"time": "cpu s = a + b * (16 * directed_edges + feature_bytes)",
                          "peak": "bytes = a + b * min(directed_edges, edge_chunk_cap) + c * "
                                  "directed_edges"}}
        one = sets[("full", methods[0], 1)]
        two = sets[("full", methods[0], 2)]
        pbytes = _part_bytes(one)

        log(f"sampling {args.layer_batches} batches in-process on the partitioned graph")
        layers = {"full": _layer_stats(one, args.fanouts, args.batch_size, args.layer_batches,
                                       args.seed)}
        ladder = []
        for nn in args.shape_nodes:
            log(f"batch shape on a {nn:,}-node graph (DGL NeighborSampler)")
            ladder.append(_shape_point(nn, args))
        biggest = max(ladder, key=lambda pt: pt["nodes"])
        phis = list(reversed([h["edges"] / h["dst"] for h in biggest["layers"]]))  # input first
        neff = fit_neff(ladder, args.fanouts, phis)
        alpha = neff["coef"] * n ** neff["exp"] / n

        # replies travel whole through the socket here: keep what is queued for this client
        # under the server's reply backlog limit (256 MiB by default)
        est = layers["full"]["input_nodes"] * (8 + 4 * args.feat_dim)
        inflight = max(1, min(args.inflight, int(200e6 // max(est, 1))))
        if inflight < args.inflight:
            log(f"--inflight {args.inflight} lowered to {inflight}: replies of ~{est / 1e6:.0f} "
                "MB each would overflow the server's reply backlog")
        args.inflight = inflight
        log(f"one server, 1 part: {args.batches} batches")
        one_run = _server_run(one, args.fanouts, args.batch_size, args.batches, args.seed,
                              args.server_threads, args.inflight)
        cpu_batch_ms = one_run["cpu_ms_per_batch"]
        st = one_run["stats"][0]
        shares = {k: st.get(k, 0.0) for k in ("sample_s", "gather_s", "encode_s")}
        tot = sum(shares.values()) or 1.0
        lay = layers["full"]
        edges_b = sum(h["edges"] for h in lay["layers"])
        featb = lay["input_nodes"] * args.feat_dim * 4
        walk_cal = lay["layers"]  # the measured shape of this graph's batches
        reply_model = reply_bytes(walk_cal, lay["seeds"], args.feat_dim, 4)
        reply_meas = one_run["bytes_per_batch"]
        reply_overhead = reply_meas / reply_model
        ms_edge = cpu_batch_ms * shares["sample_s"] / tot / max(edges_b, 1)
        ms_feat = cpu_batch_ms * shares["gather_s"] / tot / max(featb, 1)
        ms_reply = cpu_batch_ms * shares["encode_s"] / tot / max(reply_meas, 1)

        from partition.layout import PartitionSetMeta

        multi = {}
        for k, parts_k in ((2, two), (4, sets[("full", methods[0], 4)])):
            log(f"{k} servers, {k} parts ({methods[0]}): {args.batches} batches")
            run_k = _server_run(parts_k, args.fanouts, args.batch_size, args.batches,
                                args.seed, args.server_threads, args.inflight)
            cut_k = PartitionSetMeta.load(parts_k).stats.get("edge_cut_frac", (k - 1) / k)
            run_k["edge_cut"] = cut_k
            run_k["remote_bytes_model"] = remote_bytes(walk_cal, locality(k, cut_k, walk_cal),
                                                       args.feat_dim, 4)
            multi[k] = run_k
        two_run = multi[2]
        cpu2_ms = two_run["cpu_ms_per_batch"]
        rb2, rb2_model, cut2 = (two_run["remote_bytes_per_request"],
                                two_run["remote_bytes_model"], two_run["edge_cut"])
        meas = sum(r["remote_bytes_per_request"] for r in multi.values())
        model = sum(r["remote_bytes_model"] for r in multi.values())
        remote_overhead = meas / model if model else 1.0
        # the larger graph's 1- and 4-part sets: the server-to-server cost at scale (on
        # 200k nodes the bytes per request are small and a per-request overhead inflates the
        # cost per byte)
        large = {}
        if ("large", methods[0], 1) in sets and ("large", methods[0], 4) in sets:
            for k in (1, 4):
                log(f"{k} server(s), {k} part(s) of the {args.partition_nodes:,}-node graph: "
                    f"{args.batches} batches")
                large[k] = _server_run(sets[("large", methods[0], k)], args.fanouts,
                                       args.batch_size, args.batches, args.seed,
                                       args.server_threads, 1)
        remote_fit = fit_remote_cpu(one_run, multi, large)
        ms_remote = remote_fit["ms_per_remote_byte"]
        # with the ring (worker mode): the larger graph's 1-part set and the last method's
        # 4-part set in worker mode, as the scale runs are measured
        ring = None
        ring_sets = {1: sets.get(("large", methods[0], 1)),
                     4: sets.get(("large", methods[-1], 4))}
        if args.ring_batches > 0 and all(ring_sets.values()):
            ring_runs = _ring_runs(args, ring_sets, work)  # type: ignore[arg-type]
            walk_large = layer_walk(min(args.batch_size, round(args.train_frac
                                                               * args.partition_nodes)),
                                    args.fanouts, phis,
                                    neff["coef"] * args.partition_nodes ** neff["exp"])
            ring = fit_ring_cpu(ring_runs, walk_large, args.feat_dim, 4)
            ring["nodes"] = args.partition_nodes
            ring["method_4parts"] = methods[-1]

        inflight_work = args.inflight * (featb + reply_meas)
        anon = one_run["peak"]["anon"]
        fixed_anon = max(anon - args.server_threads * 4 * lay["nodes"] - inflight_work,
                         0.0)
        pap = DATASETS["ogbn-papers100M"]
        ref_in = layer_walk(min(1024, pap["train_nodes"]), args.fanouts, phis,
                            neff["coef"] * pap["nodes"] ** neff["exp"])[-1]["src"]
        cuts = {str(r["num_parts"]): r["edge_cut_frac"] for r in runs
                if r["graph"] == "full" and r["method"] == methods[-1] and r["num_parts"] > 1}
        cal = {
            "format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
            "graph": {"nodes": n, "avg_degree": deg, "feat_dim": args.feat_dim,
                      "train_frac": args.train_frac, "generator": "partition.synthetic",
                      "shapes": graphs},
            "sampling": {"batch_size": args.batch_size, "fanouts": args.fanouts,
                         "phi": phis, "neff_coef": neff["coef"], "neff_exp": neff["exp"],
                         "neff_points_used": neff["points_used"], "alpha_at_nodes": alpha,
                         "ladder": ladder, "layers": layers, "reply_overhead": reply_overhead,
                         "remote_overhead": remote_overhead,
                         "reply_bytes_measured": reply_meas, "reply_bytes_model": reply_model,
                         "remote_bytes_measured_2parts": rb2,
                         "remote_bytes_model_2parts": rb2_model, "edge_cut_2parts": cut2},
            "server_cpu": {"cpu_ms_per_batch": cpu_batch_ms,
                           "cpu_ms_per_batch_2parts": cpu2_ms,
                           "cpu_ms_per_batch_4parts": multi[4]["cpu_ms_per_batch"],
                           "cpu_ms_per_input_node": cpu_batch_ms / lay["input_nodes"],
                           "stage_shares": {k: v / tot for k, v in shares.items()},
                           "ms_per_sampled_edge": ms_edge, "ms_per_feature_byte": ms_feat,
                           "ms_per_reply_byte": ms_reply, "ms_per_remote_byte": ms_remote,
                           "ms_per_remote_request": remote_fit["ms_per_remote_request"],
                           "remote_requests_per_peer": remote_fit["remote_requests_per_peer"],
                           "remote_fit": remote_fit, "ring": ring,
                           "threads": args.server_threads, "inflight": args.inflight,
                           "batches": args.batches,
                           "wall_ms_per_batch": one_run["wall_ms_per_batch"]},
            "server_memory": {"peak_rss_bytes": one_run["peak"]["rss"],
                              "peak_anon_bytes": anon,
                              "peak_file_bytes": one_run["peak"]["file"],
                              "stats_rss_bytes": st.get("mem_rss_bytes"),
                              "stats_pss_bytes": st.get("mem_pss_bytes"),
                              "fixed_anon_bytes": fixed_anon,
                              "threads": args.server_threads, "inflight": args.inflight,
                              "graph_bytes": pbytes["total"]},
            "partition": {"bytes": pbytes, "runs": runs, "fit": fit, "plan": fit_plan(runs),
                          "methods_skipped": skipped, "methods_failed": failed},
            "cut_by_parts": cuts,
            "gpu_ref_input_nodes": ref_in,
            "server_runs": {"one_part": one_run,
                            **{f"{k}_parts": r for k, r in multi.items()},
                            **{f"large_{k}_parts": r for k, r in large.items()}},
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return cal


# ------------------------------------------------------------------------------ check


# A run, flat (what ``check`` compares). ``benchmarks.scalerun``'s summary is flattened into
# this by :func:`runs_from_scalerun`; a hand-made RUNS.json may be a list of these directly.
RUN_KEYS = {
    "name": "label", "nodes": "nodes of the graph", "directed_edges": "edges as stored",
    "feat_dim": "feature size", "feat_dtype": "float32 | float16", "num_parts": "parts",
    "method": "partitioner", "max_memory_gb": "partitioning budget",
    "train_nodes": "training seeds (batches per epoch)", "shm_ring": "features via the ring",
    "server_threads": "sampling threads per server",
    "inflight": "requests in flight per server (batches held at once)",
    # measured figures, each compared when present:
    "partition_wall_s": "partition-ogbn wall time",
    "partition_peak_rss_bytes": "partition-ogbn peak RSS",
    "graph_bytes": "bytes of the partition set",
    "input_nodes_per_batch": "input nodes per batch",
    "bytes_per_batch": "reply bytes per batch on the trainer's socket",
    "server_to_server_bytes_per_batch": "server-to-server bytes per batch",
    "server_cpu_ms_per_batch": "servers' CPU ms per batch (all servers)",
    "server_rss_bytes": "peak RSS of the largest server",
    "server_pss_bytes": "peak PSS of the largest server",
}


def runs_from_scalerun(summary: dict) -> list[dict]:
    """Flatten ``benchmarks.scalerun``'s summary (``config`` + ``scales[]`` with
    ``partition`` and ``train``) into flat runs (:data:`RUN_KEYS`)."""
    cfg = summary.get("config") or {}
    runs = []
    for sc in summary.get("scales") or []:
        part, train = sc.get("partition") or {}, sc.get("train") or {}
        if not part:
            continue
        nodes = part.get("num_nodes") or sc.get("nodes")
        run = {"name": f"{sc.get('scale', '?')}x", "nodes": nodes,
               "directed_edges": part.get("num_edges"), "feat_dim": cfg.get("feat_dim"),
               "feat_dtype": cfg.get("feat_dtype") or "float32",
               "num_parts": cfg.get("parts") or (part.get("cli") or {}).get("num_parts"),
               "method": part.get("method") or cfg.get("method"),
               "max_memory_gb": cfg.get("max_memory_gb"),
               "train_nodes": round((cfg.get("train_frac") or 0) * nodes) if nodes else None,
               "partition_wall_s": part.get("wall_s"),
               # the polled peak: the CLI's own getrusage figure carries the parent's
               # high-water mark across fork + exec (see _run_partition)
               "partition_peak_rss_bytes": part.get("peak_rss_polled_bytes")
               or part.get("peak_rss_bytes"),
               "graph_bytes": part.get("parts_bytes")}
        if train:
            batches = train.get("batches") or 0
            s2s = train.get("server_to_server_bytes")
            run.update(shm_ring=bool(train.get("shm_ring")),
                       server_threads=cfg.get("server_workers"),
                       bytes_per_batch=train.get("bytes_per_batch"),
                       server_to_server_bytes_per_batch=(s2s / batches
                                                         if s2s and batches else None),
                       server_cpu_ms_per_batch=train.get("server_cpu_ms_per_batch"),
                       server_rss_bytes=train.get("server_rss_max_bytes"),
                       server_pss_bytes=train.get("server_pss_max_bytes"))
        runs.append(run)
    return runs


# (label, measured key, predicted value from a prediction dict)
_CHECKS = (
    ("partition wall s", "partition_wall_s", lambda p: p["partition"]["wall_s"]),
    ("partition peak RSS", "partition_peak_rss_bytes",
     lambda p: p["partition"]["peak_rss_bytes"]),
    ("partition set bytes", "graph_bytes", lambda p: p["graph_bytes"]),
    ("input nodes / batch", "input_nodes_per_batch", lambda p: p["batch"]["input_nodes"]),
    ("socket bytes / batch", "bytes_per_batch", lambda p: p["batch"]["reply_bytes"]),
    ("server-server bytes / batch", "server_to_server_bytes_per_batch",
     lambda p: p["batch"]["remote_bytes"]),
    ("server CPU ms / batch", "server_cpu_ms_per_batch", lambda p: p["batch"]["server_cpu_ms"]),
    # the model's memory per server is what the server adds to its node: PSS. RSS counts
    # pages shared with other processes (the trainer's ring slots, libraries) whole, so it
    # is shown against the same prediction for information, never flagged.
    ("server PSS (largest)", "server_pss_bytes", lambda p: p["server_memory_bytes"]),
    ("server RSS (largest, info)", "server_rss_bytes", lambda p: p["server_memory_bytes"]),
)


def load_runs(path: str) -> list[dict]:
    """Flat runs from ``path``: benchmarks.scalerun's summary (its last JSON line), a list
    of flat runs, or ``{"runs": [...]}``."""
    p = Path(path)
    if not p.is_file():
        raise CapacityError(f"--runs {p} does not exist; make it with `python -m "
                            "benchmarks.scalerun --out FILE.json`")
    try:
        raw = json.loads(p.read_text().strip().splitlines()[-1])
    except (OSError, IndexError, json.JSONDecodeError) as e:
        raise CapacityError(f"--runs {p} is not JSON ({e}); pass the file benchmarks.scalerun "
                            "wrote") from e
    if isinstance(raw, dict) and "scales" in raw:
        runs = runs_from_scalerun(raw)
    else:
        runs = raw.get("runs") if isinstance(raw, dict) else raw
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise CapacityError(f"--runs {p} holds no runs (benchmarks.scalerun's summary with "
                            "partitioned scales, a JSON list of runs, or {\"runs\": [...]})")
    return runs


def check(cal: dict, runs: list[dict], *, method: str | None = None,
          flag_pct: float = FLAG_PCT) -> list[dict]:
    """Predicted vs measured for every figure each run carries (:data:`RUN_KEYS`)."""
    rows = []
    for i, run in enumerate(runs):
        n, e, d = run.get("nodes"), run.get("directed_edges"), run.get("feat_dim")
        if not n or e is None or not d:
            raise CapacityError(f"run {i} ({run.get('name', '?')}) of --runs lacks nodes / "
                                f"directed_edges / feat_dim (keys: {sorted(run)})")
        k = int(run.get("num_parts") or 1)
        train = run.get("train_nodes") or round(cal["graph"]["train_frac"] * n)
        fb = 2 if str(run.get("feat_dtype") or "float32") == "float16" else 4
        t = {"dataset": run.get("name") or f"run {i}", "nodes": int(n),
             "directed_edges": int(e), "feat_dim": int(d), "train_nodes": max(int(train), 1),
             "feat_bytes": fb}
        threads = run.get("server_threads")
        p = predict(cal, t, servers=k, trainers=1, bandwidth_gbps=10.0,
                    method=method or run.get("method") or "fennel",
                    max_memory_gb=run.get("max_memory_gb"),
                    server_threads=int(threads) if threads else None,
                    shm_ring=bool(run.get("shm_ring")), inflight=run.get("inflight"))
        for label, key, pred in _CHECKS:
            meas = run.get(key)
            if not isinstance(meas, (int, float)) or isinstance(meas, bool) or meas <= 0:
                continue
            pv = pred(p)
            err = 100.0 * (pv - meas) / meas
            rows.append({"run": t["dataset"], "nodes": t["nodes"], "parts": k,
                         "method": p["partition"]["method"], "figure": label,
                         "predicted": pv, "measured": meas, "error_pct": round(err, 1),
                         "flag": abs(err) > flag_pct and "info" not in label})
    return rows


# ------------------------------------------------------------------------------ output


def _h(v: float, unit: str = "B") -> str:
    if unit == "B":
        for u, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(v) >= f:
                return f"{v / f:,.2f} {u}"
        return f"{v:,.0f} B"
    if unit == "s":
        return f"{v / 3600:,.2f} h" if v >= 3600 else f"{v:,.1f} s"
    return f"{v:,.0f}"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def print_prediction(preds: list[dict]) -> None:
    rows = [("dataset", "K", "Gbit/s", "mem/server", "part. CPU", "part. peak",
             "input nodes", "wire/epoch", "sampling s", "network s", "gpu s", "epoch s",
             "binds")]
    for p in preds:
        ep, pa = p["epoch"], p["partition"]
        rows.append((p["dataset"], str(p["servers"]), f"{p['bandwidth_gbps']:g}",
                     _h(p["server_memory_bytes"]), _h(pa["cpu_s"], "s"),
                     _h(pa["peak_rss_bytes"]), _h(p["batch"]["input_nodes"], "n"),
                     _h(ep["wire_bytes"]), f"{ep['bounds_s']['sampling_cores']:,.1f}",
                     f"{ep['bounds_s']['network']:,.1f}", f"{ep['bounds_s']['gpu']:,.1f}",
                     f"{ep['time_s']:,.1f}", ep["binds"]))
    print(_table(rows), file=sys.stderr)
    p = preds[0]
    print(f"assumed: {p['server_cores']} sampling cores per server node, edge cut "
          f"{p['edge_cut']:g}, partitioning by {p['partition']['method']}; GPU step "
          f"{p['epoch']['gpu_step_ms']:.2f} ms/batch ({p['epoch']['gpu_step_source']})",
          file=sys.stderr)


def print_check(rows: list[dict]) -> None:
    if not rows:
        print("no figure of the runs could be compared", file=sys.stderr)
        return
    out = [("run", "nodes", "parts", "figure", "predicted", "measured", "error %", "")]
    for r in rows:
        out.append((str(r["run"]), f"{r['nodes']:,}", str(r["parts"]), r["figure"],
                    f"{r['predicted']:,.4g}", f"{r['measured']:,.4g}", f"{r['error_pct']:+.1f}",
                    "FLAG > 25%" if r["flag"] else ""))
    print(_table(out), file=sys.stderr)


def _ladder_text(pt: dict) -> str:
    return f"{pt['nodes']:,} nodes: {pt['input_nodes']:,.0f} input"


def print_calibration(cal: dict) -> None:
    s, c, m = cal["sampling"], cal["server_cpu"], cal["server_memory"]
    pb = cal["partition"]["bytes"]
    print(f"calibration on {cal['graph']['nodes']:,} nodes (avg degree "
          f"{cal['graph']['avg_degree']:.3g}, {cal['graph']['feat_dim']}-dim), fanouts "
          f"{s['fanouts']}, batch {s['batch_size']}", file=sys.stderr)
    lay = s["layers"]["full"]
    print(f"  input nodes/batch {lay['input_nodes']:,.0f}; edges/dst per hop (seed side "
          f"first) {[round(x, 2) for x in reversed(s['phi'])]}; n_eff = {s['neff_coef']:.4g} "
          f"x nodes^{s['neff_exp']:.3f} (ladder: "
          f"{', '.join(_ladder_text(pt) for pt in s['ladder'])})",
          file=sys.stderr)
    print(f"  reply bytes/batch {s['reply_bytes_measured']:,.0f} (model x"
          f"{s['reply_overhead']:.3f}); 2-part server-to-server bytes/batch "
          f"{s['remote_bytes_measured_2parts']:,.0f} (model x{s['remote_overhead']:.3f})",
          file=sys.stderr)
    print(f"  server CPU ms/batch {c['cpu_ms_per_batch']:.1f} (1 part), "
          f"{c['cpu_ms_per_batch_2parts']:.1f} (2 parts, both servers); per input node "
          f"{c['cpu_ms_per_input_node'] * 1000:.3f} us; shares "
          f"{ {k: round(v, 2) for k, v in c['stage_shares'].items()} }", file=sys.stderr)
    r = c.get("ring")
    if r:
        print(f"  with the ring (worker mode, {r['nodes']:,} nodes): CPU ms/batch "
              f"{r['cpu_ms_per_batch_1part']:.1f} (1 part), "
              f"{r['cpu_ms_per_batch_4parts']:.1f} (4 parts, {r['method_4parts']}); "
              f"{r['ms_per_remote_byte'] * 1e6:.2f} ns per server-to-server byte",
              file=sys.stderr)
    print(f"  server peak RSS {_h(m['peak_rss_bytes'])} (anon {_h(m['peak_anon_bytes'])}, "
          f"fixed anon {_h(m['fixed_anon_bytes'])}); part bytes per node "
          f"{pb['per_node_nonfeat']:.1f} + features, per edge {pb['per_edge']:.2f}",
          file=sys.stderr)
    for meth, f in cal["partition"]["fit"].items():
        print(f"  partition-ogbn --method {meth}: CPU {f['time'][0]:.2f} s + "
              f"{f['time'][1] * 1e9:.3f} ns per input byte (16/edge + features); peak "
              f"{_h(f['peak'][0])} + {f['peak'][1]:.2f} B per directed edge up to "
              f"{f['edge_chunk_cap']:,} + {f['peak'][2]:.2f} B per directed edge",
              file=sys.stderr)


# ------------------------------------------------------------------------------ CLI


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from e
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def _int_or_list(text: str) -> list[int]:
    vals = int_list(text)
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _float_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from e
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("measure", help="calibrate here on a small generated graph")
    m.add_argument("--out", required=True, help="calibration JSON to write")
    m.add_argument("--nodes", type=int, default=200_000,
                   help="nodes of the calibration graph (default 200000; 2 more graphs of "
                        "half the nodes are partitioned too)")
    m.add_argument("--avg-degree", type=float, default=PRODUCTS_AVG_DEGREE,
                   help=f"directed edges per node (default {PRODUCTS_AVG_DEGREE:.4f}, "
                        "ogbn-products')")
    m.add_argument("--feat-dim", type=int, default=100)
    m.add_argument("--train-frac", type=float, default=round(PRODUCTS_TRAIN / PRODUCTS_NODES, 5))
    m.add_argument("--fanouts", type=_int_or_list, default=[15, 10, 5],
                   help="input layer first (default 15,10,5)")
    m.add_argument("--batch-size", type=int, default=1024)
    m.add_argument("--batches", type=int, default=24,
                   help="timed batches of each server run, after 2 untimed (default 24)")
    m.add_argument("--partition-nodes", type=int, default=1_000_000,
                   help="one more graph of this many nodes, partitioned into 4 parts by each "
                        "method (default 1000000; 0 or <= --nodes: none)")
    m.add_argument("--layer-batches", type=int, default=8,
                   help="batches sampled in-process for each batch shape (default 8)")
    m.add_argument("--shape-nodes", type=_int_or_list, default=[100_000, 200_000, 400_000,
                                                                   800_000],
                   help="graph sizes whose batch shapes fit the effective-population law "
                        "(default 100000,200000,400000,800000; generated with 1-dim features, "
                        "sampled in this process)")
    m.add_argument("--ring-batches", type=int, default=80,
                   help="training batches of the two worker-mode runs (ring on) on the "
                        "--partition-nodes graph, 1 part and 4 parts, that calibrate the "
                        "servers' CPU per batch with the ring (default 80; 0: none, and "
                        "worker-mode predictions use the socket figures)")
    m.add_argument("--ring-eval-seeds", type=int, default=10000,
                   help="valid and test seeds each of those runs evaluates after training, "
                        "as benchmarks.scalerun's --eval-seeds (default 10000)")
    m.add_argument("--server-threads", type=int, default=2)
    m.add_argument("--inflight", type=int, default=2,
                   help="requests kept in flight by the measuring client (default 2; lowered "
                        "when the replies would overflow the server's reply backlog)")
    m.add_argument("--methods", type=lambda s: [x for x in s.split(",") if x],
                   default=["random", "fennel"],
                   help="partition-ogbn methods to calibrate (default random,fennel; those "
                        "this checkout lacks are skipped and named)")
    m.add_argument("--max-memory-gb", type=float, default=12.0,
                   help="partition-ogbn --max-memory-gb of the calibration runs (default 12, "
                        "the scale runs' budget)")
    m.add_argument("--plan-budgets", type=lambda t: [float(x) for x in t.split(",") if x],
                   default=[0.5, 1.0],
                   help="extra --max-memory-gb budgets (GB) at which the calibration graph is "
                        "partitioned into 4 parts, to calibrate the plan-based peak (default "
                        "0.5,1; empty: none)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--work-dir", help="where the temporary graphs go (default: system temp)")
    m.add_argument("--step-timeout-s", type=float, default=900.0)

    q = sub.add_parser("predict", help="predict for a dataset on K servers / trainers")
    q.add_argument("--dataset", required=True,
                   help="ogbn-products, ogbn-papers100M or custom (with --nodes --edges "
                        "--feat-dim --train-nodes)")
    q.add_argument("--nodes", type=int)
    q.add_argument("--edges", type=int, help="undirected edges (stored both ways)")
    q.add_argument("--feat-dim", type=int)
    q.add_argument("--train-nodes", type=int)
    q.add_argument("--feat-dtype", choices=["float32", "float16"])
    q.add_argument("--servers", type=_int_or_list, required=True,
                   help="server nodes K (a comma list gives one row each)")
    q.add_argument("--trainers", type=_int_or_list,
                   help="trainer nodes (default: the same as --servers, one per server)")
    q.add_argument("--bandwidth-gbps", type=_float_list, required=True,
                   help="network bandwidth per node in Gbit/s (a comma list: one row each)")
    q.add_argument("--gpu-step-ms", type=_positive_float,
                   help="GPU time of one training step (one batch); default: SALIENT's "
                        "published papers100M figure scaled by input nodes (see "
                        "docs/scaling.md)")
    q.add_argument("--server-cores", type=int, default=16,
                   help="sampling cores per server node (default 16)")
    q.add_argument("--server-threads", type=int,
                   help="sampling threads per server, for its relabel scratch (default: the "
                        "calibration's)")
    q.add_argument("--method", default="fennel", choices=["fennel", "ldg", "random", "metis"],
                   help="partitioner (default fennel; falls back to the calibrated one)")
    q.add_argument("--edge-cut", type=float,
                   help="edge-cut fraction of the partition (default: random's (K-1)/K, or "
                        "the calibration's for the method)")
    q.add_argument("--max-memory-gb", type=_positive_float,
                   help="partitioning budget to check the predicted peak against")
    q.add_argument("--batches-by-part", action="store_true",
                   help="model batches made of one part's seeds only (a trainer's default "
                        "batches are shuffled over all seeds and go to the part owning most "
                        "of them)")
    q.add_argument("--shm-ring", action="store_true",
                   help="trainers share the servers' node and take features through the "
                        "shared-memory ring (worker mode): replies leave the features out "
                        "and the servers' CPU uses the calibration's worker-mode figures")
    q.add_argument("--input-nodes", type=_positive_float,
                   help="a measured input-node count per batch to use instead of the model's")
    q.add_argument("--calibration",
                   help="calibration JSON from `measure` (default: "
                        "benchmarks/calibration/default.json, measured on this repository's "
                        "development machine)")

    c = sub.add_parser("check", help="predicted vs measured for runs made here")
    c.add_argument("--calibration",
                   help="calibration JSON from `measure` (default: "
                        "benchmarks/calibration/default.json)")
    c.add_argument("--runs", required=True, help="runs JSON (benchmarks.scalerun --out)")
    c.add_argument("--method", help="partitioner to predict for (default: each run's)")
    c.add_argument("--flag-pct", type=float, default=FLAG_PCT)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args, argv)
    except CapacityError as e:
        print(f"benchmarks.capacity {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, argv: list[str] | None) -> int:
    cmd = command_line("benchmarks.capacity", argv)
    if args.cmd == "measure":
        out = Path(args.out)
        if out.parent and not out.parent.is_dir():
            raise CapacityError(f"--out {out}: directory {out.parent} does not exist")
        if args.batches < 1:
            raise CapacityError("--batches must be >= 1")
        cal = measure(args)
        cal["command"] = cmd
        cal["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        cal["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        print_calibration(cal)
        line = json.dumps(cal)
        out.write_text(line + "\n")
        print(line, flush=True)
        return 0
    cal = load_calibration(args.calibration)
    if args.cmd == "predict":
        t = _target(args)
        trainers = args.trainers or args.servers
        if len(trainers) not in (1, len(args.servers)):
            raise CapacityError("--trainers takes one value or as many as --servers")
        preds = []
        for i, k in enumerate(args.servers):
            tr = trainers[i] if len(trainers) > 1 else (trainers[0] if args.trainers else k)
            for bw in args.bandwidth_gbps:
                preds.append(predict(cal, t, servers=k, trainers=tr, bandwidth_gbps=bw,
                                     gpu_step_ms=args.gpu_step_ms,
                                     server_cores=args.server_cores, method=args.method,
                                     edge_cut=args.edge_cut, max_memory_gb=args.max_memory_gb,
                                     input_nodes=args.input_nodes,
                                     server_threads=args.server_threads,
                                     batches_by_part=args.batches_by_part,
                                     shm_ring=args.shm_ring))
        print_prediction(preds)
        print(json.dumps({"command": cmd,
                          "calibration": args.calibration or str(DEFAULT_CALIBRATION),
                          "predictions": preds}), flush=True)
        return 0
    rows = check(cal, load_runs(args.runs), method=args.method, flag_pct=args.flag_pct)
    print_check(rows)
    flagged = [r for r in rows if r["flag"]]
    print(json.dumps({"command": cmd,
                      "calibration": args.calibration or str(DEFAULT_CALIBRATION),
                      "runs": args.runs,
                      "rows": rows, "flagged": len(flagged), "compared": len(rows)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
