"""Messages of server-held node tensors (trainer -> server; sampler_server/node_tensors.py,
trainer_client/node_tensors.py). Registered in :data:`common.messages.MESSAGE_CLASSES`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.message_base import Message, MsgType, check_set_id
from common.structs import MAX_ID
from common.structs import check_ids as _check_ids
from common.structs import check_unique as _check_unique
from common.structs import need as _need

_check_set_id = check_set_id

# ---------------------------------------------------------------- server-held node tensors
NODE_TENSOR_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                      "float16": torch.float16, "bfloat16": torch.bfloat16,
                      "int64": torch.int64, "int32": torch.int32}
NODE_TENSOR_INITS = ("zeros", "uniform", "normal")
NODE_TENSOR_OPTIMIZERS = ("none", "sgd", "adagrad", "adam")
_FLOAT_TENSOR_DTYPES = ("float32", "float64", "float16", "bfloat16")
# The optimizer state a tensor keeps per row, in wire order (TensorRows.state,
# TensorWrite.state): row-shaped tensors of the tensor's dtype, except Adam's "step" (int32,
# one per row: the updates that row got, for its bias correction).
OPTIMIZER_STATE: dict[str, tuple[str, ...]] = {
    "none": (), "sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq", "step")}
STEP_DTYPE = torch.int32


def state_layout(spec: TensorCreate) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, row shape) of each optimizer state tensor of ``spec``, in wire order."""
    dtype, shape = NODE_TENSOR_DTYPES[spec.dtype], tuple(spec.row_shape)
    return [(n, STEP_DTYPE, ()) if n == "step" else (n, dtype, shape)
            for n in OPTIMIZER_STATE[spec.optimizer]]


def row_nbytes(spec: TensorCreate, with_state: bool = True) -> int:
    """Bytes of one row (and, with ``with_state``, its optimizer state)."""
    layout = [("data", NODE_TENSOR_DTYPES[spec.dtype], tuple(spec.row_shape))]
    if with_state:
        layout += state_layout(spec)
    return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in layout)


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
    """Overwrite rows: ``rows[i]`` becomes the row of global node ``ids[i]`` (ids unique).
    ``state``, when not empty, overwrites those rows' optimizer state too (one tensor per
    :data:`OPTIMIZER_STATE` entry of the tensor's optimizer, as a ``with_state`` read returns
    them): how a checkpoint is restored exactly. Empty leaves the optimizer state as is."""

    TYPE = MsgType.TENSOR_WRITE
    name: str
    ids: Tensor
    rows: Tensor
    set_id: str = ""
    state: list[Tensor] = field(default_factory=list)

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_ids(self.ids, "ids")
        _check_unique(self.ids, "ids")
        _check_rows(self.rows, self.ids, "rows")
        for i, t in enumerate(self.state):
            _check_rows(t, self.ids, f"state[{i}]")


@dataclass
class TensorRead(Message):
    """Gather the rows of ``ids``; ``with_state`` also their optimizer state (for a
    checkpoint)."""

    TYPE = MsgType.TENSOR_READ
    name: str
    ids: Tensor
    set_id: str = ""
    with_state: bool = False

    def check(self) -> None:
        _check_set_id(self.set_id)
        _check_ids(self.ids, "ids")


@dataclass
class TensorRows(Message):
    """The rows asked for, and with ``with_state`` their optimizer state (in
    :data:`OPTIMIZER_STATE` order; empty otherwise)."""

    TYPE = MsgType.TENSOR_ROWS
    rows: Tensor
    state: list[Tensor] = field(default_factory=list)

    def check(self) -> None:
        _need(self.rows.dim() >= 1, "bad_tensor", "rows must have a row dimension")
        for i, t in enumerate(self.state):
            _need(t.dim() >= 1 and t.shape[0] == self.rows.shape[0], "bad_tensor",
                  f"state[{i}] must hold one row per row of rows ({self.rows.shape[0]}), got "
                  f"shape {tuple(t.shape)}")


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
