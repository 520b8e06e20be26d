"""Config dataclasses per component, loaded from YAML with command-line overrides.

Precedence: dataclass defaults < ``--config FILE.yaml`` < explicit command-line options.
Defaults are written once, in the dataclasses below; ``--help`` text comes from each field's
``help`` metadata. Unknown YAML keys and wrongly typed values are errors naming the key, the
file and the accepted keys. Environment variables are not read here (see deploy/).

The machinery (:mod:`common.configtools`) is re-exported here: :func:`add_config_args` builds a
CLI's options from a dataclass, :func:`load_config` reads them back, and :func:`to_argv`, its
inverse, writes a config as a child's command line (every launcher uses it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from common.alloc import DEFAULT_RETAIN_MB, check_retain_mb
from common.configtools import Option as Option
from common.configtools import add_config_args as add_config_args
from common.configtools import from_argv as from_argv
from common.configtools import from_dict as from_dict
from common.configtools import load_config as load_config
from common.configtools import opt as opt
from common.configtools import options as options
from common.configtools import parse_int_list as parse_int_list
from common.configtools import to_argv as to_argv
from common.configtools import to_dict as to_dict
from common.errors import ConfigError
from common.limits import MAX_FANOUT, MAX_LAYERS

MODEL_NAMES = ("sage", "gcn", "gat", "dgl-sage")  # trainer_client.models.build_model
HETERO_MODEL_NAMES = ("rsage", "hetero-sage")  # typed models (trainer_client.hetero_model)
# --model: "auto" is rsage on a typed partition set, sage on a homogeneous one
TRAINER_MODELS = ("auto",) + MODEL_NAMES + HETERO_MODEL_NAMES
#: --local-features (trainer_client/local_features.py)
LOCAL_FEATURE_MODES = ("auto", "on", "off")
PREFETCH_MODES = ("auto", "overlap", "alternate")  # trainer_client.loader.DistNodeDataLoader
YIELD_CORES_MODES = ("auto", "off")  # trainer_client.core_turns.CoreTurns
PREFETCH_HELP = (
    "when sample requests are sent: 'overlap' keeps --max-inflight requests outstanding, so "
    "the servers sample the next batches while the model computes; 'alternate' sends "
    "--max-inflight requests at once only when none is outstanding and computes once all "
    "their replies are in, so sampling and compute take turns. On a CPU trainer whose torch "
    "threads use every core, a server on the same host preempts one of those threads and the "
    "others wait for it at each parallel step: taking turns is faster there "
    "(docs/benchmarks.md, session 24). 'auto' alternates on a CPU trainer with more than one "
    "torch thread and at least as many as the cores it may use, once a server has written "
    "into its shared-memory ring (a server on this host); otherwise it overlaps")
YIELD_CORES_HELP = (
    "while a window of sample requests is out and the trainer alternates with servers on this "
    "host (--prefetch), give the servers every core: the trainer pins its torch threads one "
    "per core and puts its OpenMP worker threads at SCHED_IDLE until the window's replies are "
    "in, so that their spinning after a step does not hold a core a server thread wants; "
    "during a step they are ordinary threads. 'auto' does so on a CPU trainer whose torch "
    "threads cover the cores, where a thread may leave SCHED_IDLE again (root, or "
    "RLIMIT_NICE >= 20), and says otherwise why not in the summary's core_turns; 'off' never "
    "(docs/tuning.md)")
LR_SCHEDULES = ("none", "step", "cosine")
EVAL_MODES = ("sampled", "full")
# --malloc-retain-mb of trainers and servers
RETAIN_HELP = (
    "keep freed blocks up to N MiB in this process for reuse (glibc malloc's mmap and trim "
    "thresholds) instead of returning them to the OS: every batch allocates and frees the "
    "same large tensors, and fresh pages cost their zeroing and page faults each time (a "
    "quarter of a CPU training step, docs/benchmarks.md). Costs resident memory up to the "
    "batch's peak plus N MiB; 0: the C library's defaults")


# torch threads of a trainer computing on a GPU unless --num-threads says otherwise: on an
# H200 node the seed model ran 2.8x (products) and 3.6x (RMAT) faster with 1 than with 16,
# the width of the machine (docs/benchmarks.md, "Issue 14, session 35")
GPU_TRAINER_THREADS = 1


def wants_cuda(device: str) -> bool:
    """Whether ``--device`` puts a trainer on a GPU: cuda, or auto where torch sees CUDA."""
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


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
    max_node_tensor_mb: int = opt(
        1024, "MiB of server-held node tensors (TENSOR_CREATE) a server holds at most, "
        "optimizer state included; a create beyond it gets a too_large error reply")
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
    replica_suspect_s: float = opt(
        30.0, "seconds a peer server that missed --peer-timeout-s (connection kept) is avoided "
        "while another replica of its part is up (common/replicas.py)")
    malloc_retain_mb: int = opt(DEFAULT_RETAIN_MB, RETAIN_HELP)
    nice: int = opt(
        0, "raise this server's scheduling niceness by N (0-19; its sampler processes inherit "
        "it): where trainers share the cores (worker mode), their compute then goes first and "
        "sampling fills the gaps, instead of both slowing each other's threads")

    def validate(self) -> None:
        if not 0 <= self.nice <= 19:
            raise ConfigError(f"--nice must be in 0..19, got {self.nice}")
        check_retain_mb(self.malloc_retain_mb)
        if self.replica_suspect_s < 0:
            raise ConfigError(f"--replica-suspect-s must be >= 0, got {self.replica_suspect_s}")
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


MATMUL_PRECISIONS = ("highest", "high", "medium")
MATMUL_PRECISION_HELP = (
    "precision of the model's float32 matrix products (torch.set_float32_matmul_precision): "
    "highest multiplies in float32 (as DGL's pipeline does by default); high lets an NVIDIA "
    "GPU (Ampere or later) use TF32 and changes nothing on a CPU; medium also multiplies in "
    "bfloat16 with float32 sums on a CPU with bfloat16 instructions: through torch on one "
    "with AMX (Intel Sapphire Rapids and later), through the model's own casts on one with "
    "AVX512-BF16 only (AMD Zen 4 and later; every model), the seed model's step about "
    "1.5x faster on "
    "either (docs/tuning.md); elsewhere it changes nothing. Not float32's results: each "
    "product is off by about 3e-3 of its size, and a run's losses and accuracy move by what "
    "two seeds would")


CPU_GEMMS = ("auto", "mkl", "onednn")
CPU_GEMM_HELP = (
    "which library multiplies the model's float32 products on a CPU (SAGEConv's and the "
    "typed layers'; the products stay float32 either way, only the order of their sums "
    "differs): mkl is torch's own (MKL, as DGL's pipeline multiplies); onednn is oneDNN's "
    "matmul, which runs AVX-512 kernels on AMD CPUs, where MKL runs AVX2 ones (the seed "
    "model's step about a fifth shorter on a Zen 5 AMD EPYC, docs/tuning.md); auto takes onednn "
    "on an AMD CPU of cpu family 26 or later (Zen 5) with AVX-512 and mkl elsewhere, Zen 4 "
    "included, whose AVX-512 multiplies at AVX2's rate (decided from the CPU, not by timing, so "
    "runs repeat to the bit). No effect on a GPU or where --matmul-precision medium multiplies "
    "in bfloat16")


def check_cpu_gemm(value: str) -> None:
    """ConfigError naming ``--cpu-gemm`` unless ``value`` is one of CPU_GEMMS."""
    if value not in CPU_GEMMS:
        raise ConfigError(f"--cpu-gemm must be one of {', '.join(CPU_GEMMS)}, got {value!r}")


def _check_matmul_precision(value: str) -> None:
    if value not in MATMUL_PRECISIONS:
        raise ConfigError(f"--matmul-precision must be one of {', '.join(MATMUL_PRECISIONS)}, "
                          f"got {value!r}")


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
    batch_locality: str = opt(
        "global", "how the training batches of an epoch are formed: 'global' shuffles all "
        "training seeds together (a batch mixes every part's seeds), 'part' shuffles each "
        "part's seeds, makes batches of one part's seeds (as DistDGL's trainers take their "
        "local part's seeds) and shuffles the batch order; a batch then goes to the server "
        "owning all of its seeds, so a partitioning with a lower edge cut needs fewer "
        "server-to-server requests", choices=["global", "part"])
    hidden: int = opt(256, "hidden size of the model's layers (--model)")
    dropout: float = opt(0.5, "dropout between the model's layers (--model)")
    lr: float = opt(3e-3, "Adam learning rate")
    weight_decay: float = opt(5e-4, "Adam weight decay")
    max_inflight: int = opt(4, "sample requests in flight per trainer (prefetch depth)")
    prefetch: str = opt("auto", PREFETCH_HELP, choices=list(PREFETCH_MODES))
    yield_cores: str = opt("auto", YIELD_CORES_HELP, choices=list(YIELD_CORES_MODES))
    cache_ratio: float = opt(
        0.0, "fraction of each part's nodes whose features this trainer caches on its device "
        "(the hottest, ranked by partition-ogbn's pre-sampling); servers skip sending them")
    node_emb_dim: int = opt(
        0, "width of a learnable embedding per node, held on the sampler servers and "
        "concatenated to the input features (DistDGL's DistEmbedding); 0 turns it off. On a "
        "typed partition set it is the input of each featureless node type (not in the set's "
        "feat_ntypes) instead of its zero rows; featured types keep their features")
    node_emb_lr: float = opt(
        0.01, "learning rate of the node embeddings' sparse Adam (run on the servers)")
    feat_transfer: str = opt(
        "", "dtype features travel in: float16 or bfloat16 halve the bytes on the wire (the "
        "model still computes in float32); empty sends them as stored")
    local_features: str = opt(
        "auto", "read each batch's input features from the partition files on this host "
        "(--parts-on-host) instead of the servers gathering them into the reply: 'auto' does "
        "so for a CPU trainer of a homogeneous float32 set whose parts are all on this host, "
        "with a GraphSAGE model, no --cache-ratio and no --feat-transfer (the summary's "
        "local_features says whether and why not); 'on' insists (an error names what is "
        "missing); 'off' keeps the servers' gather (trainer_client/local_features.py)", choices=list(LOCAL_FEATURE_MODES))
    parts_on_host: str = opt(
        "", "the partition set the servers serve, where this trainer can read it (same host); "
        "worker mode sets it; --local-features reads its features")
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
    deterministic_sampling: bool = opt(
        True, "send every batch a sample seed derived from (seed, epoch, rank, batch), so the "
        "servers sample the same MFGs in every run with the same seed (needed for --resume to "
        "match an uninterrupted run); off: each server's own random stream through DGL's "
        "sampler (not faster: the seeded sampler's native passes take less time per edge, "
        "docs/benchmarks.md)")
    device: str = opt("auto", "auto (cuda if available, else cpu), cpu, or cuda")
    num_threads: int = opt(
        0, "torch CPU threads of this trainer; 0: torch's default on the CPU, 1 on a GPU "
        "(its host work gains nothing from more, and several GPU trainers on a node would "
        "each start a team as wide as the machine). worker-mode sets cores / trainers on the "
        "CPU so co-located processes do not oversubscribe it, and 1 on a GPU")
    matmul_precision: str = opt("highest", MATMUL_PRECISION_HELP, choices=MATMUL_PRECISIONS)
    cpu_gemm: str = opt("auto", CPU_GEMM_HELP, choices=CPU_GEMMS)
    malloc_retain_mb: int = opt(
        DEFAULT_RETAIN_MB, RETAIN_HELP + ". A CPU trainer also faults in its first steps' "
        "heap (an estimate of the step's working set, at most N - 16 MiB) in a background "
        "thread during its setup, so the first steps do not pay those page faults "
        "(summary: heap_prefault); 0 turns that off as well")
    eval_every: int = opt(1, "evaluate on valid/test every N epochs (0: only after the last)")
    seed: int = opt(0, "random seed for shuffling, model init and dropout")
    run_dir: str = opt(
        "", "directory for this run's outputs (config.json, metrics.jsonl, summary.json, "
        "best_model.pt, checkpoints/); empty: a new runs/<UTC yyyymmdd-HHMMSS>-<6 hex> "
        "(trainer-client: under the current directory; worker-mode: under --work-dir). With "
        "--resume and neither --run-dir nor --checkpoint-dir: the newest run in that runs/ "
        "that has a checkpoint")
    model: str = opt(
        "auto", "model: sage (GraphSAGE, mean aggregation), gcn, gat (plain torch), dgl-sage "
        "(dgl.nn.SAGEConv through Block.to_dgl(); needs dgl); typed models (over typed MFGs, "
        "any partition set): rsage (relational GraphSAGE: one linear per relation, mean per "
        "relation, summed, one self loop and bias per node type) or hetero-sage (exactly "
        "dgl.nn.HeteroGraphConv({rel: SAGEConv((d_src, d_dst), out, 'mean')}, "
        "aggregate='sum') in plain torch: a SAGEConv fc_self, bias and fc_neigh per relation "
        "with DGL's init, the model a DGL user has; same function as rsage, other parameters "
        "and training dynamics); auto: rsage on a typed (heterogeneous) partition set, sage "
        "otherwise", choices=TRAINER_MODELS)
    rel_fanouts: str = opt(
        "", "typed partition sets: per-relation fanouts, one group per layer (input layer "
        "first) separated by '/', each 'REL=N' pairs separated by ':' (REL: a relation name "
        "of the set's etypes, e.g. 'writes=10:cites=5/writes=5:cites=3'); a relation not "
        "named takes that layer's --fanouts value, 0 samples none of it. Empty: --fanouts "
        "for every relation")
    gat_heads: int = opt(4, "attention heads per GAT layer (--model gat)")
    patience: int = opt(
        0, "early stopping: stop after this many evaluations (every --eval-every epochs) "
        "without a better validation accuracy; every rank stops at the same epoch. 0: off")
    lr_schedule: str = opt(
        "none", "learning-rate schedule, stepped once per epoch: none, step (multiply by "
        "--lr-gamma every --lr-step-epochs epochs) or cosine (from --lr down to 0 over "
        "--epochs)", choices=LR_SCHEDULES)
    lr_step_epochs: int = opt(10, "--lr-schedule step: epochs between learning-rate cuts")
    lr_gamma: float = opt(0.5, "--lr-schedule step: factor of each learning-rate cut")
    grad_clip: float = opt(
        0.0, "clip the gradients (averaged over the ranks) to this global L2 norm before each "
        "step; 0: off. metrics.jsonl then records the largest norm seen per epoch")
    profile_steps: int = opt(
        0, "profile this many training steps of the run's first epoch with torch.profiler "
        "(host operators, and CUDA kernels on a GPU), after 5 steps of warm-up; rank 0 writes "
        "the operators by self time to <run dir>/profile.txt (files.profile in the summary). "
        "0: off")
    eval: str = opt(
        "sampled", "how validation/test accuracy is measured: sampled (mini-batches with "
        "--eval-fanouts) or full (layer-wise full-neighbour inference over every node)",
        choices=EVAL_MODES)
    checkpoint_dir: str = opt(
        "", "directory for checkpoints (checkpoints/epoch-NNNNNN.pt, the newest two kept); "
        "empty: <run dir>/checkpoints")
    checkpoint_every: int = opt(
        5, "write a checkpoint every N epochs and after the last (or early-stopped) epoch; "
        "0: never")
    resume: bool = opt(
        False, "continue from the newest checkpoint in the checkpoint directory (same result "
        "as an uninterrupted run); a checkpoint of another configuration or partition set is "
        "refused. metrics.jsonl of the run directory is appended to", negatable=False)
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
    replica_suspect_s: float = opt(
        30.0, "seconds a server that missed --request-timeout-s (connection kept) is avoided "
        "while another replica of its part is up (common/replicas.py)")

    def validate(self) -> None:
        if self.replica_suspect_s < 0:
            raise ConfigError(f"--replica-suspect-s must be >= 0, got {self.replica_suspect_s}")
        if not self.cluster:
            raise ConfigError("trainer-client needs --cluster FILE.yaml (server endpoints)")
        _check_fanouts(self.fanouts, "--fanouts")
        parse_rel_fanouts(self.rel_fanouts, self.fanouts)
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
        if self.node_emb_dim < 0 or self.node_emb_dim > 2**16:
            raise ConfigError(f"--node-emb-dim must be in [0, 65536] (0: off), got "
                              f"{self.node_emb_dim}")
        if not 0.0 < self.node_emb_lr < float("inf"):
            raise ConfigError(f"--node-emb-lr must be > 0, got {self.node_emb_lr}")
        if self.feat_transfer not in ("", "float32", "float16", "bfloat16"):
            raise ConfigError(f"--feat-transfer must be float32, float16 or bfloat16, got "
                              f"{self.feat_transfer!r}")
        if self.num_threads < 0:
            raise ConfigError(f"--num-threads must be >= 0, got {self.num_threads}")
        _check_matmul_precision(self.matmul_precision)
        check_cpu_gemm(self.cpu_gemm)
        check_retain_mb(self.malloc_retain_mb)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.request_timeout_s <= 0:
            raise ConfigError("--request-timeout-s must be > 0")
        if self.shm_ring_mb < 0:
            raise ConfigError(f"--shm-ring-mb must be >= 0, got {self.shm_ring_mb}")
        _check_heartbeat(self.heartbeat_s, self.heartbeat_timeout_s)
        self._validate_controls()

    def _validate_controls(self) -> None:
        """The training controls, run directory and checkpoint options."""
        for name, value, accepted in (("model", self.model, TRAINER_MODELS),
                                      ("lr-schedule", self.lr_schedule, LR_SCHEDULES),
                                      ("eval", self.eval, EVAL_MODES)):
            if value not in accepted:
                raise ConfigError(f"--{name} must be one of {', '.join(accepted)}, "
                                  f"got {value!r}")
        for name in ("gat_heads", "lr_step_epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got "
                                  f"{getattr(self, name)}")
        for name in ("patience", "checkpoint_every", "profile_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 (0: off), got "
                                  f"{getattr(self, name)}")
        if not 0 < self.lr_gamma <= 1:
            raise ConfigError(f"--lr-gamma must be in (0, 1], got {self.lr_gamma}")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ConfigError(f"--grad-clip must be a finite number >= 0 (0: off), got "
                              f"{self.grad_clip}")


def parse_rel_fanouts(text: str, fanouts: list[int]) -> list[dict[str, int]]:
    """``--rel-fanouts`` as one {relation name: fanout} dict per layer (empty text: no
    per-relation fanouts, ``[]``); a malformed value is a ConfigError naming the option."""
    if not text:
        return []
    layers = text.split("/")
    if len(layers) != len(fanouts):
        raise ConfigError(f"--rel-fanouts must have one '/'-separated group per layer like "
                          f"--fanouts {fanouts} ({len(fanouts)}), got {len(layers)} in {text!r}")
    out = []
    for group in layers:
        layer: dict[str, int] = {}
        for pair in (p for p in group.split(":") if p):
            name, eq, value = pair.partition("=")
            try:
                f = int(value)
            except ValueError:
                f = -2
            if not eq or not name or not (f == -1 or 0 <= f <= MAX_FANOUT) or name in layer:
                raise ConfigError(f"--rel-fanouts: {pair!r} in {text!r} must be REL=N with a "
                                  f"relation name given once per layer and N -1 (all) or "
                                  f"0..{MAX_FANOUT}, e.g. 'writes=10:cites=5/writes=5:cites=3'")
            layer[name] = f
        out.append(layer)
    return out


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
    infer: bool = opt(
        False, "after training, run mfgserve-infer through the same servers: layer-wise "
        "full-neighbour inference of best_model.pt over every node, written to "
        "<run dir>/inference; the summary's 'inference' names the files (needs "
        "--servers-per-part 1)", negatable=False)
    trainer: TrainerConfig = field(
        default_factory=TrainerConfig,
        metadata={"help": "trainer options", "flatten": True,
                  "skip": ("cluster", "summary_out", "curve_secret_key", "parts_on_host")}
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
        if self.infer and self.servers_per_part != 1:
            raise ConfigError("--infer keeps each layer's outputs on the servers, one copy per "
                              "part: use --servers-per-part 1 (or run mfgserve-infer later "
                              "against a cluster with one server per part)")
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


@dataclass
class DDPConfig:
    """A trainer's place in its DDP job (torchrun sets these through RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""

    rank: int = opt(0, "this trainer's DDP rank")
    world_size: int = opt(1, "number of trainers in the job")
    local_rank: int = opt(0, "rank on this node; picks the GPU")
    master_addr: str = opt("127.0.0.1", "address of rank 0 for DDP rendezvous")
    master_port: int = opt(29500, "port of rank 0 for DDP rendezvous")
    ddp_timeout_s: float = opt(300.0, "seconds a DDP collective may wait for the other ranks")
    done_file: str = opt(
        "", "write this file once this rank is finished (rank 0's summary delivered, every "
        "rank past the final barrier); a launcher counts a rank that dies after writing it, in "
        "teardown, as finished")
    launcher_tty: bool = opt(
        False, "set by a launcher whose own stderr is a terminal: this trainer draws progress "
        "bars although its stderr is a pipe to the launcher (which shows them in place)")

    def validate(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"--rank {self.rank} must be in [0, --world-size "
                              f"{self.world_size})")


