"""``worker-mode``: servers for every partition plus T trainers on this node, one command.

Steps: resolve the partition set (``--parts``; or partition ``--dataset-dir`` on the fly; or
generate the default synthetic graph), start ``servers_per_part`` sampler servers per part on
``ipc://`` endpoints in a private run directory, wait until each answers a ping, start the
trainers (DDP over a free loopback port), wait for them, with ``--infer`` run mfgserve-infer
(deploy/infer_cli.py) through the same servers on the run's best_model.pt, shut the servers
down, and print the trainers' JSON summary (plus launcher fields, and ``inference``: the
inference summary naming its files) as the last stdout line. The trainers' outputs
(metrics, checkpoints, best model, summary.json) go to the run directory named in that line:
``--run-dir``, else ``<work_dir>/runs/<UTC stamp>-<hex>`` (with ``--resume``: the newest run
there with a checkpoint; see trainer_client/run_dir.py).

Owns its process tree: children die with the launcher (PDEATHSIG), any child failing stops
the whole group with a non-zero exit naming it, SIGINT/SIGTERM shut down within
``--shutdown-timeout-s`` and then kill, and the run directory (sockets, cluster file) is
removed on every exit path. Exit codes: 0 ok, 1 a child failed (a server died, a trainer
failed: e.g. its training loss became NaN/inf, named with epoch and batch), 2 bad input,
130/143 signal.

A trainer rank that dies *after* it delivered its result (each writes a done file once rank
0's summary is written and every rank passed the final barrier) counts as finished, with a
warning naming the rank and the signal: torch's gloo teardown can abort a process at exit
(SIGABRT, "terminate called without an active exception"), which must not throw away a
finished run. The trainers avoid that crash themselves (they leave with ``os._exit``); this
is the launcher's second line of defence.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.cli import raise_on_signals, run_main
from common.cluster import ClusterSpec
from common.config import (
    GPU_TRAINER_THREADS,
    DDPConfig,
    InferConfig,
    WorkerModeConfig,
    add_config_args,
    load_config,
    to_argv,
    wants_cuda,
)
from common.errors import ConfigError
from common.jsonout import dumps_strict
from common.logs import bars_allowed
from common.rundirs import make_run_dir, remove_stale_run_dirs
from common.sockets import new_token_file
from deploy.processes import Child, ProcessGroup, free_tcp_port
from deploy.server_group import LaunchError, server_argv, shutdown_servers, wait_ready
from partition.layout import PartitionFormatError, PartitionSetMeta
from trainer_client.run_dir import new_run_name, newest_resumable_run, write_json_atomic


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="worker-mode",
        description="Run sampler servers for every partition and DDP trainers on this node, "
                    "train a GNN (--model), and print a JSON summary as the last stdout line. With "
                    "neither --parts nor --dataset-dir, a synthetic graph is generated and "
                    "partitioned (cached under --work-dir).")
    p.add_argument("--config", help="YAML file with worker-mode options; nested 'trainer:' and "
                   "'server:' sections hold trainer and server options. Command-line options "
                   "override it.")
    add_config_args(p, WorkerModeConfig)
    return p


def _cache_dir(cfg: WorkerModeConfig, label: str) -> Path:
    return Path(cfg.work_dir) / f"{label}-{cfg.num_parts}parts"


def _cached(out: Path, num_parts: int) -> bool:
    try:
        return PartitionSetMeta.load(out).num_parts == num_parts
    except PartitionFormatError:
        return False


def prepare_parts(cfg: WorkerModeConfig) -> str:
    """Path of the partition set to serve, partitioning or generating it if needed."""
    if cfg.parts:
        PartitionSetMeta.load(cfg.parts)  # clear error now, not in every server
        return cfg.parts
    from partition.partitioner import partition_graph

    if cfg.dataset_dir:
        src = Path(cfg.dataset_dir).resolve()
        tag = hashlib.sha1(str(src).encode()).hexdigest()[:8]
        out = _cache_dir(cfg, f"{src.name}-{tag}")
        if not _cached(out, cfg.num_parts):
            from partition.ogbn import load_ogb

            print(f"worker-mode: partitioning {src} into {cfg.num_parts} parts -> {out}",
                  file=sys.stderr)
            data = load_ogb(name=None, root=None, dataset_dir=str(src))
            _partition_into(out, lambda tmp: partition_graph(data, cfg.num_parts, str(tmp)))
        return str(out)
    out = _cache_dir(cfg, f"synthetic-{cfg.synthetic_nodes}")
    if not _cached(out, cfg.num_parts):
        from partition.synthetic import generate

        print(f"worker-mode: generating a synthetic graph of {cfg.synthetic_nodes} nodes "
              f"and partitioning it into {cfg.num_parts} parts -> {out}", file=sys.stderr)
        data = generate(cfg.synthetic_nodes, avg_degree=15, feat_dim=64, num_classes=8,
                        seed=cfg.trainer.seed)
        _partition_into(out, lambda tmp: partition_graph(data, cfg.num_parts, str(tmp)))
    return str(out)


def _partition_into(out: Path, write) -> None:
    """Write a partition set next to ``out`` and move it into place only when complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def trainer_threads(cfg: WorkerModeConfig) -> int:
    """torch threads per trainer: ``--num-threads``, else the cores split over the trainers,
    and :data:`~common.config.GPU_TRAINER_THREADS` (1) for a trainer on a GPU. Its host work
    (decoding, staging copies, launching kernels) gains nothing from a team of OpenMP threads,
    and a team as wide as the machine waits at every parallel region for threads the
    co-located servers have descheduled. On an H200 machine with 16 cores the seed model ran
    at 26k (products) and 36k (RMAT) seeds/s with 16 threads, 67-74k and 90-104k with 2 or 4,
    75k and 131k with 1 (docs/benchmarks.md, "Issue 14, session 35")."""
    if cfg.trainer.num_threads:
        return cfg.trainer.num_threads
    if wants_cuda(cfg.trainer.device):
        return GPU_TRAINER_THREADS
    return max(1, (os.cpu_count() or 1) // cfg.num_trainers)


def child_env(role: str, clients: int = 1, threads: int = 1) -> dict[str, str]:
    """The environment of a worker-mode child: ours, with ``OMP_WAIT_POLICY`` chosen per role
    unless the user set it (then theirs, for every child).

    * ``"server"``: PASSIVE. A server computes with one torch thread; an OpenMP pool that
      spins while idle (DGL's unseeded sampler has one) would take the cores the trainer
      computes on.
    * ``"client"`` (trainers, the inference stage): ``clients`` processes of ``threads``
      torch threads each. libgomp's default (each idle thread spins for a few milliseconds,
      then sleeps), as DGL's training process has it, when their threads do not outnumber
      the cores; PASSIVE when they do, where a spinning thread would hold a core another
      process's thread is waiting for. Under PASSIVE every parallel region of a step wakes
      the pool's sleeping threads (about 140 times per step of the benchmark's seed model),
      and on this project's 2-core VM that made the step 10-20 % slower: worker mode on the
      RMAT benchmark graph read a median 10,013 seeds/s with PASSIVE against 10,820 with the
      default, ahead in 8 of 10 alternated pairs (docs/benchmarks.md, "Issue 14, session
      32"). The trainer's threads spin only at the start of its wait for the servers' turn.
    """
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" not in env and (
            role == "server" or clients * threads > (os.cpu_count() or 1)):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def _trainer_argv(cfg: WorkerModeConfig, cluster_file: Path, rank: int, port: int,
                  summary_file: Path, done_file: Path, parts: str = "") -> list[str]:
    """The ``trainer-client`` command line of ``rank``: every trainer option of ``cfg``
    (through :func:`common.config.to_argv`), rank 0 alone with progress bars and the summary;
    ``parts``, the set the servers serve, is on this host (``--parts-on-host``)."""
    t = cfg.trainer
    t = dataclasses.replace(
        t, cluster=str(cluster_file), progress=t.progress and rank == 0,
        parts_on_host=str(Path(parts).resolve()) if parts else "",
        num_threads=trainer_threads(cfg),
        summary_out=str(summary_file) if rank == 0 else "")
    ddp = DDPConfig(rank=rank, world_size=cfg.num_trainers, local_rank=rank,
                    master_addr="127.0.0.1", master_port=port, done_file=str(done_file),
                    launcher_tty=rank == 0 and bars_allowed(t.progress))
    return [sys.executable, "-m", "trainer_client.main", *to_argv(t), *to_argv(ddp)]


