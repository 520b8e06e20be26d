"""Config dataclasses per component, loaded from YAML with command-line overrides.

Precedence: dataclass defaults < ``--config FILE.yaml`` < explicit command-line options.
Defaults are written once, in the dataclasses below; ``--help`` text comes from each field's
``help`` metadata. Unknown YAML keys and wrongly typed values are errors naming the key, the
file and the accepted keys. Environment variables are not read here (see deploy/).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from common.errors import ConfigError
from common.limits import MAX_FANOUT, MAX_LAYERS

T = TypeVar("T")


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with a default and its --help text."""
    if isinstance(default, list):
        items = list(default)
        return field(default_factory=items.copy, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def parse_int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip() != ""]
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 10,10, got {text!r}"
        ) from e


@dataclass
class ServerConfig:
    """One sampler server process: which partition it serves and where."""

    parts: str = opt("", "partition set directory written by partition-ogbn (required)")
    part_id: int = opt(0, "which partition of --parts this server loads")
    bind: str = opt(
        "tcp://127.0.0.1:15550",
        "ZeroMQ endpoint to serve on, e.g. tcp://0.0.0.0:15550 or ipc:///tmp/s0; "
        "tcp port * or 0 picks a free port (printed at startup)",
    )
    cluster: str = opt(
        "",
        "cluster YAML listing server endpoints per partition; needed when the partition set has "
        "more than one part, so this server can sample and fetch across part boundaries",
    )
    num_workers: int = opt(2, "sampling threads per server process (when --sampler-procs is 0)")
    sampler_procs: int = opt(
        0, "sampler worker processes per server, each mapping the same partition files (the "
        "page cache holds one copy); 0 samples in --num-workers threads of the server process")
    max_queue: int = opt(64, "sample requests queued per server before it replies 'busy'")
    max_message_mb: int = opt(512, "largest message accepted or sent, in MiB")
    max_peer_backlog_mb: int = opt(
        256, "MiB of replies a server holds for one client that is not reading them; "
        "further replies to it are dropped (STATS replies_dropped) until it reads. A single "
        "reply larger than this is still sent when nothing else is queued for that client")
    peer_timeout_s: float = opt(
        30.0, "seconds to wait for another server's reply before failing the request"
    )
    seed: int = opt(0, "random seed of the neighbour sampler")
    heartbeat_s: float = opt(
        1.0, "seconds between heartbeats on every connection (to trainers and other servers); "
        "0 turns heartbeats off")
    heartbeat_timeout_s: float = opt(
        5.0, "a peer that answers no heartbeat for this many seconds is treated as dead: its "
        "connection is dropped (requests in flight to it fail over)")
    ready_file: str = opt("", "write the bound endpoint to this file once serving (launchers)")
    shutdown_token_file: str = opt(
        "", "file holding a secret token (16+ characters); a Shutdown message must carry it. "
        "Without it the server refuses every Shutdown message (stop it with SIGTERM). "
        "Launchers create one per run")
    curve_secret_key: str = opt(
        "", "CurveZMQ: the servers' secret key file (server.key_secret from mfgserve-keys); "
        "enables authentication and encryption; needs --curve-authorized-keys")
    curve_authorized_keys: str = opt(
        "", "CurveZMQ: directory of public key files (*.key) of the clients allowed to connect "
        "(trainers, and the servers' own key for server-to-server requests)")

    def validate(self) -> None:
        if not self.parts:
            raise ConfigError("sampler-server needs --parts DIR (a partition set)")
        if self.part_id < 0:
            raise ConfigError(f"--part-id must be >= 0, got {self.part_id}")
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers must be >= 1, got {self.num_workers}")
        if self.sampler_procs < 0:
            raise ConfigError(f"--sampler-procs must be >= 0, got {self.sampler_procs}")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.peer_timeout_s <= 0:
            raise ConfigError(f"--peer-timeout-s must be > 0, got {self.peer_timeout_s}")
        if self.max_peer_backlog_mb < 1:
            raise ConfigError(f"--max-peer-backlog-mb must be >= 1, got "
                              f"{self.max_peer_backlog_mb}")
        _check_endpoint(self.bind, "--bind")
        _check_heartbeat(self.heartbeat_s, self.heartbeat_timeout_s)
        if bool(self.curve_secret_key) != bool(self.curve_authorized_keys):
            raise ConfigError("--curve-secret-key and --curve-authorized-keys go together")


