"""One config-to-argv function for every launcher (issue #10): every field of every config
dataclass survives ``to_argv`` -> that CLI's parser -> ``load_config``, and the launchers'
children really get the options (``--sampler-procs`` was once silently dropped)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from procs import REPO

import common.config
import partition.config
from common.config import (
    DDPConfig,
    InferConfig,
    KeysConfig,
    PlotConfig,
    ServerConfig,
    ServerNodeConfig,
    StatusConfig,
    TrainerConfig,
    WorkerModeConfig,
    from_argv,
    load_config,
    options,
    to_argv,
)
from common.errors import ConfigError
from partition.config import PartitionConfig, SyntheticConfig

SERVER = ServerConfig(
    parts="/p", part_id=3, bind="ipc:///tmp/x.sock", cluster="/c.yaml", num_workers=5,
    sampler_procs=3, max_queue=7, max_message_mb=99, max_peer_backlog_mb=33,
    peer_timeout_s=12.5, seed=-4, heartbeat_s=0.25, heartbeat_timeout_s=2.5, ready_file="/r",
    shutdown_token_file="/t", curve_secret_key="/k", curve_authorized_keys="/a",
    replica_suspect_s=12.0, max_node_tensor_mb=77, nice=5, malloc_retain_mb=0)
TRAINER = TrainerConfig(
    cluster="/c.yaml", fanouts=[-1, 5, 3], eval_fanouts=[4, 4, 4], batch_size=7,
    eval_batch_size=9, epochs=2, hidden=8, dropout=0.25, lr=0.0125, weight_decay=1e-6,
    max_inflight=2, prefetch="alternate", yield_cores="off", cache_ratio=0.3,
    feat_transfer="float16",
    request_timeout_s=17.5,
    shm_ring=False, shm_ring_mb=64, device="cpu", num_threads=3, malloc_retain_mb=64,
    eval_every=2, seed=11, matmul_precision="medium", cpu_gemm="mkl",
    progress=False, summary_out="/s.json", max_message_mb=77, heartbeat_s=0.5,
    heartbeat_timeout_s=3.0, curve_secret_key="/k", replica_suspect_s=4.5, run_dir="/run",
    model="gat", gat_heads=2, patience=3, lr_schedule="step", lr_step_epochs=4, lr_gamma=0.25,
    grad_clip=1.5, profile_steps=7, eval="full", checkpoint_dir="/ck", checkpoint_every=2, resume=True,
    deterministic_sampling=False, batch_locality="part", local_features="off",
    parts_on_host="/parts")
# --node-emb-dim with sampled evaluation
TRAINER_EMB = dataclasses.replace(TRAINER, eval="sampled", node_emb_dim=8, node_emb_lr=0.5)
# issue 11: typed sets: the relational model and per-relation fanouts
TRAINER_TYPED = dataclasses.replace(TRAINER, eval="sampled", model="rsage",
                                    rel_fanouts="writes=5:cites=-1/cites=0/rev_writes=2")
DDP = DDPConfig(rank=2, world_size=4, local_rank=1, master_addr="10.0.0.9", master_port=29777,
                ddp_timeout_s=60.5, done_file="/d", launcher_tty=True)


def _unset(cfg, *names):
    """``cfg`` with ``names`` back at their defaults (the fields a section skips)."""
    d = type(cfg)()
    return dataclasses.replace(cfg, **{n: getattr(d, n) for n in names})


WORKER = dict(num_parts=3, synthetic_nodes=500, work_dir="/w", num_trainers=2,
              servers_per_part=2, startup_timeout_s=60.5, shutdown_timeout_s=3.5,
              trainer=_unset(TRAINER, "cluster", "summary_out", "curve_secret_key",
                    "parts_on_host"),
              server=_unset(SERVER, "parts", "part_id", "bind", "cluster", "ready_file",
                            "shutdown_token_file", "curve_secret_key",
                            "curve_authorized_keys"))
NODE = dict(host="10.0.0.3", replicas=2, startup_timeout_s=30.5, shutdown_timeout_s=2.5,
            server=_unset(SERVER, "part_id", "bind", "cluster", "ready_file",
                          "shutdown_token_file"))
PARTITION = dict(root="/r", num_parts=3, method="random", halo_hops=2, presample_batches=0,
                 node_order="id", out="/o", force=True, seed=5, add_reverse_edges=True,
                 work_dir="/w", no_progress=True)

# every config dataclass: (its CLI's parser module, instances that together set every field)
CASES = {
    ServerConfig: ("sampler_server.main", [SERVER]),
    TrainerConfig: ("trainer_client.main", [TRAINER, TRAINER_EMB, TRAINER_TYPED]),
    DDPConfig: ("trainer_client.main", [DDP]),
    WorkerModeConfig: ("deploy.worker_mode", [
        WorkerModeConfig(parts="/p", **WORKER),
        # --infer needs one server per part (the layer outputs are held on the servers)
        WorkerModeConfig(dataset_dir="/d", **dict(WORKER, infer=True, servers_per_part=1)),
        WorkerModeConfig(parts="/p", **dict(WORKER, trainer=_unset(
            TRAINER_EMB, "cluster", "summary_out", "curve_secret_key",
                    "parts_on_host"))),
        WorkerModeConfig(parts="/p", **dict(WORKER, trainer=_unset(
            TRAINER_TYPED, "cluster", "summary_out", "curve_secret_key",
                    "parts_on_host")))]),
    ServerNodeConfig: ("deploy.server_node", [ServerNodeConfig(cluster="/c", **NODE),
                                              ServerNodeConfig(cluster_out="/o", **NODE)]),
    InferConfig: ("deploy.infer_cli", [InferConfig(
        cluster="/c", run_dir="/r", model="/m.pt", out="/o", parts="/p", batch_size=5,
        max_inflight=2, device="cpu", num_threads=2, matmul_precision="medium", cpu_gemm="onednn",
        max_message_mb=9,
        request_timeout_s=7.5,
        heartbeat_s=0.5, heartbeat_timeout_s=2.5, replica_suspect_s=3.5, curve_secret_key="/k",
        progress=False)]),
    StatusConfig: ("deploy.status_cli", [StatusConfig(cluster="/c", json=True, timeout_s=2.5,
                                                      curve_secret_key="/k")]),
    PlotConfig: ("deploy.plot_cli", [PlotConfig(out="/o", dpi=72)]),
    KeysConfig: ("deploy.keys", [KeysConfig(out="/o", name="n", authorize="/a", force=True)]),
    PartitionConfig: ("partition.cli", [
        PartitionConfig(dataset="synthetic", synthetic=SyntheticConfig(
            num_nodes=500, avg_degree=3.5, feat_dim=4, num_classes=3, homophily=0.5,
            raw_out="/raw", train_frac=0.5, valid_frac=0.25), **PARTITION),
        PartitionConfig(dataset="rmat", synthetic=SyntheticConfig(
            rmat_a=0.5, rmat_b=0.2, rmat_c=0.2, rmat_noise=0.05),
            **dict(PARTITION, add_reverse_edges=False)),
        PartitionConfig(dataset_dir="/d", **PARTITION),
        # issue 12: the streaming pipeline and the binary-layout generator (no halo there)
        PartitionConfig(dataset="synthetic", synthetic=SyntheticConfig(
            num_nodes=500, raw_format="binary", labeled_frac=0.25, feat_dtype="float16"),
            **dict(PARTITION, method="fennel", halo_hops=0, max_memory_gb=2.5,
                   stream_passes=3)),
        # issue 11: the multi-label (ogbn-proteins-shaped) generator and its feature options
        PartitionConfig(dataset="synthetic-proteins", synthetic=SyntheticConfig(
            num_nodes=500, num_tasks=3), edge_feat_to_node="sum", node_species="onehot",
            **PARTITION),
        # issue 11: the ogbn-mag-shaped (typed) generator and --derive-features
        PartitionConfig(dataset="synthetic-mag", synthetic=SyntheticConfig(
            num_nodes=500, feat_dim=8, num_classes=4), derive_features="mean", **PARTITION)]),
}
# positional arguments a CLI takes outside its config dataclass
POSITIONAL = {PlotConfig: ["/run"]}


def test_every_config_dataclass_is_covered():
    found = {cls for mod in (common.config, partition.config)
             for _, cls in inspect.getmembers(mod, inspect.isclass)
             if dataclasses.is_dataclass(cls) and cls.__module__ == mod.__name__}
    assert found - {SyntheticConfig} == set(CASES), "add the new config class to CASES"


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_every_field_round_trips_through_the_cli(cls):
    module, cfgs = CASES[cls]
    parser = __import__(module, fromlist=["build_parser"]).build_parser()
    changed = set()
    for cfg in cfgs:
        argv = to_argv(cfg) + POSITIONAL.get(cls, [])
        ns = parser.parse_args(argv)
        assert load_config(cls, getattr(ns, "config", None), ns) == cfg, argv
        defaults = cls()
        changed |= {o.path for o in options(cls)
                    if _get(cfg, o.path) != _get(defaults, o.path)}
    missing = {".".join(o.path) for o in options(cls)} - {".".join(p) for p in changed}
    assert not missing, f"give these fields a non-default value in CASES: {sorted(missing)}"


def _get(cfg, path):
    for name in path:
        cfg = getattr(cfg, name)
    return cfg


def test_defaults_make_an_empty_command_line():
    assert to_argv(ServerConfig()) == [] and to_argv(TrainerConfig()) == []


def test_values_that_look_like_options_survive():
    cfg = TrainerConfig(cluster="-c.yaml", fanouts=[-1, -1], eval_fanouts=[])
    assert "--fanouts=-1,-1" in to_argv(cfg)
    assert from_argv(TrainerConfig, to_argv(cfg)) == cfg


def test_a_skipped_field_that_differs_is_an_error_not_a_silent_drop():
    cfg = WorkerModeConfig(server=ServerConfig(bind="ipc:///tmp/y.sock"))
    with pytest.raises(ConfigError, match="server.bind"):
        to_argv(cfg)


def test_server_argv_carries_every_server_option(tmp_path):
    from deploy.server_group import server_argv

    argv = server_argv(_unset(SERVER, "ready_file"), "/parts", 2, "ipc:///tmp/z.sock",
                       tmp_path / "c.yaml", "/tok")
    assert argv[:3] == [sys.executable, "-m", "sampler_server.main"]
    got = from_argv(ServerConfig, argv[3:])
    assert got == dataclasses.replace(
        SERVER, parts="/parts", part_id=2, bind="ipc:///tmp/z.sock",
        cluster=str(tmp_path / "c.yaml"), seed=SERVER.seed + 2, shutdown_token_file="/tok",
        ready_file="")
    assert "--sampler-procs=3" in argv


def test_worker_mode_passes_server_sampler_procs_to_its_servers(tmp_path):
    from deploy.server_group import server_argv
    from deploy.worker_mode import build_parser

    ns = build_parser().parse_args(["--server-sampler-procs", "2", "--server-num-workers", "1"])
    cfg = load_config(WorkerModeConfig, None, ns)
    argv = server_argv(cfg.server, "/parts", 0, "ipc:///tmp/s.sock", tmp_path / "c.yaml")
    got = from_argv(ServerConfig, argv[3:])
    assert got.sampler_procs == 2 and got.num_workers == 1


def test_worker_mode_trainer_argv_carries_trainer_and_ddp_options(tmp_path):
    from deploy.worker_mode import _trainer_argv
    from trainer_client.main import build_parser

    cfg = WorkerModeConfig(parts="/p", **WORKER)
    for rank in (0, 1):
        argv = _trainer_argv(cfg, tmp_path / "c.yaml", rank, 29999, tmp_path / "s.json",
                             tmp_path / f"r{rank}.done")
        assert argv[:3] == [sys.executable, "-m", "trainer_client.main"]
        ns = build_parser().parse_args(argv[3:])
        t, d = load_config(TrainerConfig, None, ns), load_config(DDPConfig, None, ns)
        assert t == dataclasses.replace(
            cfg.trainer, cluster=str(tmp_path / "c.yaml"), progress=False,
            summary_out=str(tmp_path / "s.json") if rank == 0 else "")
        assert d == DDPConfig(rank=rank, world_size=2, local_rank=rank, master_port=29999,
                              done_file=str(tmp_path / f"r{rank}.done"))


@pytest.mark.timeout(180)
def test_server_node_starts_servers_with_sampler_processes(synth_parts2, tmp_path):
    """End to end: ``server-node --sampler-procs 2`` starts servers that run two sampler
    processes each."""
    proc = subprocess.Popen([sys.executable, "-m", "deploy.server_node", "--parts",
                             str(synth_parts2), "--cluster-out", str(tmp_path / "c.yaml"),
                             "--sampler-procs", "2"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
        assert line, f"server-node exited early:\n{proc.stderr.read()[-3000:]}"
        assert json.loads(line)["event"] == "ready"
        servers = psutil.Process(proc.pid).children()
        assert len(servers) == 2
        for s in servers:
            assert "--sampler-procs=2" in s.cmdline()
        deadline = time.monotonic() + 30
        while any(len(s.children()) < 2 for s in servers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [len(s.children()) for s in servers] == [2, 2]
        kids = servers + [k for s in servers for k in s.children()]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
        _, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive
    finally:
        proc.kill()
        proc.wait(10)


def test_one_parser_two_sections():
    """The trainer's parser holds its options and the DDP options: each load takes its own."""
    from trainer_client.main import build_parser

    ns = build_parser().parse_args(["--cluster", "c", "--rank", "1", "--world-size", "2",
                                    "--epochs", "3"])
    assert load_config(DDPConfig, None, ns) == DDPConfig(rank=1, world_size=2)
    assert load_config(TrainerConfig, None, ns) == TrainerConfig(cluster="c", epochs=3)


