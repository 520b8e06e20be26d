"""The data path a GPU trainer would see: batches delivered per sampler core, no model.

mfgserve side: real sampler server processes are started exactly as ``worker-mode`` starts
them (:func:`deploy.worker_mode.start_servers`: ``servers_per_part`` servers per part on
private ``ipc://`` sockets, the ServerConfig options on their command lines, the launcher's
environment for servers: ``OMP_WAIT_POLICY=PASSIVE``), and this process is the trainer: the
REAL trainer loader (:class:`trainer_client.loader.DistNodeDataLoader` over
:func:`trainer_client.train.make_pool`, with the shared-memory ring from
:func:`trainer_client.train.make_ring`, on by default as a same-host trainer has it;
deterministic sampling as the trainer's default) yields batches, and the consumer touches
them without a model: a sum over the input features (``mfg[0].srcdata["feat"]``) and over
the seed labels (``mfg[-1].dstdata["label"]``).

Measured with 1 server and with 2 servers. Two servers means two *replicas* of the same part
(``worker-mode --servers-per-part 2``), not a 2-part set: on one node every server maps the
same partition files (the page cache holds one copy), and replicas double the sampling
capacity with no cross-server traffic; a 2-part set on one node would add server-to-server
requests for every batch (each batch's neighbourhood crosses the cut) and only pays off when
the graph does not fit one machine. The loader sends batches round-robin over the replicas.

Sampler cores: the CPU seconds (user + system, from psutil) the server processes (and their
sampler processes, if ``--sampler-procs``) spent during the timed window, so
``seeds_per_sampler_cpu_s`` = seeds / server CPU-seconds is "seeds per second per fully busy
sampler core". Also given: the configured sampler count (servers x threads or processes),
the servers' own busy seconds from STATS (sample + gather + remote + encode summed over
requests) and the trainer-side CPU seconds (this process: loader, ring, touching).

DGL side: ``dgl.dataloading.DataLoader`` + ``NeighborSampler`` prefetching ``feat`` and
``label`` (as :func:`benchmarks.dgl_pipeline.sample_only_dgl`), on the same graph, seeds,
fanouts and batch size, for each ``--dgl-workers`` value; the consumer touches the same
tensors. Its sampler CPU seconds are those of the process(es) doing sampling + gathering:
this process for ``num_workers`` 0 (DGL's sampler may use several OpenMP threads: counted),
the worker processes for ``num_workers`` >= 1 (the main process is given apart).
Page faults in the timed window (``server_faults``, ``consumer_faults``, DGL's
``sampler_faults``: minor and major, from ``/proc/<pid>/stat``) tell a slow window that was
paging partition files back in (major faults) from one that was not.
``touch_s`` is the wall time of the consumer's sums in the window on both sides (with DGL
``num_workers`` 0 it is inside the sampler CPU seconds, a few percent of them).

Ratios (mfgserve / DGL, > 1: mfgserve better) against DGL's best ``num_workers``: per sampler
CPU-second (``per_core_*``), per CPU-second of all processes involved (``per_total_cpu_*``),
and plain seeds/s.

``--rounds N`` measures every row N times, mfgserve's rows first in odd rounds and DGL's
first in even ones; round r > 1's results are named ``<name>_r<r>``, and each ratio is the
median of the rounds' ratios (each round's against that round's best DGL row), the rounds'
values under ``<key>_rounds``. On a shared VM one side's window can fall in a slow minute
that the other's misses (session 50: products per core 1.73-3.22 between runs of one code);
rows measured back to back move together.

Servers are stopped with a Shutdown message (the launcher's token), exit codes checked
(``exit_codes``, ``clean_exit``; SIGTERM / SIGKILL only if they do not exit: ``teardown``).

Run alone: ``python -m benchmarks.datapath --parts DIR``: a table on stderr, the last stdout
line is JSON ``{"config", "results", "ratios", "errors"}``. From ``benchmarks.run``:
:func:`run_step`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import psutil
import torch

from benchmarks.report import add_malloc_arg, apply_malloc, int_list, process_cpu_s
from common.alloc import DEFAULT_RETAIN_MB

STEP = "datapath"


class DataPathError(RuntimeError):
    """A server did not start or did not exit cleanly, or a measurement could not run."""


# ------------------------------------------------------------------ CPU accounting
def _families(procs: list[psutil.Process], descendants: bool = True
              ) -> list[psutil.Process]:
    """``procs`` and (with ``descendants``) their descendants; a process gone is left out."""
    out: list[psutil.Process] = []
    for p in procs:
        try:
            out += [p, *(p.children(recursive=True) if descendants else ())]
        except psutil.Error:
            continue
    return out


def _cpu_seconds(procs: list[psutil.Process]) -> dict[int, float]:
    """user + system CPU seconds of each process (and its descendants), by pid."""
    out: dict[int, float] = {}
    for q in _families(procs):
        try:
            out[q.pid] = process_cpu_s(q)
        except psutil.Error:
            pass
    return out


def _cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots (a process new since ``before``: all of it)."""
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def _faults(procs: list[psutil.Process], descendants: bool = True
            ) -> dict[int, tuple[int, int]]:
    """(minor, major) page faults of each process (and its descendants) so far, by pid,
    from ``/proc/<pid>/stat``; empty where that is not readable (not Linux)."""
    out: dict[int, tuple[int, int]] = {}
    for q in _families(procs, descendants):
        try:
            with open(f"/proc/{q.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)"
            out[q.pid] = (int(fields[7]), int(fields[9]))  # minflt, majflt
        except (OSError, IndexError, ValueError):
            pass
    return out


def _faults_delta(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]
                  ) -> dict[str, int]:
    """Page faults taken between two :func:`_faults` snapshots: ``{"minor", "major"}``."""
    mn = sum(v[0] - before.get(pid, (0, 0))[0] for pid, v in after.items())
    mj = sum(v[1] - before.get(pid, (0, 0))[1] for pid, v in after.items())
    return {"minor": mn, "major": mj}


