"""Typed wire messages: one small dataclass per message type, and the explicit type enum.

Fields annotated ``Tensor`` or ``list[Tensor]`` travel as raw frames; every other field is a
scalar in the msgpack header. The frame layout itself lives in :mod:`common.codec` only.
Each class's :meth:`check` states the domain constraints a receiver relies on; the codec
calls it on every decoded message, so handlers never see an ill-formed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import ClassVar

import torch
from torch import Tensor

from common.limits import MAX_FANOUT, MAX_LAYERS
from common.sampled_mfg import SampledMFG
from common.shm_ring import SlotRef
from common.structs import MAX_ID, Struct  # noqa: F401 (MAX_ID is re-exported)
from common.structs import check_ids as _check_ids
from common.structs import check_unique as _check_unique
from common.structs import need as _need

# 2: partition-set ids (set_id), Shutdown token; 3: nested structs: the MFG reply carries a
# SampledMFG, SAMPLE's ring slot is one SlotRef
PROTOCOL_VERSION = 3
FEAT_TRANSFER_DTYPES = {"": None, "float32": torch.float32, "float16": torch.float16,
                        "bfloat16": torch.bfloat16}


class MsgType(IntEnum):
    """Every message type on the wire (one byte's worth); never renumber, only append."""

    ERROR = 0
    PING = 1
    PONG = 2
    SAMPLE = 3  # trainer -> server: seeds -> full MFG with features and labels
    MFG = 4
    NEIGHBORS_REQ = 5  # server -> server: sample in-neighbours of nodes the peer owns
    NEIGHBORS = 6
    NODE_DATA_REQ = 7  # server -> server: features / labels of nodes the peer owns
    NODE_DATA = 8
    SEEDS_REQ = 9  # trainer -> server: the train/valid/test seeds a part owns
    SEEDS = 10
    STATS_REQ = 11
    STATS = 12
    SHUTDOWN = 13
    ACK = 14
    CACHE_FILL_REQ = 15  # trainer -> server: the part's hottest nodes and their features
    CACHE_FILL = 16
    SAMPLE_JOB = 17  # server -> its sampler process (private socket): a decoded SAMPLE
    SAMPLE_RESULT = 18  # sampler process -> its server: the encoded reply and its counts
    WORKER_READY = 19  # sampler process -> its server: loaded, waiting for jobs
    WORKER_STOP = 20  # server -> its sampler process: exit
    # 40-46: server-held node tensors (trainer -> server; sampler_server/node_tensors.py)
    TENSOR_CREATE = 40
    TENSOR_INFO = 41
    TENSOR_WRITE = 42
    TENSOR_READ = 43
    TENSOR_ROWS = 44
    TENSOR_UPDATE = 45
    TENSOR_DROP = 46


@dataclass
class Message(Struct):
    """Base of all messages. ``TYPE`` is the enum value; ``check`` validates semantics."""

    TYPE: ClassVar[MsgType]


def _check_fanouts(fanouts: list[int]) -> None:
    _need(1 <= len(fanouts) <= MAX_LAYERS, "bad_fanouts",
          f"fanouts must have 1..{MAX_LAYERS} entries, got {len(fanouts)}")
    _need(all(f == -1 or 1 <= f <= MAX_FANOUT for f in fanouts), "bad_fanouts",
          f"each fanout must be -1 or 1..{MAX_FANOUT}, got {fanouts}")


def _check_set_id(set_id: str) -> None:
    _need(len(set_id) <= 64 and all(c in "0123456789abcdef" for c in set_id), "bad_field",
          "set_id must be empty or a partition set id (hex digits)")


@dataclass
class ErrorReply(Message):
    TYPE = MsgType.ERROR
    code: str
    message: str


@dataclass
class Ping(Message):
    TYPE = MsgType.PING


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


@dataclass
class SampleRequest(Message):
    """Sample a full MFG for ``seeds`` (global ids). ``fanouts`` lists the input layer first."""

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

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_ids(self.seeds, "seeds")
        _need(self.seeds.numel() > 0, "bad_tensor", "seeds must not be empty")
        _check_unique(self.seeds, "seeds")
        _check_fanouts(self.fanouts)
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
    """Sample up to ``fanout`` in-neighbours of each of ``nodes`` (all owned by the receiver)."""

    TYPE = MsgType.NEIGHBORS_REQ
    nodes: Tensor
    fanout: int
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
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
class Shutdown(Message):
    """Stop the server. Obeyed only when ``token`` equals the server's shutdown token (from
    its --shutdown-token-file); a server without one refuses every Shutdown."""

    TYPE = MsgType.SHUTDOWN
    token: str = ""


@dataclass
class Ack(Message):
    TYPE = MsgType.ACK


# ---------------------------------------------------------------- server-held node tensors
NODE_TENSOR_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                      "float16": torch.float16, "bfloat16": torch.bfloat16,
                      "int64": torch.int64, "int32": torch.int32}
