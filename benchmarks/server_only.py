"""One mfgserve sampler server alone: sample + gather throughput, no training.

A real ``sampler_server.main`` process serves part 0 of a partition set (with a cluster file
and one server per part when the set has several parts; only part 0 is asked). This process
is the client: it keeps ``inflight`` :class:`~common.messages.SampleRequest` s outstanding on
one :class:`~common.rpc.RpcChannel` until ``num_batches`` replies (full MFG + input features +
seed labels) have arrived. Seeds are part 0's training seeds, shuffled, ``batch_size`` a batch.
Each request carries a sample seed, as a trainer's do by default (``--deterministic-sampling``:
the server's seeded sampler, sampler_server/seeded_sampler.py); ``sampling="unseeded"`` sends
none (DGL's C++ sampler, as ``--no-deterministic-sampling`` trainers get).

Figures (after ``warmup`` untimed replies): ``batches_per_s``, ``seeds_per_s``, ``mb_per_s``
(reply bytes received, 10^6 bytes/s) and ``input_nodes_per_batch``; ``server_stats`` holds the
server's own per-stage seconds (sample / gather / encode) over all requests. The servers are
stopped with a ``Shutdown`` message and their exit codes are checked (``exit_codes``,
``clean_exit``); SIGTERM / SIGKILL only if they do not exit in time (``teardown``).

Run alone: ``python -m benchmarks.server_only --parts DIR``; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from common.cluster import ClusterSpec
from common.messages import (
    MFGReply,
    Ping,
    Pong,
    SampleRequest,
    SeedsReply,
    SeedsRequest,
    Shutdown,
    StatsReply,
    StatsRequest,
    derive_seed,
)
from common.rpc import RpcChannel, expect
from common.sampled_mfg import FEAT_RING
from common.shm_ring import ShmRing, max_input_rows
from common.sockets import new_token_file
from common.stats import ServerStats
from deploy.processes import ProcessGroup
from partition.layout import PartitionSetMeta

SAMPLING = ("seeded", "unseeded")


class ServerBenchError(RuntimeError):
    """A server did not start, failed a request, or did not exit cleanly."""


def _wait_ready(group: ProcessGroup, ready_files: list[Path], timeout_s: float) -> list[str]:
    """Endpoints written by each server once serving; fail fast if one exits."""
    deadline = time.monotonic() + timeout_s
    for child, ready in zip(group.children, ready_files, strict=True):
        while not ready.is_file():
            if child.proc.poll() is not None:
                raise ServerBenchError(
                    f"{child.name} exited with code {child.proc.returncode} during startup; "
                    f"its last output:\n{child.last_lines()}")
            if time.monotonic() > deadline:
                raise ServerBenchError(f"{child.name} did not become ready within "
                                       f"{timeout_s:.0f}s; raise --startup-timeout-s")
            time.sleep(0.05)
    return [f.read_text().strip() for f in ready_files]


def _batches(seeds: torch.Tensor, batch_size: int, seed: int):
    """Endless stream of shuffled batches: each epoch a fresh permutation, unique seeds."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = seeds[torch.randperm(seeds.numel(), generator=g)]
        yield from torch.split(perm, batch_size)


def _spawn_servers(group: ProcessGroup, parts_dir: str | Path, num_parts: int, run_dir: Path,
                   *, server_workers: int, inflight: int, max_message_mb: int, seed: int,
                   sampler_procs: int) -> tuple[list[Path], str]:
    """Start one ``sampler_server.main`` per part (with a cluster file when there are several
    parts); the files each writes once serving, and the shutdown token."""
    cluster = ClusterSpec({p: [f"ipc://{run_dir}/p{p}.sock"] for p in range(num_parts)})
    cluster_file = run_dir / "cluster.yaml"
    cluster.write(cluster_file)
    ready_files = [run_dir / f"ready-{p}" for p in range(num_parts)]
    token = new_token_file(run_dir / "shutdown.token")
    for p, ep in cluster.all_endpoints():
        argv = [sys.executable, "-m", "sampler_server.main", "--parts", str(parts_dir),
                "--part-id", str(p), "--bind", ep, "--ready-file", str(ready_files[p]),
                "--num-workers", str(server_workers), "--max-queue", str(max(64, inflight)),
                "--max-message-mb", str(max_message_mb), "--seed", str(seed + p),
                "--sampler-procs", str(sampler_procs),
                "--shutdown-token-file", str(run_dir / "shutdown.token")]
        if num_parts > 1:
            argv += ["--cluster", str(cluster_file)]
        group.spawn(f"server p{p}", argv)
    return ready_files, token