def wait_trainers(group: ProcessGroup, trainers: list[tuple[Child, Path]],
                  poll_s: float = 0.1) -> None:
    """Return when every trainer has finished; raise :class:`LaunchError` naming the first
    child that failed (any server exiting, or a trainer exiting non-zero before it wrote its
    done file). A trainer that exits non-zero after writing it died in teardown with its work
    done: it counts as finished, with a warning."""
    done_files = {c.name: f for c, f in trainers}
    finished: set[str] = set()
    while len(finished) < len(trainers):
        for c in group.children:
            code = c.proc.poll()
            if code is None or c.name in finished:
                continue
            done_file = done_files.get(c.name)
            if done_file is None and code == 0:
                raise LaunchError(f"{c.name} (pid {c.pid}) exited during training with "
                                  f"{c.exit_text}")
            if code != 0 and (done_file is None or not done_file.is_file()):
                raise LaunchError(f"{c.name} (pid {c.pid}) exited with {c.exit_text}; stopping "
                                  f"all processes. Its last output:\n{c.last_lines()}")
            if code != 0:
                print(f"worker-mode: warning: {c.name} (pid {c.pid}) exited with "
                      f"{c.exit_text} after it had finished (result delivered, final barrier "
                      "passed), in torch.distributed's teardown; counting it as finished",
                      file=sys.stderr, flush=True)
            finished.add(c.name)
        time.sleep(poll_s)


