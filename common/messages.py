"""Typed wire messages: one small dataclass per message type, and the explicit type enum.

Fields annotated ``Tensor`` or ``list[Tensor]`` travel as raw frames; every other field is a
scalar in the msgpack header. The frame layout itself lives in :mod:`common.codec` only.
Each class's :meth:`check` states the domain constraints a receiver relies on; the codec
calls it on every decoded message, so handlers never see an ill-formed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch
from torch import Tensor

from common.limits import MAX_FANOUT, MAX_LAYERS
from common.message_base import Message, MsgType, check_set_id
from common.sampled_mfg import SampledMFG
from common.shm_ring import SlotRef
from common.structs import (
    MAX_ID,  # noqa: F401 (re-exported)
    Struct,
)
from common.structs import check_ids as _check_ids
from common.structs import check_unique as _check_unique
from common.structs import need as _need
from common.tensor_messages import (  # noqa: F401 (re-exported)
    NODE_TENSOR_DTYPES,
    NODE_TENSOR_INITS,
    NODE_TENSOR_OPTIMIZERS,
    TensorCreate,
    TensorDrop,
    TensorInfo,
    TensorRead,
    TensorRows,
    TensorUpdate,
    TensorWrite,
)

# 2: partition-set ids (set_id), Shutdown token; 3: nested structs: the MFG reply carries a
# SampledMFG, SAMPLE's ring slot is one SlotRef; 4: STATUS, seeded sampling (SAMPLE
# sample_seed, NEIGHBORS seed), node tensor optimizer state, SAMPLE without features;
# 5: typed graphs: SAMPLE rel_fanouts (per-relation fanouts), NEIGHBORS etype; 6: PONG names
# the task (task_type, num_tasks, eval_metric)
PROTOCOL_VERSION = 6
FEAT_TRANSFER_DTYPES = {"": None, "float32": torch.float32, "float16": torch.float16,
                        "bfloat16": torch.bfloat16}


def _check_fanouts(fanouts: list[int]) -> None:
    _need(1 <= len(fanouts) <= MAX_LAYERS, "bad_fanouts",
          f"fanouts must have 1..{MAX_LAYERS} entries, got {len(fanouts)}")
    _need(all(f == -1 or 1 <= f <= MAX_FANOUT for f in fanouts), "bad_fanouts",
          f"each fanout must be -1 or 1..{MAX_FANOUT}, got {fanouts}")


def _check_rel_fanouts(rel: list[RelFanouts], layers: int) -> None:
    if not rel:
        return
    _need(len(rel) == layers, "bad_field",
          f"rel_fanouts must have one entry per layer (as fanouts: {layers}), got {len(rel)}")
    widths = {len(r.fanouts) for r in rel}
    _need(len(widths) == 1, "bad_field",
          "rel_fanouts must give every layer the same number of relations (one per relation "
          f"id of the partition set's etypes), got {[len(r.fanouts) for r in rel]}")


_check_set_id = check_set_id
MAX_RELATIONS = 1024  # relations of a typed set (etype.npy is int16)
MAX_SAMPLE_SEED = 2**63 - 1


def derive_seed(*keys: int) -> int:
    """A seed in [0, 2**63) mixed from integer ``keys`` (each taken modulo 2**64) with numpy's
    SeedSequence: the per-batch sample seed a trainer sends (seed, epoch, rank, batch) and the
    per-hop, per-part seeds a server derives from it (sampler_server/seeded_sampler.py)."""
    state = np.random.SeedSequence([k % 2**64 for k in keys]).generate_state(1, np.uint64)
    return int(state[0]) >> 1


def _check_sample_seed(seed: int, name: str) -> None:
    _need(-1 <= seed <= MAX_SAMPLE_SEED, "bad_field",
          f"{name} must be -1 (unseeded) or in [0, 2**63), got {seed}")


@dataclass
class ErrorReply(Message):
    TYPE = MsgType.ERROR
    code: str
    message: str


@dataclass
class Ping(Message):
    TYPE = MsgType.PING


@dataclass
class NodeTypeInfo(Struct):
    """One node type of a typed partition set: its name and whether its feature rows are real
    (in the set's ``feat_ntypes``) or zeros (a featureless type)."""

    name: str
    featured: bool = True


@dataclass
class RelationInfo(Struct):
    """One relation of a typed partition set: (source node type, name, destination type)."""

    src: str
    rel: str
    dst: str


@dataclass
class Pong(Message):
    """Who the server is and the shape of the data it serves."""

    TYPE = MsgType.PONG
    part_id: int
    num_parts: int
    num_nodes: int
    feat_dim: int
    num_classes: int
    node_offsets: list[int]
    feat_dtype: str
    dataset: str
    pid: int
    server_id: str
    set_id: str  # the partition set's identity (metadata.json), written by partition-ogbn
    # Typed sets (empty for a homogeneous one): node types in id order, relations in relation
    # id order, the node type the labels and splits are of.
    ntypes: list[NodeTypeInfo] = field(default_factory=list)
    etypes: list[RelationInfo] = field(default_factory=list)
    predict_ntype: str = ""
    # The task (partition/layout.py PartitionSetMeta, ogb's meta_dict names): task_type
    # "multiclass" or "binary", num_tasks (1 for multiclass), eval_metric "acc" or "rocauc".
    # A server fills all three from its partition metadata; "" / 0 / "": not said.
    task_type: str = ""
    num_tasks: int = 0
    eval_metric: str = ""


@dataclass
class RelFanouts(Struct):
    """One layer's fanout per relation of a typed partition set: ``fanouts[r]`` for relation
    id r (position in the set's ``etypes``); -1 takes every in-neighbour through r, 0 none."""

    fanouts: list[int]

    def check(self) -> None:
        _need(1 <= len(self.fanouts) <= MAX_RELATIONS, "bad_field",
              f"rel_fanouts: each layer needs 1..{MAX_RELATIONS} fanouts (one per relation), "
              f"got {len(self.fanouts)}")
        _need(all(f == -1 or 0 <= f <= MAX_FANOUT for f in self.fanouts), "bad_field",
              f"rel_fanouts: each fanout must be -1 or 0..{MAX_FANOUT}, got {self.fanouts}")

    @staticmethod
    def table(per_layer: list[list[int]]) -> list[RelFanouts]:
        """``[[f_r for each relation r] for each layer, input layer first]`` as the field."""
        return [RelFanouts(list(f)) for f in per_layer]


@dataclass
class SampleRequest(Message):
    """Sample a full MFG for ``seeds`` (global ids). ``fanouts`` lists the input layer first.

    Typed partition sets: the seeds must all be of one node type; ``rel_fanouts`` (one
    :class:`RelFanouts` per layer, input layer first, one fanout per relation id of the set's
    ``etypes``) sets each relation's fanout; empty: ``fanouts[l]`` for every relation of layer
    l. A homogeneous set refuses ``rel_fanouts``."""

    TYPE = MsgType.SAMPLE
    seeds: Tensor
    fanouts: list[int]
    with_feat: bool = True
    with_label: bool = True
    feat_dtype: str = ""  # "" = as stored; "float16"/"bfloat16" halve the feature bytes
    cache_ratio: float = 0.0  # the trainer caches the nodes CacheFillRequest(ratio) returns
    # A slot of the trainer's shared-memory ring (common.shm_ring) to gather the features
    # into, for a server on the same host; None: features on the wire.
    slot: SlotRef | None = None
    set_id: str = ""  # the partition set the sender expects; "" = not checked
    # >= 0: the MFG is a function of (partition set, seeds, fanouts, sample_seed), the same
    # from every sampler thread, process and replica; -1: the server's own random stream.
    sample_seed: int = -1
    # The largest reply the trainer accepts (its --max-message-mb): ZeroMQ drops a larger
    # message and the connection with it, so the server answers too_large instead. 0: any.
    max_reply_bytes: int = 0
    rel_fanouts: list[RelFanouts] = field(default_factory=list)  # typed sets; see above

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_sample_seed(self.sample_seed, "sample_seed")
        _need(self.max_reply_bytes >= 0, "bad_field",
              f"max_reply_bytes must be >= 0, got {self.max_reply_bytes}")
        _check_ids(self.seeds, "seeds")
        _need(self.seeds.numel() > 0, "bad_tensor", "seeds must not be empty")
        _check_unique(self.seeds, "seeds")
        _check_fanouts(self.fanouts)
        _check_rel_fanouts(self.rel_fanouts, len(self.fanouts))
        _need(self.feat_dtype in FEAT_TRANSFER_DTYPES, "bad_field",
              f"feat_dtype must be one of {sorted(FEAT_TRANSFER_DTYPES)}, got {self.feat_dtype!r}")
        _need(0.0 <= self.cache_ratio <= 1.0, "bad_field",
              f"cache_ratio must be in [0, 1], got {self.cache_ratio}")


@dataclass
class MFGReply(Message):
    """One sampled MFG (common.sampled_mfg: its structure, node ids, features and labels, with
    their invariants) and the server's timings."""

    TYPE = MsgType.MFG
    mfg: SampledMFG
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class NeighborsRequest(Message):
    """Sample up to ``fanout`` in-neighbours of each of ``nodes`` (all owned by the receiver);
    ``seed`` >= 0 makes the sample a function of (nodes, fanout, seed, etype), -1 is
    unseeded. ``etype`` >= 0 (typed sets): only in-edges of that relation id; -1: all."""

    TYPE = MsgType.NEIGHBORS_REQ
    nodes: Tensor
    fanout: int
    set_id: str = ""
    seed: int = -1
    etype: int = -1

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_sample_seed(self.seed, "seed")
        _need(-1 <= self.etype < MAX_RELATIONS, "bad_field",
              f"etype must be -1 (all relations) or a relation id in [0, {MAX_RELATIONS}), "
              f"got {self.etype}")
        _check_ids(self.nodes, "nodes")
        _check_unique(self.nodes, "nodes")
        _check_fanouts([self.fanout])


@dataclass
class NeighborsReply(Message):
    """``counts[i]`` sampled sources of ``nodes[i]``, concatenated in node order in ``src``."""

    TYPE = MsgType.NEIGHBORS
    counts: Tensor
    src: Tensor

    def check(self) -> None:
        _check_ids(self.counts, "counts")
        _check_ids(self.src, "src")
        _need(int(self.counts.sum()) == self.src.numel(), "bad_tensor",
              "sum(counts) must equal len(src)")


@dataclass
class NodeDataRequest(Message):
    TYPE = MsgType.NODE_DATA_REQ
    nodes: Tensor
    with_feat: bool = True
    with_label: bool = False
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_ids(self.nodes, "nodes")


@dataclass
class NodeDataReply(Message):
    TYPE = MsgType.NODE_DATA
    feat: Tensor
    label: Tensor


@dataclass
class SeedsRequest(Message):
    TYPE = MsgType.SEEDS_REQ
    split: str
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
        _need(self.split in ("train", "valid", "test"), "bad_split",
              f"split must be train, valid or test, got {self.split!r}")


@dataclass
class SeedsReply(Message):
    TYPE = MsgType.SEEDS
    seeds: Tensor


@dataclass
class CacheFillRequest(Message):
    """The part's nodes a trainer with ``cache_ratio`` caches, and their features."""

    TYPE = MsgType.CACHE_FILL_REQ
    cache_ratio: float
    feat_dtype: str = ""
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
        _need(0.0 < self.cache_ratio <= 1.0, "bad_field",
              f"cache_ratio must be in (0, 1], got {self.cache_ratio}")
        _need(self.feat_dtype in FEAT_TRANSFER_DTYPES, "bad_field",
              f"feat_dtype must be one of {sorted(FEAT_TRANSFER_DTYPES)}")


@dataclass
class CacheFillReply(Message):
    TYPE = MsgType.CACHE_FILL
    nodes: Tensor
    feat: Tensor

    def check(self) -> None:
        _check_ids(self.nodes, "nodes")
        _need(self.feat.dim() == 2 and self.feat.shape[0] == self.nodes.numel(), "bad_tensor",
              "feat must hold one row per node")


@dataclass
class StatsRequest(Message):
    TYPE = MsgType.STATS_REQ


@dataclass
class StatsReply(Message):
    TYPE = MsgType.STATS
    values: dict[str, float]


@dataclass
class StatusRequest(Message):
    """An operator's question (mfgserve-status): what is this server doing? Answered on the
    IO thread, never queued behind sample requests."""

    TYPE = MsgType.STATUS_REQ


SAMPLER_KINDS = ("threads", "processes", "inline")


@dataclass
class StatusReply(Message):
    """A server's state (sampler_server/status.py builds it; its docstring says what each
    field means). ``stats`` is the STATS reply's values (common.stats.ServerStats, totals
    since start and gauges now); ``window`` the counters (common.stats.ServerCounters) added
    over the last ``window_s`` seconds."""

    TYPE = MsgType.STATUS
    part_id: int
    num_parts: int
    dataset: str
    set_id: str
    server_id: str
    pid: int
    host: str
    protocol_version: int
    uptime_s: float
    stats: dict[str, float]
    window_s: float
    window: dict[str, float]
    pss_available: bool  # False: psutil could not read pss here; mem_pss_bytes holds rss
    trainers: int  # trainer connections that sent a request within the window
    peers: int  # other servers' connections that sent a request within the window
    queue_peak: int
    queue_limit: int
    error_codes: dict[str, float]  # error replies sent since start, by code
    sampler_kind: str
    samplers: int
    samplers_alive: int
    node_tensor_bytes: int

    def check(self) -> None:
        _need(self.sampler_kind in SAMPLER_KINDS, "bad_field",
              f"sampler_kind must be one of {SAMPLER_KINDS}, got {self.sampler_kind!r}")
        _need(min(self.uptime_s, self.window_s, self.trainers, self.peers, self.queue_peak,
                  self.queue_limit, self.samplers, self.samplers_alive,
                  self.node_tensor_bytes) >= 0, "bad_field",
              "status times, counts and sizes must not be negative")
        _need(self.samplers_alive <= self.samplers, "bad_field",
              "samplers_alive must not exceed samplers")


@dataclass
class Shutdown(Message):
    """Stop the server. Obeyed only when ``token`` equals the server's shutdown token (from
    its --shutdown-token-file); a server without one refuses every Shutdown."""

    TYPE = MsgType.SHUTDOWN
    token: str = ""


@dataclass
class Ack(Message):
    TYPE = MsgType.ACK


@dataclass
class SampleJob(SampleRequest):
    """Server -> its sampler process (common/executors.py): a SampleRequest the server
    decoded and checked (so not checked again), the client it answers (its ROUTER identity)
    and when it arrived (time.perf_counter). The request id is the client's."""

    TYPE = MsgType.SAMPLE_JOB
    client: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    t_in: float = 0.0

    def check(self) -> None:
        return None

    @classmethod
    def of(cls, req: SampleRequest, client: Tensor, t_in: float) -> SampleJob:
        own = {f.name: getattr(req, f.name) for f in fields(SampleRequest)}
        return cls(**own, client=client, t_in=t_in)


@dataclass
class SampleResult(Message):
    """Sampler process -> its server: the reply to send on to ``client`` unchanged (one uint8
    tensor per encoded frame) and what serving it added to the counters
    (common.stats.SampleCounts, by name)."""

    TYPE = MsgType.SAMPLE_RESULT
    client: Tensor
    stats: dict[str, float]
    reply: list[Tensor]


@dataclass
class WorkerReady(Message):
    TYPE = MsgType.WORKER_READY
    index: int
    pid: int


@dataclass
class WorkerStop(Message):
    TYPE = MsgType.WORKER_STOP


MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (ErrorReply, Ping, Pong, SampleRequest, MFGReply, NeighborsRequest, NeighborsReply,
                NodeDataRequest, NodeDataReply, SeedsRequest, SeedsReply, StatsRequest,
                StatsReply, Shutdown, Ack, CacheFillRequest, CacheFillReply,
                StatusRequest, StatusReply,
                TensorCreate, TensorInfo, TensorWrite, TensorRead, TensorRows, TensorUpdate,
                TensorDrop,
                SampleJob, SampleResult, WorkerReady, WorkerStop)
}
assert set(MESSAGE_CLASSES) == set(MsgType), "every MsgType needs a message class"
