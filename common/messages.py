"""Typed wire messages: one small dataclass per message type, and the explicit type enum.

Fields annotated ``Tensor`` or ``list[Tensor]`` travel as raw frames; every other field is a
scalar in the msgpack header. The frame layout itself lives in :mod:`common.codec` only.
Each class's :meth:`check` states the domain constraints a receiver relies on; the codec
calls it on every decoded message, so handlers never see an ill-formed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

import torch
from torch import Tensor

from common.errors import ProtocolError
from common.limits import MAX_FANOUT, MAX_LAYERS

PROTOCOL_VERSION = 2  # 2: partition-set ids (set_id), Shutdown token
MAX_ID = 2**62  # node ids, part ids and counts are checked against this bound
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


@dataclass
class Message:
    """Base of all messages. ``TYPE`` is the enum value; ``check`` validates semantics."""

    TYPE: ClassVar[MsgType]

    def check(self) -> None:  # overridden where there is something to check
        return None


def _need(cond: bool, code: str, msg: str) -> None:
    if not cond:
        raise ProtocolError(code, msg)


def _check_ids(t: Tensor, name: str, upper: int | None = None) -> None:
    _need(t.dtype == torch.int64 and t.dim() == 1, "bad_tensor",
          f"{name} must be a 1-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        bound = MAX_ID if upper is None else upper
        _need(lo >= 0 and hi < bound, "id_out_of_range",
              f"{name} holds ids in [{lo}, {hi}], outside [0, {bound})")


def _check_unique(t: Tensor, name: str) -> None:
    _need(torch.unique(t).numel() == t.numel(), "bad_tensor", f"{name} must be unique")


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
    # into, for a server on the same host; shm_fd < 0: no slot, features on the wire.
    shm_pid: int = 0
    shm_fd: int = -1
    shm_token: str = ""
    shm_offset: int = 0
    shm_capacity: int = 0
    set_id: str = ""  # the partition set the sender expects; "" = not checked

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_ids(self.seeds, "seeds")
        if self.shm_fd >= 0:
            _need(self.shm_pid > 0 and self.shm_offset > 0 and self.shm_capacity >= 0
                  and len(self.shm_token) == 32, "bad_field",
                  "shm_pid/shm_offset must be positive, shm_capacity >= 0 and shm_token "
                  "32 hex digits when shm_fd is set")
        _need(self.seeds.numel() > 0, "bad_tensor", "seeds must not be empty")
        _check_unique(self.seeds, "seeds")
        _check_fanouts(self.fanouts)
        _need(self.feat_dtype in FEAT_TRANSFER_DTYPES, "bad_field",
              f"feat_dtype must be one of {sorted(FEAT_TRANSFER_DTYPES)}, got {self.feat_dtype!r}")
        _need(0.0 <= self.cache_ratio <= 1.0, "bad_field",
              f"cache_ratio must be in [0, 1], got {self.cache_ratio}")


@dataclass
class MFGReply(Message):
    """One sampled MFG. Layer l's source nodes are ``input_nodes[:num_src[l]]`` and its
    destination nodes ``input_nodes[:num_dst[l]]`` (destination nodes first among sources);
    ``indptr[l]`` / ``indices[l]`` are its CSC (indices are local source positions).
    ``feat_present`` is empty when ``feat`` has a row per input node; otherwise it is a bool
    per input node and ``feat`` holds rows only where it is True (the trainer caches the rest).
    """

    TYPE = MsgType.MFG
    input_nodes: Tensor
    num_src: list[int]
    num_dst: list[int]
    indptr: list[Tensor]
    indices: list[Tensor]
    feat: Tensor
    label: Tensor
    feat_present: Tensor
    timings: dict[str, float] = field(default_factory=dict)
    # >= 0: the features (that many rows, dtype/width as ``feat``'s) are in the request's
    # shared-memory slot and ``feat`` has no rows. ``shm_error``: why the slot was not used.
    feat_shm_rows: int = -1
    shm_error: str = ""

    def check(self) -> None:
        n = len(self.num_src)
        _need(n == len(self.num_dst) == len(self.indptr) == len(self.indices) and 1 <= n <= MAX_LAYERS,
              "bad_mfg", "MFG layer lists differ in length")
        _check_ids(self.input_nodes, "input_nodes")
        _need(self.num_src[0] == self.input_nodes.numel(), "bad_mfg",
              "input layer's num_src must equal len(input_nodes)")
        for layer in range(n):
            ns, nd = self.num_src[layer], self.num_dst[layer]
            ip, ix = self.indptr[layer], self.indices[layer]
            _need(0 <= nd <= ns <= self.input_nodes.numel(), "bad_mfg",
                  f"layer {layer}: need 0 <= num_dst <= num_src <= len(input_nodes)")
            _need(ip.dtype == torch.int64 and ip.shape == (nd + 1,), "bad_mfg",
                  f"layer {layer}: indptr must be int64 of length num_dst+1")
            _need(ix.dtype == torch.int64 and ix.dim() == 1, "bad_mfg",
                  f"layer {layer}: indices must be 1-D int64")
            _need(int(ip[0]) == 0 and int(ip[-1]) == ix.numel() and bool((ip[1:] >= ip[:-1]).all()),
                  "bad_mfg", f"layer {layer}: indptr must rise from 0 to len(indices)")
            if ix.numel():
                _need(int(ix.min()) >= 0 and int(ix.max()) < ns, "bad_mfg",
                      f"layer {layer}: indices outside [0, num_src)")
            if layer + 1 < n:
                _need(self.num_src[layer + 1] == nd, "bad_mfg",
                      f"layer {layer + 1}'s sources must be layer {layer}'s destinations")
        fp = self.feat_present
        rows = self.feat.shape[0] if self.feat.dim() == 2 else -1
        if self.feat_shm_rows >= 0:
            _need(rows == 0, "bad_mfg", "feat must have no rows when feat_shm_rows is set")
            rows = self.feat_shm_rows
        if fp.numel():
            _need(fp.dtype == torch.bool and fp.shape == self.input_nodes.shape, "bad_mfg",
                  "feat_present must be a bool per input node")
            _need(rows == int(fp.sum()), "bad_mfg",
                  "feat must hold one row per True in feat_present")


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


MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (ErrorReply, Ping, Pong, SampleRequest, MFGReply, NeighborsRequest, NeighborsReply,
                NodeDataRequest, NodeDataReply, SeedsRequest, SeedsReply, StatsRequest,
                StatsReply, Shutdown, Ack, CacheFillRequest, CacheFillReply)
}
assert set(MESSAGE_CLASSES) == set(MsgType), "every MsgType needs a message class"