def _own_cpu() -> float:
    return time.process_time()  # this process's threads, to the nanosecond


@contextlib.contextmanager
def _torch_threads(n: int | None):
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------ mfgserve
def _stats(ctx, endpoints: list[str]) -> dict[str, dict[str, float]]:
    """Each server's STATS counters (a separate connection from the loader's)."""
    from common.messages import StatsReply, StatsRequest
    from common.rpc import RpcChannel, expect

    out = {}
    for ep in endpoints:
        ch = RpcChannel(ctx, ep, timeout_s=30.0, setting="STATS timeout")
        try:
            out[ep] = dict(expect(ch.call(StatsRequest()), StatsReply, ep).values)
        finally:
            ch.close()
    return out


_BUSY = ("sample_s", "gather_s", "remote_s", "encode_s")


def _busy_s(before: dict, after: dict) -> dict[str, float]:
    """Per-stage server seconds in the window, summed over servers."""
    return {k: sum(after[ep].get(k, 0.0) - before[ep].get(k, 0.0) for ep in after)
            for k in (*_BUSY, "seeds_served", "sample_requests")}


def measure_mfgserve(parts: str | Path, *, servers_per_part: int, fanouts: list[int],
                     batch_size: int, num_batches: int, warmup: int = 3,
                     server_workers: int = 2, sampler_procs: int = 0, inflight: int = 4,
                     shm_ring: bool = True, seed: int = 0, num_threads: int | None = None,
                     startup_timeout_s: float = 120.0, shutdown_timeout_s: float = 20.0,
                     malloc_retain_mb: int = DEFAULT_RETAIN_MB,
                     cache_ratio: float = 0.0) -> dict:
    """Start the servers as worker-mode does, pull ``warmup + num_batches`` batches through
    the trainer loader touching features and labels, stop the servers; figures of the last
    ``num_batches`` (see the module docstring). ``cache_ratio`` > 0: the trainer's feature
    cache (``--cache-ratio``) holds that share of each part's hottest nodes, the servers
    leave those rows out and the loader fills them in (trainer CPU, in ``consumer_cpu_s``)."""
    import zmq

    from common.config import ServerConfig, TrainerConfig, WorkerModeConfig
    from common.rundirs import make_run_dir
    from deploy.processes import ProcessGroup
    from deploy.server_group import shutdown_servers
    from deploy.worker_mode import start_servers
    from partition.layout import PartitionSetMeta
    from trainer_client.feature_cache import FeatureCache
    from trainer_client.loader import DistNodeDataLoader
    from trainer_client.train import make_pool, make_ring

    meta = PartitionSetMeta.load(parts)
    wcfg = WorkerModeConfig(
        parts=str(parts), servers_per_part=servers_per_part,
        startup_timeout_s=startup_timeout_s, shutdown_timeout_s=shutdown_timeout_s,
        server=ServerConfig(num_workers=server_workers, sampler_procs=sampler_procs,
                            max_queue=max(64, inflight), seed=seed,
                            malloc_retain_mb=malloc_retain_mb))
    wcfg.validate()
    sock_dir = make_run_dir()
    group = ProcessGroup()
    servers: list[tuple[str, str]] = []
    token = ""
    pool = ring = None
    result: dict = {}
    ctx = zmq.Context()
    try:
        t_spawn = time.perf_counter()
        # start_servers gives the servers worker-mode's environment (OMP_WAIT_POLICY=PASSIVE
        # unless set; deploy/worker_mode.py's child_env)
        cluster_file, servers, token = start_servers(wcfg, group, str(parts),
                                                     meta.num_parts, sock_dir)
        startup_s = time.perf_counter() - t_spawn
        endpoints = [ep for _, ep in servers]
        server_procs = [psutil.Process(c.pid) for c in group.children]
        tcfg = TrainerConfig(cluster=str(cluster_file), fanouts=list(fanouts),
                             batch_size=batch_size, eval_batch_size=batch_size,
                             max_inflight=inflight, shm_ring=shm_ring, seed=seed,
                             device="cpu", progress=False)
        tcfg.validate()
        pool = make_pool(tcfg)
        info = pool.info()
        ring = make_ring(tcfg, info, torch.device("cpu"))
        seeds = pool.seeds("train")
        if seeds.numel() == 0:
            raise DataPathError(f"{parts} has no training seeds")
        cache = (FeatureCache.fill(pool, info.num_parts, info.num_nodes, cache_ratio, "",
                                   torch.device("cpu")) if cache_ratio > 0 else None)
        loader = DistNodeDataLoader(
            pool, seeds, info.node_offsets, fanouts=list(fanouts), batch_size=batch_size,
            shuffle=True, seed=seed, max_inflight=inflight, device="cpu", ring=ring,
            deterministic=tcfg.deterministic_sampling, cache=cache, cache_ratio=cache_ratio)
        with _torch_threads(num_threads):
            got = _consume_mfgserve(loader, num_batches, warmup,
                                    lambda: (_cpu_seconds(server_procs), _own_cpu(),
                                             _stats(ctx, endpoints), _faults(server_procs),
                                             _faults([psutil.Process()], False)))
        (srv0, own0, st0, sf0, of0), (srv1, own1, st1, sf1, of1) = (got.pop("before"),
                                                                    got.pop("after"))
        server_cpu = _cpu_delta(srv0, srv1)
        consumer_cpu = own1 - own0
        busy = _busy_s(st0, st1)
        busy_s = sum(busy[k] for k in _BUSY)
        elapsed, n_seeds = got["elapsed_s"], got["seeds"]
        configured = len(servers) * (sampler_procs or server_workers)
        result = {
            "side": "mfgserve", "servers": len(servers), "parts": meta.num_parts,
            "servers_per_part": servers_per_part, "server_workers": server_workers,
            "sampler_procs": sampler_procs, "inflight": inflight, "shm_ring": ring is not None,
            "cache_ratio": cache_ratio,
            "cached_nodes": cache.num_cached if cache is not None else 0,
            # over every batch the loader decoded (warm-up included): rows filled in from it
            "cache_rows_per_batch": round(
                (cache.rows_served if cache is not None else 0) / max(loader.stats.batches, 1),
                1),
            **_throughput(got, num_batches),
            "configured_sampler_cores": configured,
            "server_cpu_s": round(server_cpu, 3),
            "server_cores_busy": round(server_cpu / max(elapsed, 1e-9), 3),
            "seeds_per_sampler_cpu_s": round(n_seeds / max(server_cpu, 1e-9), 1),
            "seeds_per_configured_core": round(n_seeds / max(elapsed, 1e-9) / configured, 1),
            "server_busy_s": round(busy_s, 3),
            "server_stage_s": {k: round(busy[k], 3) for k in _BUSY},
            "seeds_per_server_busy_s": round(n_seeds / max(busy_s, 1e-9), 1),
            "consumer_cpu_s": round(consumer_cpu, 3), "touch_s": round(got["touch_s"], 4),
            # in the timed window: pages the servers (and the consumer) faulted in; major
            # ones were read from disk (a partition file out of the page cache)
            "server_faults": _faults_delta(sf0, sf1), "consumer_faults": _faults_delta(of0, of1),
            "total_cpu_s": round(server_cpu + consumer_cpu, 3),
            "seeds_per_total_cpu_s": round(n_seeds / max(server_cpu + consumer_cpu, 1e-9), 1),
            "replies_in_ring": loader.stats.ring_hits,
            "requests_without_slot": loader.stats.ring_misses,
            "loader_wait_s": round(loader.stats.wait_s, 3),
            "startup_s": round(startup_s, 3),
        }
    finally:
        if pool is not None:
            pool.close()
        if ring is not None:
            ring.close()
        ctx.term()
        t_stop = time.perf_counter()
        group.teardown(shutdown_timeout_s, polite=lambda: shutdown_servers(servers, token))
        shutil.rmtree(sock_dir, ignore_errors=True)
    codes = [c.proc.returncode for c in group.children]
    clean = bool(codes) and all(c == 0 for c in codes) and group.escalation in ("none",
                                                                                 "polite")
    result.update({"exit_codes": codes, "teardown": group.escalation,
                   "teardown_s": round(time.perf_counter() - t_stop, 3), "clean_exit": clean})
    return result


