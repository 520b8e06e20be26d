"""Config loading: YAML files, command-line precedence, validation, the cluster file, how the
CLIs report bad configuration (exit 2, a clear message) and document their options, and the
one ``main`` wrapper (common/cli.py) that maps errors to exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.cli import Interrupted, run_main
from common.cluster import ClusterSpec
from common.config import (
    DDPConfig,
    KeysConfig,
    ServerConfig,
    ServerNodeConfig,
    TrainerConfig,
    WorkerModeConfig,
    add_config_args,
    from_dict,
    load_config,
)
from common.errors import ChildFailedError, ConfigError, MfgServeError
from partition.cli import CliError
from partition.config import PartitionConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import REPO, run_cli  # noqa: E402


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(cls: type, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_config_args(p, cls)
    return p.parse_args(argv)


def load(cls: type, argv: list[str]):
    ns = parse(cls, argv)
    return load_config(cls, ns.config, {k: v for k, v in vars(ns).items() if k != "config"})


# ---------------------------------------------------------------- YAML files


def test_valid_yaml_file(tmp_path):
    path = write(tmp_path, "parts: /data/parts\npart_id: 1\nbind: tcp://0.0.0.0:0\n"
                           "num_workers: 3\npeer_timeout_s: 5\n")
    cfg = load_config(ServerConfig, str(path), {})
    assert cfg.parts == "/data/parts" and cfg.part_id == 1 and cfg.num_workers == 3
    assert cfg.bind == "tcp://0.0.0.0:0"
    assert cfg.peer_timeout_s == 5.0 and isinstance(cfg.peer_timeout_s, float)  # int accepted
    assert cfg.max_queue == ServerConfig().max_queue  # untouched keys keep their defaults


def test_trainer_yaml_lists_and_bools(tmp_path):
    path = write(tmp_path, "cluster: c.yaml\nfanouts: [15, 10, 5]\neval_fanouts: '20,20,20'\n"
                           "progress: false\n")
    cfg = load_config(TrainerConfig, str(path), {})
    assert cfg.fanouts == [15, 10, 5] and cfg.eval_fanouts == [20, 20, 20]
    assert cfg.progress is False


def test_empty_yaml_file_means_defaults(tmp_path):
    cfg = load_config(ServerConfig, str(write(tmp_path, "")), {"parts": "p"})
    assert cfg == dataclasses.replace(ServerConfig(), parts="p")


def test_unknown_key_names_the_key_file_and_valid_keys(tmp_path):
    path = write(tmp_path, "parts: p\nnum_wrokers: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, str(path), {})
    text = str(info.value)
    assert "num_wrokers" in text and str(path) in text
    for f in dataclasses.fields(ServerConfig):
        assert f.name in text, f"valid option {f.name} not listed in: {text}"


@pytest.mark.parametrize("text,key", [
    ("parts: p\npart_id: abc\n", "part_id"),
    ("parts: p\nnum_workers: true\n", "num_workers"),   # a bool is not an int
    ("parts: p\npart_id: 1.5\n", "part_id"),
    ("parts: p\npeer_timeout_s: soon\n", "peer_timeout_s"),
    ("parts: [a, b]\n", "parts"),
    ("parts: p\nbind: {host: x}\n", "bind"),
])
def test_wrong_type_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, str(write(tmp_path, text)), {})
    assert key in str(info.value)


@pytest.mark.parametrize("text,key", [
    ("cluster: c\nfanouts: [10, x]\n", "fanouts"),
    ("cluster: c\nfanouts: 10\n", "fanouts"),
    ("cluster: c\nprogress: 'yes'\n", "progress"),
    ("cluster: c\ndropout: true\n", "dropout"),
])
def test_wrong_type_trainer(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load_config(TrainerConfig, str(write(tmp_path, text)), {})
    assert key in str(info.value)


@pytest.mark.parametrize("text", ["- parts\n- p\n", "just a string\n", "42\n"])
def test_yaml_that_is_not_a_mapping(tmp_path, text):
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, str(write(tmp_path, text)), {})
    assert "mapping" in str(info.value)


def test_invalid_yaml(tmp_path):
    path = write(tmp_path, "parts: [p, q\npart_id: : 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, str(path), {})
    assert "not valid YAML" in str(info.value) and str(path) in str(info.value)


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, str(path), {})
    assert str(path) in str(info.value) and "--config" in str(info.value)


# ---------------------------------------------------------------- precedence


def test_cli_beats_yaml_beats_defaults(tmp_path):
    path = write(tmp_path, "parts: /yaml/parts\npart_id: 3\nnum_workers: 4\nseed: 9\n")
    cfg = load(ServerConfig, ["--config", str(path), "--num-workers", "7", "--seed", "1"])
    assert cfg.num_workers == 7 and cfg.seed == 1          # command line wins
    assert cfg.parts == "/yaml/parts" and cfg.part_id == 3  # YAML beats defaults
    assert cfg.max_queue == ServerConfig().max_queue       # defaults fill the rest
    assert cfg.bind == ServerConfig().bind


def test_options_not_given_do_not_override_yaml():
    ns = parse(ServerConfig, ["--parts", "x"])
    assert set(vars(ns)) == {"config", "parts"}  # every other option is suppressed


def test_cli_bool_and_list_options_override_yaml(tmp_path):
    path = write(tmp_path, "cluster: c.yaml\nprogress: false\nfanouts: [5, 5]\nlr: 0.1\n")
    cfg = load(TrainerConfig, ["--config", str(path), "--progress", "--fanouts", "3,2,1"])
    assert cfg.progress is True and cfg.fanouts == [3, 2, 1] and cfg.lr == 0.1
    cfg = load(TrainerConfig, ["--config", str(path), "--no-progress"])
    assert cfg.progress is False and cfg.fanouts == [5, 5]


def test_cli_without_yaml(tmp_path):
    cfg = load(ServerConfig, ["--parts", "p", "--part-id", "2", "--max-message-mb", "8"])
    assert (cfg.parts, cfg.part_id, cfg.max_message_mb) == ("p", 2, 8)


def test_cli_rejects_malformed_values():
    with pytest.raises(SystemExit) as info:
        parse(TrainerConfig, ["--fanouts", "10,x"])
    assert info.value.code == 2


def test_worker_mode_nested_sections(tmp_path):
    path = write(tmp_path, "num_trainers: 2\nnum_parts: 3\n"
                           "trainer:\n  epochs: 3\n  fanouts: [5, 5]\n  batch_size: 64\n"
                           "server:\n  num_workers: 3\n  max_queue: 8\n")
    cfg = load(WorkerModeConfig, ["--config", str(path), "--epochs", "4",
                                  "--server-num-workers", "5"])
    assert cfg.num_trainers == 2 and cfg.num_parts == 3
    assert cfg.trainer.epochs == 4 and cfg.trainer.fanouts == [5, 5] and cfg.trainer.batch_size == 64
    assert cfg.server.num_workers == 5 and cfg.server.max_queue == 8
    assert cfg.trainer.hidden == TrainerConfig().hidden
    assert cfg.server.seed == ServerConfig().seed


def test_worker_mode_skips_launcher_owned_server_options():
    ns = parse(WorkerModeConfig, ["--server-seed", "3"])
    assert ns.server_seed == 3
    for flag in ("--server-parts", "--server-part-id", "--server-bind", "--server-cluster"):
        with pytest.raises(SystemExit):
            parse(WorkerModeConfig, [flag, "x"])


@pytest.mark.parametrize("text,needle", [
    ("trainer:\n  epochz: 3\n", "epochz"),
    ("server:\n  num_workers: many\n", "num_workers"),
    ("trainer: 5\n", "trainer"),
])
def test_worker_mode_nested_errors(tmp_path, text, needle):
    with pytest.raises(ConfigError) as info:
        load_config(WorkerModeConfig, str(write(tmp_path, text)), {})
    assert needle in str(info.value)


# ---------------------------------------------------------------- validate()


@pytest.mark.parametrize("changes,needle", [
    ({"fanouts": [0]}, "--fanouts"),
    ({"fanouts": [10, -2]}, "--fanouts"),
    ({"fanouts": []}, "--fanouts"),
    ({"eval_fanouts": [5]}, "--eval-fanouts"),   # one entry per layer
    ({"dropout": 1.0}, "--dropout"),
    ({"dropout": -0.1}, "--dropout"),
    ({"batch_size": 0}, "--batch-size"),
    ({"device": "tpu"}, "--device"),
    ({"request_timeout_s": 0.0}, "--request-timeout-s"),
    ({"cluster": ""}, "--cluster"),
])
def test_trainer_validate(changes, needle):
    cfg = dataclasses.replace(TrainerConfig(cluster="c.yaml"), **changes)
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert needle in str(info.value)


def test_trainer_validate_accepts_sane_values():
    TrainerConfig(cluster="c.yaml", fanouts=[-1, 5], eval_fanouts=[10, 10], dropout=0.0).validate()


@pytest.mark.parametrize("changes,needle", [
    ({"bind": "localhost:5550"}, "--bind"),
    ({"bind": "http://x:1"}, "--bind"),
    ({"parts": ""}, "--parts"),
    ({"part_id": -1}, "--part-id"),
    ({"num_workers": 0}, "--num-workers"),
    ({"peer_timeout_s": 0.0}, "--peer-timeout-s"),
])
def test_server_validate(changes, needle):
    cfg = dataclasses.replace(ServerConfig(parts="p"), **changes)
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert needle in str(info.value)


def test_validate_runs_on_load(tmp_path):
    with pytest.raises(ConfigError, match="--dropout"):
        load_config(TrainerConfig, str(write(tmp_path, "cluster: c\ndropout: 1.0\n")), {})
    with pytest.raises(ConfigError, match="--bind"):
        load(ServerConfig, ["--parts", "p", "--bind", "127.0.0.1:80"])


@pytest.mark.parametrize("argv,needle", [
    (["--fanouts", "0,5"], "--fanouts"),
    (["--server-num-workers", "0"], "--num-workers"),
    (["--num-trainers", "0"], "--num-trainers"),
    (["--parts", "p", "--dataset-dir", "d"], "--parts"),
])
def test_worker_mode_validate(argv, needle):
    with pytest.raises(ConfigError) as info:
        load(WorkerModeConfig, argv)
    assert needle in str(info.value)


def test_from_dict_reports_where():
    with pytest.raises(ConfigError, match=r"my\.yaml\.trainer"):
        from_dict(WorkerModeConfig, {"trainer": {"bogus": 1}}, "my.yaml")


# ---------------------------------------------------------------- cluster file


def test_cluster_spec_valid(tmp_path):
    path = write(tmp_path, "partitions:\n  0: [tcp://10.0.0.1:15550, tcp://10.0.0.2:15550]\n"
                           "  1: ipc:///tmp/s1\n", "cluster.yaml")
    spec = ClusterSpec.load(path)
    assert spec.num_parts == 2
    assert spec.partitions[1] == ["ipc:///tmp/s1"]  # a single endpoint becomes a list
    assert spec.all_endpoints() == [(0, "tcp://10.0.0.1:15550"), (0, "tcp://10.0.0.2:15550"),
                                    (1, "ipc:///tmp/s1")]
    out = tmp_path / "again.yaml"
    spec.write(out)
    assert ClusterSpec.load(out) == spec


@pytest.mark.parametrize("text,needle", [
    ("partitions:\n  0: [tcp://a:1]\n  2: [tcp://b:1]\n", "0..P-1"),
    ("partitions:\n  1: [tcp://a:1]\n", "0..P-1"),
    ("partitions:\n  0: []\n", "list of endpoints"),
    ("partitions:\n  0: [localhost:1]\n", "not a ZeroMQ endpoint"),
    ("partitions:\n  0: [5]\n", "list of endpoints"),
    ("partitions:\n  a: [tcp://a:1]\n", "integer"),
    ("partitions:\n  -1: [tcp://a:1]\n", "integer"),
    ("partitions:\n  true: [tcp://a:1]\n", "integer"),
    ("partitions: [tcp://a:1]\n", "partitions"),
    ("partitions:\n  0: [tcp://a:1]\nextra: 1\n", "partitions"),
    ("servers:\n  0: [tcp://a:1]\n", "partitions"),
    ("", "partitions"),
    ("partitions: {0: [tcp://a:1]\n", "not valid YAML"),
])
def test_cluster_spec_invalid(tmp_path, text, needle):
    path = write(tmp_path, text, "cluster.yaml")
    with pytest.raises(ConfigError) as info:
        ClusterSpec.load(path)
    assert needle in str(info.value)
    assert str(path) in str(info.value)


def test_cluster_spec_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="--cluster"):
        ClusterSpec.load(tmp_path / "missing.yaml")


# ---------------------------------------------------------------- the CLIs


def _assert_clean_error(proc: subprocess.CompletedProcess, prog: str, *needles: str) -> None:
    assert proc.returncode == 2, f"{prog} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{prog}" in proc.stderr and "error" in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in proc.stderr, f"{n!r} not in stderr:\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(120)
def test_cli_exit_2_on_bad_config(tmp_path):
    """All three CLIs run at once (they import torch: seconds each); each exit code checked."""
    bad = write(tmp_path, "parts: p\nnum_wrokers: 4\n", "bad.yaml")
    bad_wm = write(tmp_path, "trainer:\n  fanouts: [0]\n", "bad-wm.yaml")
    missing = tmp_path / "missing.yaml"
    runs = {
        "sampler-server": (["-m", "sampler_server.main", "--config", str(bad)],
                           ["num_wrokers", "num_workers", str(bad)]),
        "trainer-client": (["-m", "deploy.trainer_cli", "--cluster", str(missing)],
                           [str(missing), "does not exist", "--cluster"]),
        "worker-mode": (["-m", "deploy.worker_mode", "--config", str(bad_wm),
                         "--work-dir", str(tmp_path / "wm")],
                        ["--fanouts"]),
    }
    procs = {name: subprocess.Popen([sys.executable, *argv], cwd=REPO, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (argv, _) in runs.items()}
    try:
        results = {}
        for name, p in procs.items():
            out, err = p.communicate(timeout=100)
            results[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for name, (_, needles) in runs.items():
        _assert_clean_error(results[name], name, *needles)
    assert not (tmp_path / "wm").exists(), "worker-mode must not start work on a bad config"


@pytest.mark.timeout(60)
def test_worker_mode_exit_2_on_malformed_yaml(tmp_path):
    bad = write(tmp_path, "num_trainers: [1\n", "broken.yaml")
    proc = run_cli("deploy.worker_mode", ["--config", bad], timeout=50, check=False)
    _assert_clean_error(proc, "worker-mode", "not valid YAML", str(bad))


CLIS = {
    "partition.cli": "partition-ogbn",
    "sampler_server.main": "sampler-server",
    "deploy.trainer_cli": "trainer-client",
    "deploy.worker_mode": "worker-mode",
    "deploy.server_node": "server-node",
    "deploy.keys": "mfgserve-keys",
}


def _build_parser(module: str) -> argparse.ArgumentParser:
    if module == "deploy.trainer_cli":
        module = "trainer_client.main"  # the console entry wraps this parser
    return importlib.import_module(module).build_parser()


@pytest.mark.timeout(120)
def test_help_of_every_cli_documents_every_option():
    procs = {m: subprocess.Popen([sys.executable, "-m", m, "--help"], cwd=REPO,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for m in CLIS}
    try:
        outs = {}
        for m, p in procs.items():
            out, err = p.communicate(timeout=100)
            assert p.returncode == 0, f"{m} --help exited with {p.returncode}:\n{err[-3000:]}"
            outs[m] = out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for module, prog in CLIS.items():
        text = outs[module]
        assert f"usage: {prog}" in text, text[:500]
        parser = _build_parser(module)
        flags = 0
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS and len(action.help) > 10, \
                f"{prog} {action.option_strings}: no help string"
            for opt in action.option_strings:
                assert re.search(rf"(^|[\s,\[]){re.escape(opt)}\b", text), \
                    f"{prog} --help does not mention {opt}"
                flags += 1
        assert flags >= 4


def test_config_fields_all_become_documented_options():
    for cls in (ServerConfig, TrainerConfig, WorkerModeConfig, DDPConfig, ServerNodeConfig,
                KeysConfig, PartitionConfig):
        p = argparse.ArgumentParser()
        add_config_args(p, cls)
        opts = {o for a in p._actions for o in a.option_strings}
        for f in dataclasses.fields(cls):
            if f.name in ("trainer", "server", "synthetic"):  # nested: their fields are options
                continue
            assert "--" + f.name.replace("_", "-") in opts, f"{cls.__name__}.{f.name}"
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
        helps = {a.dest: a.help for a in p._actions}
        for f in dataclasses.fields(cls):
            if f.name in helps:
                assert "(default:" in helps[f.name]


# ---------------------------------------------------------------- the one main wrapper


def _raise(exc: BaseException):
    def body():
        raise exc
    return body


@pytest.mark.parametrize("body,code,needle", [
    (lambda: None, 0, None),
    (lambda: 3, 3, None),
    (_raise(ConfigError("bad --x")), 2, "prog: error: bad --x"),
    (_raise(ChildFailedError("server p0 died")), 1, "prog: error: server p0 died"),
    (_raise(FileNotFoundError(2, "No such file", "/nope")), 2, "prog: error:"),
    (_raise(Interrupted(signal.SIGTERM)), 143, "prog: interrupted by SIGTERM"),
    (_raise(Interrupted(signal.SIGINT)), 130, "prog: interrupted by SIGINT"),
    (_raise(KeyboardInterrupt()), 130, "prog: interrupted by SIGINT"),
    (_raise(ZeroDivisionError("bug")), 1, "Traceback"),
])
def test_run_main_maps_errors_to_exit_codes(body, code, needle, capsys):
    assert run_main("prog", body) == code
    err = capsys.readouterr().err
    if needle is None:
        assert err == ""
    else:
        assert needle in err and err.count("\n") >= 1
        assert ("Traceback" in err) == (needle == "Traceback"), err


def test_run_main_lets_argparse_exit_through():
    with pytest.raises(SystemExit):
        run_main("prog", _raise(SystemExit(2)))


def test_partition_errors_are_mfgserve_errors_and_value_errors():
    from partition.graph_data import DatasetError
    from partition.layout import PartitionFormatError
    from partition.outdir import PartitionError

    for cls in (DatasetError, PartitionFormatError, PartitionError, CliError):
        assert issubclass(cls, MfgServeError) and issubclass(cls, ValueError), cls
        assert cls("x").exit_code == 2


def test_flattened_section_keys_may_be_written_at_the_top_level(tmp_path):
    cfg = load_config(WorkerModeConfig, str(write(tmp_path, "epochs: 3\nserver:\n  "
                                                         "num_workers: 3\n")), {})
    assert cfg.trainer.epochs == 3 and cfg.server.num_workers == 3
    node = load_config(ServerNodeConfig, str(write(tmp_path, "parts: p\nnum_workers: 4\n"
                                                             "cluster_out: c.yaml\n", "n.yaml")), {})
    assert node.server.parts == "p" and node.server.num_workers == 4
    assert node.cluster_out == "c.yaml"


def test_worker_mode_trainer_threads_split_the_cores_and_a_gpu_trainer_takes_one(monkeypatch):
    import torch

    from deploy import worker_mode

    monkeypatch.setattr(worker_mode.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def cfg(*argv: str) -> WorkerModeConfig:
        return load_config(WorkerModeConfig, None, vars(parse(WorkerModeConfig, list(argv))))

    assert worker_mode.trainer_threads(cfg()) == 16  # auto on a host without CUDA: the CPU
    assert worker_mode.trainer_threads(cfg("--num-trainers", "4")) == 4
    assert worker_mode.trainer_threads(cfg("--device", "cuda")) == 1
    assert worker_mode.trainer_threads(cfg("--device", "cuda", "--num-trainers", "2")) == 1
    assert worker_mode.trainer_threads(cfg("--device", "cuda", "--num-threads", "8")) == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert worker_mode.trainer_threads(cfg()) == 1  # auto with CUDA: the GPU
    assert worker_mode.trainer_threads(cfg("--device", "cpu")) == 16


def test_a_trainer_client_on_a_gpu_takes_one_thread_unless_told(monkeypatch):
    """trainer-client's --num-threads 0: torch's default on the CPU, 1 on a GPU (the device
    is stood in for: the policy is what is tested; the CUDA trainer tests run it for real).
    --malloc-retain-mb 0: this process's allocator stays as it is for the tests after."""
    import torch

    from trainer_client import train

    before = torch.get_num_threads()
    try:
        for device, argv, want in [("cpu", [], before), ("cuda", [], 1),
                                   ("cuda", ["--num-threads", "3"], 3),
                                   ("cpu", ["--num-threads", "2"], 2)]:
            torch.set_num_threads(before)
            monkeypatch.setattr(train, "pick_device", lambda cfg, rank, d=device:
                                torch.device(d))
            cfg = load_config(TrainerConfig, None,
                              vars(parse(TrainerConfig, ["--cluster", "c.yaml",
                                                          "--malloc-retain-mb", "0", *argv])))
            assert train._init_ddp(cfg, train.DDPSetup()).type == device
            assert torch.get_num_threads() == want, (device, argv)
    finally:
        torch.set_num_threads(before)