@dataclass
class ServerNodeConfig:
    """server-node: start and supervise the sampler servers of one host."""

    cluster: str = opt("", "cluster file listing every server; this node starts those on "
                       "--host", mutex="servers", mutex_required=True)
    cluster_out: str = opt("", "write a cluster file for all parts of --parts on --host, with "
                           "free ports, then start those servers", mutex="servers",
                           mutex_required=True)
    host: str = opt("127.0.0.1", "this host's address as written in the cluster file")
    replicas: int = opt(1, "with --cluster-out: servers per part")
    startup_timeout_s: float = opt(120.0, "seconds to wait for every server to answer a ping")
    shutdown_timeout_s: float = opt(
        10.0, "seconds to wait for servers to exit before killing them")
    server: ServerConfig = field(
        default_factory=ServerConfig,
        metadata={"help": "server options", "flatten": True,
                  "skip": ("part_id", "bind", "cluster", "ready_file", "shutdown_token_file")})

    def validate(self) -> None:
        if bool(self.cluster) == bool(self.cluster_out):
            raise ConfigError("server-node needs one of --cluster FILE (start the servers it "
                              "lists on --host) or --cluster-out FILE (write one)")
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        self.server.validate()


@dataclass
class KeysConfig:
    """mfgserve-keys: one CurveZMQ key pair."""

    out: str = opt("", "directory to write NAME.key and NAME.key_secret into (created if "
                   "missing); required", metavar="DIR")
    name: str = opt("", "key pair name, e.g. server or trainer-a; required")
    authorize: str = opt("", "also copy the public key into this authorized-clients directory "
                         "(created if missing)", metavar="DIR")
    force: bool = opt(False, "overwrite an existing key pair", negatable=False)

    def validate(self) -> None:
        if not self.out or not self.name:
            raise ConfigError("mfgserve-keys needs --out DIR and --name NAME")


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