def _consume_mfgserve(loader, num_batches: int, warmup: int, snapshot) -> dict:
    """Iterate epochs of ``loader`` until ``warmup + num_batches`` batches; touch each."""
    total = warmup + num_batches
    seen = seeds = input_nodes = feat_bytes = 0
    check = 0.0
    before = after = None
    t0 = time.perf_counter()
    elapsed = touch_s = 0.0
    epoch = 0
    while seen < total:
        loader.set_epoch(epoch)
        for in_nodes, out_nodes, mfg in loader:
            x = mfg[0].srcdata["feat"]
            y = mfg[-1].dstdata["label"]
            t_touch = time.perf_counter()
            check += float(x.sum()) + float(y.sum())  # the features and labels, touched
            seen += 1
            if seen == warmup:
                before, t0, touch_s = snapshot(), time.perf_counter(), 0.0
            elif seen > warmup:
                touch_s += time.perf_counter() - t_touch
                seeds += out_nodes.numel()
                input_nodes += in_nodes.numel()
                feat_bytes += x.numel() * x.element_size() + y.numel() * y.element_size()
            del x, y, mfg, in_nodes, out_nodes  # a ring slot is free once its views are
            if seen >= total:
                # timed to here: leaving the loop closes the loader, which then waits for
                # the requests still in flight (its ring slots)
                elapsed = time.perf_counter() - t0
                after = snapshot()
                break
        epoch += 1
    if before is None:  # warmup 0
        raise DataPathError("warmup must be >= 1 (the timed window starts after it)")
    return {"batches": num_batches, "seeds": seeds, "input_nodes": input_nodes,
            "feat_bytes": feat_bytes, "elapsed_s": elapsed, "touch_s": touch_s,
            "before": before, "after": after,
            "checksum_finite": bool(torch.isfinite(torch.tensor(check)))}