NODE_TENSOR_INITS = ("zeros", "uniform", "normal")
NODE_TENSOR_OPTIMIZERS = ("none", "sgd", "adagrad", "adam")
_FLOAT_TENSOR_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _check_name(name: str) -> None:
    _need(0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "_.-") for c in name),
          "bad_field", f"tensor name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")


def _check_rows(rows: Tensor, ids: Tensor, what: str) -> None:
    _need(rows.dim() >= 1 and rows.shape[0] == ids.numel(), "bad_tensor",
          f"{what} must hold one row per id ({ids.numel()}), got shape {tuple(rows.shape)}")


@dataclass
class TensorCreate(Message):
    """Create the part's rows of node tensor ``name`` (rows ``[first_id, end)`` of the part's
    global id range), or confirm it exists with exactly this spec. ``init_scale``: the bound
    of ``uniform`` (U(-a, a)) or the std of ``normal``. ``optimizer`` is applied by
    TENSOR_UPDATE with ``lr`` (Adam also ``beta1``, ``beta2``; Adagrad and Adam ``eps``)."""

    TYPE = MsgType.TENSOR_CREATE
    name: str
    dtype: str
    row_shape: list[int]
    init: str = "zeros"
    init_scale: float = 0.0
    seed: int = 0
    optimizer: str = "none"
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_name(self.name)
        _need(self.dtype in NODE_TENSOR_DTYPES, "bad_field",
              f"dtype must be one of {sorted(NODE_TENSOR_DTYPES)}, got {self.dtype!r}")
        _need(len(self.row_shape) <= 3 and all(1 <= s <= 2**24 for s in self.row_shape),
              "bad_field", f"row_shape must have 0-3 dims of 1..2^24, got {self.row_shape}")
        _need(self.init in NODE_TENSOR_INITS, "bad_field",
              f"init must be one of {NODE_TENSOR_INITS}, got {self.init!r}")
        _need(self.optimizer in NODE_TENSOR_OPTIMIZERS, "bad_field",
              f"optimizer must be one of {NODE_TENSOR_OPTIMIZERS}, got {self.optimizer!r}")
        floats_needed = self.init != "zeros" or self.optimizer != "none"
        _need(self.dtype in _FLOAT_TENSOR_DTYPES or not floats_needed, "bad_field",
              f"init {self.init!r} / optimizer {self.optimizer!r} need a float dtype")
        _need(0 <= self.seed < MAX_ID, "bad_field", f"seed must be in [0, 2^62), got {self.seed}")
        _need(0.0 <= self.init_scale < float("inf"), "bad_field", "init_scale must be >= 0")
        _need(0.0 < self.lr < float("inf") and 0.0 < self.eps < 1.0, "bad_field",
              "lr must be > 0 and eps in (0, 1)")
        _need(0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0, "bad_field",
              "beta1 and beta2 must be in [0, 1)")


@dataclass
class TensorInfo(Message):
    """The part's rows of a node tensor: global ids ``[first_id, first_id + num_rows)``.
    ``created`` is False when the tensor already existed with the same spec."""

    TYPE = MsgType.TENSOR_INFO
    name: str
    first_id: int
    num_rows: int
    created: bool


@dataclass
class TensorWrite(Message):
    """Overwrite rows: ``rows[i]`` becomes the row of global node ``ids[i]`` (ids unique)."""

    TYPE = MsgType.TENSOR_WRITE
    name: str
    ids: Tensor
    rows: Tensor
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_ids(self.ids, "ids")
        _check_unique(self.ids, "ids")
        _check_rows(self.rows, self.ids, "rows")


@dataclass
class TensorRead(Message):
    TYPE = MsgType.TENSOR_READ
    name: str
    ids: Tensor
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_ids(self.ids, "ids")


@dataclass
class TensorRows(Message):
    TYPE = MsgType.TENSOR_ROWS
    rows: Tensor


@dataclass
class TensorUpdate(Message):
    """One sparse optimizer step on the server: ``grads[i]`` is a gradient of node
    ``ids[i]``'s row; gradients of a repeated id are summed first."""

    TYPE = MsgType.TENSOR_UPDATE
    name: str
    ids: Tensor
    grads: Tensor
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_ids(self.ids, "ids")
        _check_rows(self.grads, self.ids, "grads")


@dataclass
class TensorDrop(Message):
    """Free the part's rows of ``name`` (and its optimizer state); a no-op if absent."""

    TYPE = MsgType.TENSOR_DROP
    name: str
    set_id: str = ""

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_name(self.name)


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
                TensorCreate, TensorInfo, TensorWrite, TensorRead, TensorRows, TensorUpdate,
                TensorDrop,
                SampleJob, SampleResult, WorkerReady, WorkerStop)
}
assert set(MESSAGE_CLASSES) == set(MsgType), "every MsgType needs a message class"