def with_run_dir(cfg: WorkerModeConfig) -> WorkerModeConfig:
    """``cfg`` with the trainers' run directory set: ``--run-dir`` if given, else a new
    ``<work_dir>/runs/<stamp>``; with ``--resume`` (and no --run-dir / --checkpoint-dir) the
    newest run under ``<work_dir>/runs`` that has a checkpoint."""
    t = cfg.trainer
    if t.run_dir or (t.resume and t.checkpoint_dir):
        return cfg
    runs = Path(cfg.work_dir) / "runs"
    if t.resume:
        found = newest_resumable_run(runs)
        if found is None:
            raise ConfigError(f"--resume: no run under {runs} has a checkpoint; name the run to "
                              "continue with --run-dir DIR")
        run_dir = str(found)
    else:
        run_dir = str(runs / new_run_name())
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, run_dir=run_dir))


def wait_child(group: ProcessGroup, child: Child, servers: list[tuple[str, str]],
               poll_s: float = 0.1) -> None:
    """Return when ``child`` exited 0; raise :class:`LaunchError` when it failed or a
    server exited first."""
    names = {name for name, _ in servers}
    while (code := child.proc.poll()) is None:
        for c in group.children:
            if c.name in names and c.proc.poll() is not None:
                raise LaunchError(f"{c.name} (pid {c.pid}) exited with {c.exit_text} while "
                                  f"{child.name} ran; stopping all processes. Its last "
                                  f"output:\n{c.last_lines()}")
        time.sleep(poll_s)
    if code != 0:
        raise LaunchError(f"{child.name} (pid {child.pid}) exited with {child.exit_text}; its "
                          f"last output:\n{child.last_lines()}")


def infer_stage(cfg: WorkerModeConfig, group: ProcessGroup, cluster_file: Path, parts: str,
                servers: list[tuple[str, str]], tmp: Path) -> dict:
    """``--infer``: mfgserve-infer through the servers still running, on the run directory's
    best_model.pt, outputs in ``<run dir>/inference``; returns its JSON summary."""
    t = cfg.trainer
    icfg = InferConfig(cluster=str(cluster_file), run_dir=t.run_dir, parts=parts,
                       batch_size=t.eval_batch_size, device=t.device,
                       num_threads=t.num_threads, max_message_mb=t.max_message_mb,
                       request_timeout_s=t.request_timeout_s, heartbeat_s=t.heartbeat_s,
                       heartbeat_timeout_s=t.heartbeat_timeout_s, progress=False)
    out = tmp / "inference.json"
    with open(out, "w") as stdout:
        child = group.spawn("inference", [sys.executable, "-m", "deploy.infer_cli",
                                          *to_argv(icfg)], stdout=stdout,
                            env=child_env("client", 1, t.num_threads or os.cpu_count() or 1))
        wait_child(group, child, servers)
    lines = [ln for ln in out.read_text().splitlines() if ln.strip()]
    if not lines:
        raise LaunchError("mfgserve-infer printed no summary")
    return json.loads(lines[-1])