def _throughput(got: dict, num_batches: int) -> dict:
    el = max(got["elapsed_s"], 1e-9)
    return {"batches": num_batches, "seeds": got["seeds"], "elapsed_s": round(el, 3),
            "batches_per_s": round(num_batches / el, 3),
            "seeds_per_s": round(got["seeds"] / el, 1),
            "input_nodes_per_batch": round(got["input_nodes"] / max(num_batches, 1), 1),
            "feat_mb_per_s": round(got["feat_bytes"] / el / 1e6, 2)}


# ------------------------------------------------------------------ DGL
def measure_dgl(fg, *, fanouts: list[int], batch_size: int, num_batches: int,
                num_workers: int, warmup: int = 3, seed: int = 0,
                num_threads: int | None = None) -> dict:
    """DGL's DataLoader (NeighborSampler prefetching feat + label, as
    benchmarks.dgl_pipeline.sample_only_dgl) over ``fg``'s training seeds; the same touch."""
    from common.dgl_compat import import_dgl

    dgl = import_dgl()
    torch.manual_seed(seed)
    dgl.seed(seed)
    sampler = dgl.dataloading.NeighborSampler(
        list(fanouts), prefetch_node_feats=["feat"], prefetch_labels=["label"])
    loader = dgl.dataloading.DataLoader(
        fg.g, fg.train, sampler, batch_size=batch_size, shuffle=True, drop_last=False,
        num_workers=num_workers, persistent_workers=num_workers > 0)
    me = psutil.Process()

    def workers() -> dict[int, float]:
        return _cpu_seconds(me.children(recursive=False))

    def sampler_faults() -> dict[int, tuple[int, int]]:
        if num_workers == 0:
            return _faults([me], descendants=False)
        return _faults(me.children(recursive=False))

    total = warmup + num_batches
    seen = seeds = input_nodes = feat_bytes = 0
    check = 0.0
    t0 = time.perf_counter()
    w0 = w1 = {}
    f0 = f1 = {}
    own0 = own1 = elapsed = touch_s = 0.0
    with _torch_threads(num_threads):
        while seen < total:
            for in_nodes, out_nodes, blocks in loader:
                x = blocks[0].srcdata["feat"]
                y = blocks[-1].dstdata["label"]
                t_touch = time.perf_counter()
                check += float(x.sum()) + float(y.sum())
                seen += 1
                if seen == warmup:
                    w0, own0, f0 = workers(), _own_cpu(), sampler_faults()
                    t0, touch_s = time.perf_counter(), 0.0
                elif seen > warmup:
                    touch_s += time.perf_counter() - t_touch
                    seeds += out_nodes.numel()
                    input_nodes += in_nodes.numel()
                    feat_bytes += x.numel() * x.element_size() + y.numel() * y.element_size()
                if seen >= total:
                    elapsed = time.perf_counter() - t0
                    w1, own1, f1 = workers(), _own_cpu(), sampler_faults()
                    break
    del loader
    gc.collect()  # persistent workers end with their iterator
    main_cpu, worker_cpu = own1 - own0, _cpu_delta(w0, w1)
    sampler_cpu = main_cpu if num_workers == 0 else worker_cpu
    got = {"seeds": seeds, "input_nodes": input_nodes, "feat_bytes": feat_bytes,
           "elapsed_s": elapsed}
    return {
        "side": "dgl", "num_workers": num_workers, **_throughput(got, num_batches),
        "sampler_cpu_s": round(sampler_cpu, 3),
        "sampler_cpu_of": "main process" if num_workers == 0 else "worker processes",
        "sampler_cores_busy": round(sampler_cpu / max(elapsed, 1e-9), 3),
        "seeds_per_sampler_cpu_s": round(seeds / max(sampler_cpu, 1e-9), 1),
        "main_cpu_s": round(main_cpu, 3), "worker_cpu_s": round(worker_cpu, 3),
        "touch_s": round(touch_s, 4),
        "sampler_faults": _faults_delta(f0, f1),  # of the processes in sampler_cpu_of
        "total_cpu_s": round(main_cpu + worker_cpu, 3),
        "seeds_per_total_cpu_s": round(seeds / max(main_cpu + worker_cpu, 1e-9), 1),
        "checksum_finite": bool(torch.isfinite(torch.tensor(check))),
    }