@dataclass
class TrainerConfig:
    """One trainer process (a DDP rank): model, optimisation, and how it talks to servers."""

    cluster: str = opt("", "cluster YAML listing server endpoints per partition (required)")
    fanouts: list[int] = opt(
        [10, 10],
        "neighbours sampled per layer, input layer first, comma-separated; -1 takes all",
    )
    eval_fanouts: list[int] = opt(
        [], "fanouts for validation/test sampling; empty means the same as --fanouts"
    )
    batch_size: int = opt(1024, "training seeds per mini-batch (per trainer)")
    eval_batch_size: int = opt(
        1024, "seeds per validation/test mini-batch (does not change the accuracy measured)")
    epochs: int = opt(10, "training epochs")
    hidden: int = opt(256, "hidden size of GraphSAGE")
    dropout: float = opt(0.5, "dropout between GraphSAGE layers")
    lr: float = opt(3e-3, "Adam learning rate")
    weight_decay: float = opt(5e-4, "Adam weight decay")
    max_inflight: int = opt(4, "sample requests in flight per trainer (prefetch depth)")
    cache_ratio: float = opt(
        0.0, "fraction of each part's nodes whose features this trainer caches on its device "
        "(the hottest, ranked by partition-ogbn's pre-sampling); servers skip sending them")
    feat_transfer: str = opt(
        "", "dtype features travel in: float16 or bfloat16 halve the bytes on the wire (the "
        "model still computes in float32); empty sends them as stored")
    request_timeout_s: float = opt(
        60.0, "seconds to wait for a server's reply before failing with an error"
    )
    shm_ring: bool = opt(
        True, "offer servers on this host a ring of shared-memory slots (page-locked with "
        "CUDA) to write batch features into, instead of sending them through the socket; "
        "servers elsewhere send them on the wire as usual")
    shm_ring_mb: int = opt(
        0, "size of that ring in MiB (max-inflight + 2 slots); 0 sizes each slot for the "
        "largest possible batch (input-node bound from batch size and fanouts), capped at "
        "4096 MiB in all. A batch too large for its slot goes on the wire")
    device: str = opt("auto", "auto (cuda if available, else cpu), cpu, or cuda")
    num_threads: int = opt(
        0, "torch CPU threads of this trainer; 0 keeps torch's default (worker-mode sets "
        "cores / trainers so co-located processes do not oversubscribe the CPU)")
    eval_every: int = opt(1, "evaluate on valid/test every N epochs (0: only after the last)")
    seed: int = opt(0, "random seed for shuffling, model init and dropout")
    progress: bool = opt(True, "show tqdm progress bars (rank 0, on stderr)")
    summary_out: str = opt("", "also write the JSON summary to this file")
    max_message_mb: int = opt(512, "largest message accepted, in MiB")
    heartbeat_s: float = opt(
        1.0, "seconds between heartbeats to each server; 0 turns heartbeats off")
    heartbeat_timeout_s: float = opt(
        5.0, "a server that answers no heartbeat for this many seconds is treated as dead: "
        "requests in flight to it are re-sent to a replica (or the trainer stops)")
    curve_secret_key: str = opt(
        "", "CurveZMQ: this trainer's secret key file (NAME.key_secret from mfgserve-keys); "
        "the servers' public key comes from the cluster file's curve_server_key")

    def validate(self) -> None:
        if not self.cluster:
            raise ConfigError("trainer-client needs --cluster FILE.yaml (server endpoints)")
        _check_fanouts(self.fanouts, "--fanouts")
        if self.eval_fanouts:
            _check_fanouts(self.eval_fanouts, "--eval-fanouts")
            if len(self.eval_fanouts) != len(self.fanouts):
                raise ConfigError(
                    f"--eval-fanouts must have one entry per layer like --fanouts "
                    f"{self.fanouts}, got {self.eval_fanouts}")
        for name in ("batch_size", "eval_batch_size", "epochs", "hidden", "max_inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.cache_ratio <= 1.0:
            raise ConfigError(f"--cache-ratio must be in [0, 1], got {self.cache_ratio}")
        if self.feat_transfer not in ("", "float32", "float16", "bfloat16"):
            raise ConfigError(f"--feat-transfer must be float32, float16 or bfloat16, got "
                              f"{self.feat_transfer!r}")
        if self.num_threads < 0:
            raise ConfigError(f"--num-threads must be >= 0, got {self.num_threads}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.request_timeout_s <= 0:
            raise ConfigError("--request-timeout-s must be > 0")
        if self.shm_ring_mb < 0:
            raise ConfigError(f"--shm-ring-mb must be >= 0, got {self.shm_ring_mb}")
        _check_heartbeat(self.heartbeat_s, self.heartbeat_timeout_s)


@dataclass
class WorkerModeConfig:
    """worker-mode: servers for every partition plus trainers, all on this node."""

    parts: str = opt("", "partition set to serve (made by partition-ogbn)")
    dataset_dir: str = opt(
        "",
        "dataset in OGB raw layout to partition on the fly instead of --parts; "
        "with neither, a synthetic graph is generated (see --synthetic-nodes)",
    )
    num_parts: int = opt(2, "partitions to create with --dataset-dir or the synthetic default")
    synthetic_nodes: int = opt(20000, "nodes of the default synthetic graph")
    work_dir: str = opt(
        "data/worker-mode", "where on-the-fly partitions and the default dataset are cached"
    )
    num_trainers: int = opt(1, "trainer processes (DDP ranks) on this node")
    servers_per_part: int = opt(1, "sampler server processes per partition (replicas)")
    startup_timeout_s: float = opt(120.0, "seconds to wait for every server to answer a ping")
    shutdown_timeout_s: float = opt(10.0, "seconds to wait for children to exit before killing")
    trainer: TrainerConfig = field(
        default_factory=TrainerConfig,
        metadata={"help": "trainer options", "flatten": True,
                  "skip": ("cluster", "summary_out", "curve_secret_key")}
    )
    server: ServerConfig = field(
        default_factory=ServerConfig,
        metadata={"help": "server options", "prefix": "server-",
                  "skip": ("parts", "part_id", "bind", "cluster", "ready_file",
                           "shutdown_token_file",
                           "curve_secret_key", "curve_authorized_keys")},
    )

    def validate(self) -> None:
        if self.parts and self.dataset_dir:
            raise ConfigError("give --parts or --dataset-dir, not both")
        if self.num_trainers < 1:
            raise ConfigError(f"--num-trainers must be >= 1, got {self.num_trainers}")
        if self.servers_per_part < 1:
            raise ConfigError(f"--servers-per-part must be >= 1, got {self.servers_per_part}")
        if self.num_parts < 1:
            raise ConfigError(f"--num-parts must be >= 1, got {self.num_parts}")
        if self.synthetic_nodes < 100:
            raise ConfigError("--synthetic-nodes must be >= 100")
        if self.trainer.request_timeout_s <= self.server.peer_timeout_s:
            raise ConfigError(
                f"--request-timeout-s ({self.trainer.request_timeout_s}) must exceed "
                f"--server-peer-timeout-s ({self.server.peer_timeout_s}): a server waiting on "
                "a hung peer must answer with an error before the trainer gives up on it")
        # The launcher writes the cluster file itself; check everything else now.
        dataclasses.replace(self.trainer, cluster="<launcher>").validate()
        dataclasses.replace(self.server, parts="<launcher>").validate()


def _check_fanouts(fanouts: list[int], flag: str) -> None:
    if not 1 <= len(fanouts) <= MAX_LAYERS or any(
            f != -1 and not 1 <= f <= MAX_FANOUT for f in fanouts):
        raise ConfigError(
            f"{flag} needs 1..{MAX_LAYERS} comma-separated entries, each -1 (all neighbours) "
            f"or 1..{MAX_FANOUT} (the most a server accepts), got {fanouts}")


def _check_heartbeat(interval: float, timeout: float) -> None:
    if interval < 0 or (interval > 0 and timeout < interval):
        raise ConfigError(f"need --heartbeat-s >= 0 and --heartbeat-timeout-s >= --heartbeat-s, "
                          f"got {interval} and {timeout}")


def _check_endpoint(ep: str, flag: str) -> None:
    if not any(ep.startswith(p) for p in ("tcp://", "ipc://", "inproc://")):
        raise ConfigError(
            f"{flag} {ep!r} is not a ZeroMQ endpoint; use tcp://HOST:PORT or ipc:///path"
        )


# ---------------------------------------------------------------- loading machinery


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check a YAML value against a field type; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (list,):
        (inner,) = typing.get_args(tp)
        if isinstance(value, str) and inner is int:
            return parse_int_list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported config type {tp}")


def from_dict(cls: type[T], data: dict, where: str) -> T:
    """Build ``cls`` from a (YAML) dict; unknown keys and bad types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of option: value, got {type(data).__name__}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{where}: unknown option(s) {unknown}; valid options are {sorted(names)}"
        )
    kwargs = {}
    for key, value in data.items():
        tp = hints[key]
        if _is_dataclass_type(tp):
            kwargs[key] = from_dict(tp, value or {}, f"{where}.{key}")
        else:
            kwargs[key] = _coerce(value, tp, f"{where}: option {key!r}")
    return cls(**kwargs)


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    prefix: str = "",
                    skip: tuple[str, ...] = ()) -> None:
    """Add one ``--option`` per field of ``cls`` (nested dataclasses flattened or prefixed).

    Options default to ``argparse.SUPPRESS`` so only those given override the YAML file.
    """
    hints = _hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            sub_prefix = "" if f.metadata.get("flatten") else f.metadata.get("prefix", f.name + "-")
            group = parser.add_argument_group(f.metadata.get("help", f.name))
            add_config_args(group, tp, prefix + sub_prefix, tuple(f.metadata.get("skip", ())))
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = (prefix + f.name).replace("-", "_")
        default = getattr(defaults, f.name)
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        help_text = f"{f.metadata.get('help', '')} (default: {shown!r})"
        if tp is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(tp) is list:
            parser.add_argument(flag, dest=dest, type=parse_int_list, default=argparse.SUPPRESS,
                                metavar="N,N", help=help_text)
        else:
            parser.add_argument(flag, dest=dest, type=tp, default=argparse.SUPPRESS,
                                help=help_text)


def _apply_overrides(cfg: Any, ns: dict, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        if f.name in skip:
            continue
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            sub_prefix = "" if f.metadata.get("flatten") else f.metadata.get("prefix", f.name + "-")
            _apply_overrides(getattr(cfg, f.name), ns, prefix + sub_prefix,
                             tuple(f.metadata.get("skip", ())))
            continue
        dest = (prefix + f.name).replace("-", "_")
        if dest in ns:
            setattr(cfg, f.name, ns[dest])


def load_config(cls: type[T], config_path: str | None, cli: argparse.Namespace | dict) -> T:
    """Defaults, then the YAML file (if any), then the explicitly given CLI options; validated."""
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; fix --config")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
        cfg = from_dict(cls, data, str(path))
    else:
        cfg = cls()
    ns = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli)
    _apply_overrides(cfg, ns)
    _validate_tree(cfg)
    return cfg


def _validate_tree(cfg: Any) -> None:
    if hasattr(cfg, "validate"):
        cfg.validate()


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