def _train_seeds(ch: RpcChannel, ep: str, parts_dir: str | Path) -> torch.Tensor:
    """Part 0's training seeds, after a Ping."""
    expect(ch.call(Ping()), Pong, ep)
    train = expect(ch.call(SeedsRequest(split="train")), SeedsReply, ep).seeds.clone()
    if train.numel() == 0:
        raise ServerBenchError(f"part 0 of {parts_dir} has no training seeds to sample")
    return train


@dataclass
class _Streamed:
    """What the timed replies (after the warm-up) brought."""

    seeds: int = 0
    input_nodes: int = 0
    in_ring: int = 0  # replies (warm-up included) whose features the server put in the ring
    elapsed_s: float = 0.0
    nbytes: int = 0


def _stream(ch: RpcChannel, ep: str, stream: Iterator[torch.Tensor], fanouts: list[int],
            ring: ShmRing | None, total: int, warmup: int, inflight: int,
            sample_seed: int = -1) -> _Streamed:
    """Keep ``inflight`` requests outstanding until ``total`` replies have arrived; timing
    starts once the first ``warmup`` replies are in. ``sample_seed`` >= 0: request i carries
    the sample seed ``derive_seed(sample_seed, i)``; -1: none (unseeded sampling)."""
    slots: dict[int, int] = {}

    def send(index: int) -> None:
        slot = ring.acquire() if ring is not None else None
        seed = derive_seed(sample_seed, index) if sample_seed >= 0 else -1
        rid = ch.send(SampleRequest(
            seeds=next(stream), fanouts=list(fanouts), sample_seed=seed,
            slot=ring.ref(slot) if slot is not None else None))  # type: ignore[union-attr]
        if slot is not None:
            slots[rid] = slot

    got = _Streamed()
    sent = received = bytes0 = 0
    t0 = time.perf_counter()
    while sent < min(inflight, total):
        send(sent)
        sent += 1
    while received < total:
        msg, rid = ch.recv(waiting_for="a sampled MFG")
        mfg = expect(msg, MFGReply, ep).mfg
        feat = mfg.only.feat
        if feat.slot_error:
            raise ServerBenchError(f"the server could not use the ring: {feat.slot_error}")
        if rid in slots:
            got.in_ring += feat.via == FEAT_RING
            ring.release(slots.pop(rid))  # type: ignore[union-attr]
        received += 1
        if received == warmup:  # timing starts once the warm-up replies are in
            t0, bytes0 = time.perf_counter(), ch.bytes_received
        elif received > warmup:
            got.seeds += mfg.output_nodes.numel()
            got.input_nodes += mfg.input_nodes.numel()
        del mfg, feat
        if sent < total:
            send(sent)
            sent += 1
    got.elapsed_s = time.perf_counter() - t0
    got.nbytes = ch.bytes_received - bytes0
    return got


_SERVER_STATS = ("sample_requests", "sample_s", "gather_s", "remote_s", "encode_s", "busy",
                 "errors", "bytes_out", "sampler_processes")


def _server_stats(values: Mapping[str, float]) -> dict:
    """The STATS reply's counters kept in the result: seconds rounded, counts as ints."""
    stats = ServerStats.from_wire(values).to_wire()
    return {k: (round(v, 4) if k.endswith("_s") else int(v)) for k, v in stats.items()
            if k in _SERVER_STATS or k.startswith("mem_")}


def _figures(got: _Streamed, num_batches: int) -> dict:
    elapsed = max(got.elapsed_s, 1e-9)
    return {"batches": num_batches, "seeds": got.seeds, "elapsed_s": round(got.elapsed_s, 3),
            "batches_per_s": round(num_batches / elapsed, 3),
            "seeds_per_s": round(got.seeds / elapsed, 1),
            "mb_per_s": round(got.nbytes / elapsed / 1e6, 2),
            "input_nodes_per_batch": round(got.input_nodes / max(num_batches, 1), 1)}