# ------------------------------------------------------------------ the step
# Timed batches per row. 30 (until session 40) left each side's window at 0.5-2 s on 2 cores:
# four paired runs of one code read the per-core ratio 1.75-2.49 on RMAT; with 90, 1.95-2.44
# and products 2.34-2.64 (docs/benchmarks.md, "Issue 14, session 40"). 90 + the warm-up fit
# one epoch of benchmarks.run's default graphs at --train-frac 0.1 (98 batches).
DEFAULT_BATCHES = 90


@dataclasses.dataclass
class Settings:
    """What the step needs, from benchmarks.run's Namespace or this module's CLI."""

    fanouts: list[int]
    batch_size: int
    num_batches: int
    warmup: int
    servers: list[int]
    server_workers: int
    sampler_procs: int
    inflight: int
    shm_ring: bool
    dgl_workers: list[int]
    seed: int
    num_threads: int | None
    shutdown_timeout_s: float = 20.0
    malloc_retain_mb: int = DEFAULT_RETAIN_MB  # the servers'; the consumer's is its process's
    cache_ratio: float = 0.0  # > 0: one more 1-server row with the trainer's feature cache
    rounds: int = 1  # every row this many times, alternating which side goes first

    @classmethod
    def from_args(cls, args) -> Settings:
        g = getattr
        max_batches = g(args, "max_batches", None)
        num_batches = g(args, "num_batches", None) or max_batches or DEFAULT_BATCHES
        return cls(
            fanouts=list(args.fanouts), batch_size=int(args.batch_size),
            num_batches=int(num_batches), warmup=int(g(args, "warmup", 3) or 3),
            servers=list(g(args, "datapath_servers", None) or [1, 2]),
            server_workers=int(g(args, "server_workers", 2) or 2),
            sampler_procs=int(g(args, "worker_sampler_procs", 0) or 0),
            inflight=int(g(args, "inflight", 4) or 4),
            shm_ring=bool(g(args, "shm_ring", True)),
            dgl_workers=list(g(args, "dgl_workers", [0, 1])),
            seed=int(g(args, "seed", 0) or 0), num_threads=g(args, "num_threads", None) or None,
            shutdown_timeout_s=float(g(args, "shutdown_timeout_s", 20.0) or 20.0),
            malloc_retain_mb=int(g(args, "malloc_retain_mb", DEFAULT_RETAIN_MB)),
            cache_ratio=float(g(args, "datapath_cache_ratio", 0.0) or 0.0),
            rounds=int(g(args, "rounds", 1) or 1))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> Settings:
        """From this module's own command line (:func:`build_parser`; :func:`child_argv`
        writes one)."""
        return cls(fanouts=args.fanouts, batch_size=args.batch_size,
                   num_batches=args.num_batches, warmup=args.warmup, servers=args.servers,
                   server_workers=args.server_workers, sampler_procs=args.sampler_procs,
                   inflight=args.inflight, shm_ring=args.shm_ring,
                   dgl_workers=args.dgl_workers, seed=args.seed,
                   num_threads=args.num_threads or None,
                   shutdown_timeout_s=args.shutdown_timeout_s,
                   malloc_retain_mb=args.malloc_retain_mb,
                   cache_ratio=args.datapath_cache_ratio, rounds=args.rounds)