@dataclass
class PlotConfig:
    """mfgserve-plot RUN_DIR: PNG charts (loss, accuracy, throughput, stage times) of one
    training run, drawn from RUN_DIR/metrics.jsonl."""

    out: str = opt("", "directory to write the PNG files into (created if missing); empty: "
                   "RUN_DIR/plots", metavar="DIR")
    dpi: int = opt(100, "resolution of the PNG files in dots per inch (30-600)")

    def validate(self) -> None:
        if not 30 <= self.dpi <= 600:
            raise ConfigError(f"--dpi must be in 30..600, got {self.dpi}")


@dataclass
class InferConfig:
    """mfgserve-infer: layer-wise full-neighbour inference of a trained model over every node
    of the graph the running servers serve; writes predictions, logits and embeddings per part
    (npy) and an index.json."""

    cluster: str = opt("", "cluster YAML listing the running servers, exactly one per part "
                       "(the layer outputs are node tensors held by the servers); required")
    run_dir: str = opt(
        "", "a training run's directory: --model defaults to RUN_DIR/best_model.pt, --out to "
        "RUN_DIR/inference, and RUN_DIR/summary.json gives the sampled accuracy to compare",
        metavar="DIR")
    model: str = opt("", "model file written by training (best_model.pt, format "
                     "mfgserve-model/1); empty: RUN_DIR/best_model.pt", metavar="FILE")
    out: str = opt("", "directory for the outputs (part-K/*.npy, index.json); empty: "
                   "RUN_DIR/inference", metavar="DIR")
    parts: str = opt(
        "", "the servers' partition set directory, if readable here: orig_ids.npy then holds "
        "the original dataset ids; without it, the global node ids (index.json says which)",
        metavar="DIR")
    batch_size: int = opt(
        1024, "nodes per one-layer full-neighbour request; lower it if a reply exceeds "
        "--max-message-mb (high in-degree nodes, wide features)")
    max_inflight: int = opt(4, "sample requests in flight (prefetch depth)")
    device: str = opt("auto", "auto (cuda if available, else cpu), cpu, or cuda",
                      choices=("auto", "cpu", "cuda"))
    num_threads: int = opt(0, "torch CPU threads; 0 keeps torch's default")
    matmul_precision: str = opt("highest", MATMUL_PRECISION_HELP, choices=MATMUL_PRECISIONS)
    cpu_gemm: str = opt("auto", CPU_GEMM_HELP, choices=CPU_GEMMS)
    max_message_mb: int = opt(
        512, "largest message accepted, in MiB; node tensor reads and writes are cut into "
        "chunks below it")
    request_timeout_s: float = opt(60.0, "seconds to wait for a server's reply")
    heartbeat_s: float = opt(
        1.0, "seconds between heartbeats to each server; 0 turns heartbeats off")
    heartbeat_timeout_s: float = opt(
        5.0, "a server that answers no heartbeat for this many seconds is treated as dead")
    replica_suspect_s: float = opt(
        30.0, "seconds a server that missed --request-timeout-s is avoided (common/replicas.py)")
    curve_secret_key: str = opt(
        "", "CurveZMQ: this client's secret key file (NAME.key_secret from mfgserve-keys)")
    progress: bool = opt(True, "show a progress bar per layer (on a terminal, on stderr)")

    def validate(self) -> None:
        if not self.cluster:
            raise ConfigError("mfgserve-infer needs --cluster FILE.yaml (the running servers)")
        if not (self.model or self.run_dir):
            raise ConfigError("mfgserve-infer needs --run-dir DIR (a training run, with "
                              "best_model.pt) or --model FILE")
        if not (self.out or self.run_dir):
            raise ConfigError("mfgserve-infer needs --out DIR (or --run-dir DIR: outputs go "
                              "to DIR/inference)")
        for name in ("batch_size", "max_inflight", "max_message_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.num_threads < 0:
            raise ConfigError(f"--num-threads must be >= 0, got {self.num_threads}")
        _check_matmul_precision(self.matmul_precision)
        check_cpu_gemm(self.cpu_gemm)
        if self.request_timeout_s <= 0:
            raise ConfigError("--request-timeout-s must be > 0")
        _check_heartbeat(self.heartbeat_s, self.heartbeat_timeout_s)


@dataclass
class StatusConfig:
    """mfgserve-status: ask every server of a cluster file what it is doing."""

    cluster: str = opt("", "cluster YAML listing every part's server endpoints (required)",
                       metavar="FILE")
    json: bool = opt(False, "print one JSON document instead of the table", negatable=False)
    timeout_s: float = opt(
        5.0, "seconds to wait for all the servers together (they are asked at once); a "
        "server that has not answered by then is reported down, with why")
    curve_secret_key: str = opt(
        "", "CurveZMQ: this client's secret key file (NAME.key_secret from mfgserve-keys); "
        "needed when the cluster file names curve_server_key", metavar="FILE")

    def validate(self) -> None:
        if not self.cluster:
            raise ConfigError("mfgserve-status needs --cluster FILE.yaml")
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout-s must be > 0, got {self.timeout_s}")
