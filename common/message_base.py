"""The message base: the :class:`MsgType` enum (every type on the wire) and :class:`Message`.

Kept apart from :mod:`common.messages` so that groups of message classes can live in their own
modules (e.g. :mod:`common.tensor_messages`) and still be registered there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

from common.structs import Struct, need


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
    # 50-51: an operator's status query (sampler_server/status.py, mfgserve-status)
    STATUS_REQ = 50
    STATUS = 51


@dataclass
class Message(Struct):
    """Base of all messages. ``TYPE`` is the enum value; ``check`` validates semantics."""

    TYPE: ClassVar[MsgType]


def check_set_id(set_id: str) -> None:
    need(len(set_id) <= 64 and all(c in "0123456789abcdef" for c in set_id), "bad_field",
          "set_id must be empty or a partition set id (hex digits)")