def _best(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key)]
    return max(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _round_ratios(results: list[dict]) -> dict:
    """One round's ratios: mfgserve / that round's best DGL row, per server count."""
    dgl = [r for r in results if r.get("side") == "dgl"]
    out: dict = {}
    best = {k: _best(dgl, k) for k in _RATIO_KEYS}
    for r in results:
        if r.get("side") != "mfgserve":
            continue
        n = f"{r['servers']}srv" + ("_cache" if r.get("cache_ratio") else "")
        out[f"per_core_{n}"] = _ratio(r["seeds_per_sampler_cpu_s"],
                                      best["seeds_per_sampler_cpu_s"])
        out[f"per_total_cpu_{n}"] = _ratio(r["seeds_per_total_cpu_s"],
                                           best["seeds_per_total_cpu_s"])
        out[f"seeds_per_s_{n}"] = _ratio(r["seeds_per_s"], best["seeds_per_s"])
    out["dgl_best"] = best
    return out


_RATIO_KEYS = ("seeds_per_sampler_cpu_s", "seeds_per_total_cpu_s", "seeds_per_s")


def ratios(results: dict[str, dict]) -> dict:
    """mfgserve / best DGL per server count: per sampler CPU-s, per total CPU-s, seeds/s.

    Each round's ratio pairs the rows measured in that round (``round`` in each result; 1
    where absent). With one round these are that round's ratios; with more, each ratio is
    the **median of the rounds' ratios**, the rounds' values listed under ``<key>_rounds``,
    and ``dgl_best`` holds the median of each round's best DGL figure."""
    by_round: dict[int, list[dict]] = {}
    for r in results.values():
        by_round.setdefault(int(r.get("round", 1)), []).append(r)
    per = [_round_ratios(by_round[k]) for k in sorted(by_round)]
    if len(per) <= 1:
        return per[0] if per else {"dgl_best": {k: None for k in _RATIO_KEYS}}
    out: dict = {}
    for k in dict.fromkeys(k for p in per for k in p if k != "dgl_best"):
        vals = [p[k] for p in per if p.get(k) is not None]
        out[k] = round(statistics.median(vals), 3) if vals else None
        out[f"{k}_rounds"] = vals
    out["dgl_best"] = {}
    for k in _RATIO_KEYS:
        vals = [p["dgl_best"][k] for p in per if p["dgl_best"].get(k)]
        out["dgl_best"][k] = round(statistics.median(vals), 1) if vals else None
    return out


def round_suffix(r: int) -> str:
    """The result-name suffix of round ``r``: "" for round 1, ``_r2``, ``_r3``, ..."""
    return "" if r == 1 else f"_r{r}"


def measure(parts: str | Path, s: Settings, log=None) -> tuple[dict, dict]:
    """Every measurement of this step, ``s.rounds`` times: (results by name, errors by name).
    Round 1 runs mfgserve's rows first, then DGL's; round 2 DGL's first, and so on, so that
    each round pairs the two sides measured back to back. Round r > 1's results are named
    ``<name>_r<r>``; every result carries its ``round``."""
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    loaded: list = []  # DGL's full graph, loaded at its first use and kept for every round

    def note(msg: str) -> None:
        if log is not None:
            log(msg)

    def full_graph():
        if not loaded:
            from benchmarks.dgl_pipeline import load_full_graph

            loaded.append(load_full_graph(parts))
        return loaded[0]

    for r in range(1, s.rounds + 1):
        if s.rounds > 1:
            note(f"round {r} of {s.rounds}, {'mfgserve' if r % 2 else 'DGL'} first")
        sides = [_measure_ours, _measure_dgl] if r % 2 else [_measure_dgl, _measure_ours]
        for side in sides:
            side(parts, s, r, results, errors, note, full_graph)
    loaded.clear()
    gc.collect()
    return results, errors


def _measure_ours(parts, s: Settings, r: int, results: dict, errors: dict, note,
                  full_graph) -> None:
    """Round ``r``'s mfgserve rows: each server count, then the trainer-cache row."""
    runs = [(n, 0.0) for n in s.servers] + ([(1, s.cache_ratio)] if s.cache_ratio > 0 else [])
    for n, cache_ratio in runs:
        name = (f"{STEP}-mfgserve-{n}srv" + ("-cache" if cache_ratio else "")
                + round_suffix(r))
        note(f"{name}: {n} server(s) x {s.sampler_procs or s.server_workers} samplers"
             + (f", trainer feature cache {cache_ratio:g}" if cache_ratio else ""))
        try:
            res = results[name] = measure_mfgserve(
                parts, servers_per_part=n, fanouts=s.fanouts, batch_size=s.batch_size,
                num_batches=s.num_batches, warmup=s.warmup, server_workers=s.server_workers,
                sampler_procs=s.sampler_procs, inflight=s.inflight, shm_ring=s.shm_ring,
                seed=s.seed, num_threads=s.num_threads,
                shutdown_timeout_s=s.shutdown_timeout_s, malloc_retain_mb=s.malloc_retain_mb,
                cache_ratio=cache_ratio)
            res["round"] = r
            if not res["clean_exit"]:  # the figures stand; the unclean exit is an error
                errors[name] = (f"servers did not exit cleanly: exit codes "
                                f"{res['exit_codes']}, teardown {res['teardown']} after "
                                f"{res['teardown_s']} s (a Shutdown message gets half of "
                                "--shutdown-timeout-s)")
        except Exception as e:  # recorded; the other measurements still run
            errors[name] = f"{type(e).__name__}: {e}"
            note(traceback.format_exc())


def _measure_dgl(parts, s: Settings, r: int, results: dict, errors: dict, note,
                 full_graph) -> None:
    """Round ``r``'s DGL rows: each ``--dgl-workers`` value."""
    for w in s.dgl_workers:
        name = f"{STEP}-dgl-w{w}" + round_suffix(r)
        note(f"{name}: DGL DataLoader num_workers={w}")
        try:
            res = results[name] = measure_dgl(
                full_graph(), fanouts=s.fanouts, batch_size=s.batch_size,
                num_batches=s.num_batches, num_workers=w, warmup=s.warmup, seed=s.seed,
                num_threads=s.num_threads)
            res["round"] = r
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
            note(traceback.format_exc())


def child_argv(parts: str | Path, s: Settings, out: str | Path) -> list[str]:
    """``python -m benchmarks.datapath`` with every setting of ``s``, writing JSON to ``out``."""
    def csv(v: list[int]) -> str:
        return ",".join(map(str, v))

    return [sys.executable, "-m", "benchmarks.datapath", "--parts", str(parts),
            "--fanouts", csv(s.fanouts), "--batch-size", str(s.batch_size),
            "--num-batches", str(s.num_batches), "--warmup", str(s.warmup),
            "--servers", csv(s.servers), "--server-workers", str(s.server_workers),
            "--sampler-procs", str(s.sampler_procs), "--inflight", str(s.inflight),
            "--shm-ring" if s.shm_ring else "--no-shm-ring",
            f"--dgl-workers={csv(s.dgl_workers)}",
            "--shutdown-timeout-s", repr(s.shutdown_timeout_s),
            "--datapath-cache-ratio", repr(s.cache_ratio), "--rounds", str(s.rounds),
            "--seed", str(s.seed), "--num-threads", str(s.num_threads or 0),
            "--malloc-retain-mb", str(s.malloc_retain_mb), "--out", str(out)]


#: seconds ``run_step``'s child process may take (90 batches x 5 rows x 2 rounds take 2-4 min)
CHILD_TIMEOUT_S = 3600.0


def run_step(parts: Path, args) -> dict[str, dict]:
    """benchmarks.run's step: ``{name: figures}`` for ``datapath-mfgserve-{1,2}srv``,
    ``datapath-dgl-w{0,1}`` and ``datapath-ratios``. ``args`` fields used: fanouts,
    batch_size, max_batches (timed batches; default DEFAULT_BATCHES), seed, server_workers,
    inflight, shm_ring, num_threads; optional: dgl_workers (default 0,1), worker_sampler_procs
    (default 0), datapath_servers (default 1,2), warmup (default 3), rounds (default 1).

    Measured in a fresh process (``python -m benchmarks.datapath``, its progress on this
    stderr), as the module's own command measures: in benchmarks.run's process, after the
    ``step`` module had trained both models there, DGL's in-process sampler (``num_workers``
    0) read 20-61 % more seeds per CPU-second and took 43,000 page faults in 90 products
    batches instead of 0.65-1.13 million: glibc's heap, grown by the training, served its
    tensors (docs/benchmarks.md, "Issue 14, session 51"); a loader without a model, what
    this row stands for, has no such heap. A measurement that fails raises
    :class:`DataPathError` (after the others ran) naming every error; its ``results``
    attribute holds what did run."""
    import subprocess
    import tempfile

    s = Settings.from_args(args)
    with tempfile.TemporaryDirectory(prefix="mfgserve-datapath-") as tmp:
        out = Path(tmp) / "datapath.json"
        try:
            proc = subprocess.run(child_argv(parts, s, out), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DataPathError(f"python -m benchmarks.datapath ran past {CHILD_TIMEOUT_S:.0f} "
                                "s and was killed") from None
        if not out.exists():
            raise DataPathError(f"python -m benchmarks.datapath exited {proc.returncode} "
                                "without its JSON summary (its error is in the log above)")
        summary = json.loads(out.read_text())
    results, errors = summary["results"], summary["errors"]
    res = {**results, f"{STEP}-ratios": summary["ratios"]}
    if errors or proc.returncode != 0:
        err = DataPathError("; ".join(f"{k}: {v}" for k, v in errors.items())
                            or f"python -m benchmarks.datapath exited {proc.returncode}")
        err.results = res  # type: ignore[attr-defined]  # what did run, for the caller
        raise err
    return res


# ------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.datapath",
        description="Data path per sampler core: a trainer-side consumer with no model "
                    "(features summed, labels read) pulls batches from 1 and 2 real sampler "
                    "servers through the trainer loader (shared-memory ring on), vs DGL's "
                    "DataLoader sample + gather; seeds/s and seeds per sampler CPU-second. "
                    "Table on stderr, JSON as the last stdout line.")
    p.add_argument("--parts", required=True, help="partition set directory (partition-ogbn)")
    p.add_argument("--fanouts", type=int_list, default=[15, 10, 5],
                   help="neighbours per layer, input layer first (default 15,10,5)")
    p.add_argument("--batch-size", type=int, default=1024, help="seeds per batch (1024)")
    p.add_argument("--num-batches", type=int, default=DEFAULT_BATCHES,
                   help=f"timed batches per measurement, after the warm-up ({DEFAULT_BATCHES}: "
                        "shorter windows scatter the per-core ratio widely on a shared VM)")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first (3, >= 1)")
    p.add_argument("--servers", type=int_list, default=[1, 2],
                   help="server counts to measure: replicas of each part, as worker-mode "
                        "--servers-per-part (default 1,2)")
    p.add_argument("--server-workers", type=int, default=2,
                   help="sampling threads per server, sampler-server --num-workers (2)")
    p.add_argument("--sampler-procs", type=int, default=0,
                   help="sampler processes per server instead of threads (0: threads)")
    p.add_argument("--inflight", type=int, default=4,
                   help="requests in flight, the trainer's --max-inflight (4)")
    p.add_argument("--shm-ring", action=argparse.BooleanOptionalAction, default=True,
                   help="the trainer's shared-memory ring for features (default: on, as a "
                        "same-host trainer has it)")
    p.add_argument("--dgl-workers", type=int_list, default=[0, 1],
                   help="DGL DataLoader num_workers values (default 0,1; empty: no DGL)")
    p.add_argument("--shutdown-timeout-s", type=float, default=20.0,
                   help="seconds for the servers to exit: a Shutdown message, after half of "
                        "it SIGTERM, then SIGKILL; anything but a clean exit to the Shutdown "
                        "message is an error (default 20)")
    p.add_argument("--datapath-cache-ratio", type=float, default=0.0,
                   help="> 0: one more 1-server measurement with the trainer's feature cache "
                        "holding this share of the hottest nodes (the trainer's "
                        "--cache-ratio; rows filled in by the consumer, counted in its CPU); "
                        "ratios suffixed _cache (default 0: none)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every row this many times, mfgserve's rows first in odd "
                        "rounds and DGL's first in even ones; each ratio is then the median "
                        "of the rounds' ratios, each pairing rows measured back to back, so "
                        "that a shared machine's drift moves both sides of a round alike "
                        "(default 1; later rounds' results are named <name>_r<round>)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--num-threads", type=int, default=0,
                   help="torch threads of this (consumer) process; 0 keeps torch's default")
    p.add_argument("--out", help="also write the JSON summary to this file")
    add_malloc_arg(p)
    return p


def _check(args: argparse.Namespace) -> None:
    from partition.layout import PartitionFormatError, PartitionSetMeta

    for name in ("batch_size", "num_batches", "warmup", "server_workers", "inflight",
                 "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.datapath_cache_ratio <= 1.0:
        raise SystemExit("--datapath-cache-ratio must be in [0, 1]")
    if args.sampler_procs < 0 or any(w < 0 for w in args.dgl_workers):
        raise SystemExit("--sampler-procs and --dgl-workers must be >= 0")
    if not args.servers or any(n < 1 for n in args.servers):
        raise SystemExit("--servers needs server counts >= 1, e.g. 1,2")
    if not args.fanouts or any(f == 0 or f < -1 for f in args.fanouts):
        raise SystemExit("--fanouts: positive integers (or -1 for all), e.g. 15,10,5")
    try:
        PartitionSetMeta.load(args.parts)
    except PartitionFormatError as e:
        raise SystemExit(f"--parts {args.parts}: {e}") from e


def table(summary: dict) -> None:
    err = sys.stderr
    print("\ndata path per sampler core (seeds per CPU-second of the sampling processes)",
          file=err)
    print(f"{'measurement':<34}{'seeds/s':>10}{'batch/s':>9}{'samp cpu':>10}"
          f"{'seeds/samp-cpu-s':>18}{'seeds/total-cpu-s':>19}", file=err)
    for name, r in summary["results"].items():
        print(f"{name:<34}{r['seeds_per_s']:>10.0f}{r['batches_per_s']:>9.2f}"
              f"{r.get('server_cpu_s', r.get('sampler_cpu_s', 0.0)):>10.2f}"
              f"{r['seeds_per_sampler_cpu_s']:>18.0f}{r['seeds_per_total_cpu_s']:>19.0f}",
              file=err)
    for k, v in summary["ratios"].items():
        if k != "dgl_best":
            print(f"  ratio {k}: {v}", file=err)
    for k, v in summary["errors"].items():
        print(f"  ERROR {k}: {v}", file=err)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check(args)
    from benchmarks.report import logger

    apply_malloc(args.malloc_retain_mb)
    s = Settings.from_cli(args)
    results, errors = measure(args.parts, s, logger(STEP))
    summary = {"config": {**dataclasses.asdict(s), "parts": str(args.parts),
                          "cores": os.cpu_count()},
               "results": results, "ratios": ratios(results), "errors": errors}
    table(summary)
    line = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line, flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