def start_servers(cfg: WorkerModeConfig, group: ProcessGroup, parts: str, num_parts: int,
                  sock_dir: Path) -> tuple[Path, list[tuple[str, str]], str]:
    """Start ``servers_per_part`` servers per part on ipc sockets in ``sock_dir`` and wait
    until each answers a ping; returns (cluster file, [(name, endpoint)], shutdown token)."""
    cluster = ClusterSpec({p: [f"ipc://{sock_dir}/p{p}r{r}.sock"
                               for r in range(cfg.servers_per_part)]
                           for p in range(num_parts)})
    longest = max(len(ep) for _, ep in cluster.all_endpoints()) - len("ipc://")
    if longest > 100:  # sun_path holds 107 bytes
        raise ConfigError(f"socket directory {sock_dir} is too deep for ipc socket paths; "
                          "set TMPDIR to a shorter directory")
    cluster_file = sock_dir / "cluster.yaml"
    cluster.write(cluster_file)
    token_file = str(sock_dir / "shutdown.token")
    token = new_token_file(token_file)
    servers: list[tuple[str, str]] = []
    ready: dict[str, Path] = {}
    for p, ep in cluster.all_endpoints():
        name = f"server p{p} {ep.rsplit('/', 1)[-1]}"
        ready[name] = sock_dir / f"{ep.rsplit('/', 1)[-1]}.ready"
        group.spawn(name, server_argv(cfg.server, parts, p, ep, cluster_file, token_file,
                                      str(ready[name])), env=child_env("server"))
        servers.append((name, ep))
    wait_ready(group, servers, cfg.startup_timeout_s, ready)
    return cluster_file, servers, token


def run(cfg: WorkerModeConfig) -> dict:
    t0 = time.perf_counter()
    cfg = with_run_dir(cfg)
    print(f"worker-mode: run directory {cfg.trainer.run_dir}", file=sys.stderr, flush=True)
    parts = prepare_parts(cfg)
    meta = PartitionSetMeta.load(parts)
    prep_s = time.perf_counter() - t0
    for stale in remove_stale_run_dirs():
        print(f"worker-mode: removed {stale}, left by a launcher that was killed", file=sys.stderr)
    sock_dir = make_run_dir()  # private: sockets, cluster file, token, done files
    group = ProcessGroup()
    servers: list[tuple[str, str]] = []
    token = ""
    try:
        cluster_file, servers, token = start_servers(cfg, group, parts, meta.num_parts,
                                                     sock_dir)
        t_ready = time.perf_counter()
        port = free_tcp_port()
        summary_file = sock_dir / "summary.json"
        done = [sock_dir / f"rank{r}.done" for r in range(cfg.num_trainers)]
        env = child_env("client", cfg.num_trainers, trainer_threads(cfg))
        trainers = [(group.spawn(f"trainer rank {r}", _trainer_argv(
                        cfg, cluster_file, r, port, summary_file, done[r], parts), env=env),
                     done[r])
                    for r in range(cfg.num_trainers)]
        wait_trainers(group, trainers)
        inference = (infer_stage(cfg, group, cluster_file, parts, servers, sock_dir)
                     if cfg.infer else None)
        group.teardown(cfg.shutdown_timeout_s, polite=lambda: shutdown_servers(servers, token))
        if not summary_file.is_file():
            raise LaunchError("trainer rank 0 exited without writing its summary")
        summary = json.loads(summary_file.read_text())
        if inference is not None:
            summary["inference"] = inference
        summary.update({
            "mode": "worker", "parts": parts, "servers": len(servers),
            "prepare_s": round(prep_s, 3), "startup_s": round(t_ready - t0 - prep_s, 3),
            "launcher_wall_s": round(time.perf_counter() - t0, 3),
            "teardown": group.escalation,
        })
        # The run directory's summary.json is the line printed (launcher fields included).
        write_json_atomic(Path(summary.get("run_dir") or cfg.trainer.run_dir) / "summary.json",
                          summary)
        return summary
    finally:
        group.teardown(cfg.shutdown_timeout_s, polite=lambda: shutdown_servers(servers, token))
        shutil.rmtree(sock_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``worker-mode``; returns the exit code (see the module docstring;
    errors mapped by :func:`common.cli.run_main`)."""
    return run_main("worker-mode", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    raise_on_signals()
    summary = run(load_config(WorkerModeConfig, args.config, args))
    print(dumps_strict(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