@pytest.mark.timeout(240)
def test_worker_mode_starts_servers_with_sampler_processes(synth_parts2, tmp_path):
    """End to end: ``worker-mode --server-sampler-procs 2``: while it trains, each server
    runs two sampler processes; the run succeeds."""
    run_tmp = tmp_path / "t"
    run_tmp.mkdir()
    out_f, err_f = (tmp_path / "out").open("w"), (tmp_path / "err").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "deploy.worker_mode", "--parts",
                             str(synth_parts2), "--epochs", "1", "--batch-size", "256",
                             "--fanouts", "4,4", "--hidden", "8", "--no-progress",
                             "--server-num-workers", "1", "--server-sampler-procs", "2"],
                            cwd=REPO, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL,
                            env={**os.environ, "TMPDIR": str(run_tmp)})
    seen: dict[int, int] = {}  # server pid -> most sampler processes seen under it
    try:
        launcher = psutil.Process(proc.pid)
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                for s in launcher.children():
                    if "sampler_server.main" in " ".join(s.cmdline()):
                        assert "--sampler-procs=2" in s.cmdline()
                        seen[s.pid] = max(seen.get(s.pid, 0), len(s.children()))
            except psutil.Error:  # a child exited between the listing and the look
                pass
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(10)
        out_f.close()
        err_f.close()
    assert proc.returncode == 0, (tmp_path / "err").read_text()[-3000:]
    assert json.loads((tmp_path / "out").read_text().strip().splitlines()[-1])["epochs"] == 1
    assert sorted(seen.values()) == [2, 2], seen