def measure_server(parts_dir: str | Path, fanouts: list[int], batch_size: int,
                   num_batches: int, inflight: int = 4, server_workers: int = 2,
                   warmup: int = 2, seed: int = 0, startup_timeout_s: float = 120.0,
                   request_timeout_s: float = 120.0, max_message_mb: int = 512,
                   shm_ring: bool = True, sampler_procs: int = 0,
                   sampling: str = "seeded") -> dict:
    """Start the server(s), stream ``num_batches`` sampled batches, stop them; see module doc.
    ``shm_ring``: offer the server ring slots as a co-located trainer does (features are
    gathered into this process's shared memory instead of sent through the socket).
    ``sampling``: ``"seeded"`` (a sample seed per request, a trainer's default) or
    ``"unseeded"``."""
    if sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
    meta = PartitionSetMeta.load(parts_dir)
    run_dir = Path(tempfile.mkdtemp(prefix="mfgserve-bench-"))
    group = ProcessGroup()
    endpoints: list[str] = []
    ctx = zmq.Context()
    ch: RpcChannel | None = None
    ring: ShmRing | None = None
    token = ""
    try:
        ready_files, token = _spawn_servers(
            group, parts_dir, meta.num_parts, run_dir, server_workers=server_workers,
            inflight=inflight, max_message_mb=max_message_mb, seed=seed,
            sampler_procs=sampler_procs)
        t_spawn = time.perf_counter()
        endpoints = _wait_ready(group, ready_files, startup_timeout_s)
        startup_s = time.perf_counter() - t_spawn
        ep = endpoints[0]
        ch = RpcChannel(ctx, ep, timeout_s=request_timeout_s, setting="--request-timeout-s",
                        max_message_bytes=max_message_mb << 20)
        stream = _batches(_train_seeds(ch, ep, parts_dir), batch_size, seed)
        if shm_ring:
            rows = max_input_rows(batch_size, fanouts, meta.num_nodes)
            ring = ShmRing(inflight, rows * meta.feat_dim * 4)
        got = _stream(ch, ep, stream, fanouts, ring, num_batches + warmup, warmup, inflight,
                      sample_seed=seed if sampling == "seeded" else -1)
        stats = expect(ch.call(StatsRequest()), StatsReply, ep).values
        result = {"parts": meta.num_parts, "servers": len(endpoints),
                  "server_workers": server_workers, "sampler_procs": sampler_procs,
                  "inflight": inflight, "sampling": sampling, **_figures(got, num_batches),
                  "shm_ring": shm_ring,
                  "replies_in_ring": got.in_ring, "startup_s": round(startup_s, 3),
                  "server_stats": _server_stats(stats)}
    finally:
        if ch is not None:
            ch.close()
        if ring is not None:
            ring.close()
        result_stop = _stop(ctx, group, endpoints, token)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
    result.update(result_stop)
    if not result["clean_exit"]:
        raise ServerBenchError(f"servers did not exit cleanly: {result_stop}")
    return result


def _stop(ctx: zmq.Context, group: ProcessGroup, endpoints: list[str], token: str,
          timeout_s: float = 10.0) -> dict:
    """Send Shutdown to every server, wait for them to exit, escalate if they do not."""
    acked = 0
    for ep in endpoints:
        ch = RpcChannel(ctx, ep, timeout_s=timeout_s, setting="shutdown timeout")
        try:
            ch.call(Shutdown(token=token), timeout_s=timeout_s)
            acked += 1
        except Exception as e:  # counted below; escalation still stops the process
            print(f"server-only: no Ack to Shutdown from {ep}: {e}", file=sys.stderr)
        finally:
            ch.close()
    group.wait_all(group.alive(), time.monotonic() + timeout_s)
    group.teardown(timeout_s)  # SIGTERM / SIGKILL only for a server still alive
    codes = [c.proc.returncode for c in group.children]
    return {"exit_codes": codes, "shutdown_acked": acked, "teardown": group.escalation,
            "clean_exit": bool(codes) and all(c == 0 for c in codes)
            and group.escalation == "none" and acked == len(endpoints)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.server_only",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", required=True, help="partition set directory")
    p.add_argument("--fanouts", default="15,10,5", help="input layer first (default 15,10,5)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--num-batches", type=int, default=40)
    p.add_argument("--inflight", type=int, default=4, help="requests kept in flight")
    p.add_argument("--server-workers", type=int, default=2, help="sampling threads per server")
    p.add_argument("--sampler-procs", type=int, default=0,
                   help="sampler processes per server (0: --server-workers threads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shm-ring", action=argparse.BooleanOptionalAction, default=True,
                   help="offer the server shared-memory slots for the features, as a "
                        "co-located trainer does (default: on)")
    p.add_argument("--sampling", choices=SAMPLING, default="seeded",
                   help="seeded: each request carries a sample seed, as a trainer's do by "
                        "default (--deterministic-sampling; the server's seeded sampler); "
                        "unseeded: none (DGL's C++ sampler, as --no-deterministic-sampling "
                        "trainers get). Default seeded")
    args = p.parse_args(argv)
    fanouts = [int(x) for x in args.fanouts.split(",")]
    result = measure_server(args.parts, fanouts, args.batch_size, args.num_batches,
                            inflight=args.inflight, server_workers=args.server_workers,
                            seed=args.seed, shm_ring=args.shm_ring,
                            sampler_procs=args.sampler_procs, sampling=args.sampling)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
