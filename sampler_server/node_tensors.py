"""Server-held node tensors: named, typed per-node rows of this part that trainers create,
write (scatter rows), read (gather rows) and update with a sparse optimizer step.

Domain code (no sockets): :meth:`NodeTensorStore.register` puts one handler per message type
in the server's handler table (common/service.py); each takes a decoded request and returns
the reply, or raises :class:`ProtocolError` with a code the client sees in the ERROR reply.
They run inline on the server's IO thread (never queued behind SAMPLE jobs); the locks make
them safe from any thread.

Invariants: a tensor holds one row per node the part owns (global ids ``[start, end)``; halo
nodes are not owned); every id of a request must lie there (``not_owned`` otherwise). One
lock per tensor: a request's rows are written, read or updated as one step, so concurrent
writers never leave a torn row or a half-applied request. All tensors together, optimizer
state included, stay within ``max_bytes`` (``--max-node-tensor-mb``). Optimizer state is kept
per row (Adagrad: the sum of squared gradients; Adam: both moments and a step count, so a row's
bias correction counts the updates that row got, as in DGL's sparse Adam). A read with
``with_state`` returns it with the rows, and a write carrying ``state`` sets it with them (one
step under the tensor's lock), so a checkpoint saves and restores a tensor exactly.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from common.errors import ProtocolError
from common.messages import (
    NODE_TENSOR_DTYPES,
    Ack,
    Message,
    TensorCreate,
    TensorDrop,
    TensorInfo,
    TensorRead,
    TensorRows,
    TensorUpdate,
    TensorWrite,
)
from common.tensor_messages import row_nbytes, state_layout

_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(TensorCreate) if f.name != "set_id")


@dataclass
class _NodeTensor:
    spec: TensorCreate
    data: Tensor  # (num_rows, *row_shape)
    state: list[Tensor]  # optimizer state, row-aligned with data
    nbytes: int
    lock: threading.Lock = field(default_factory=threading.Lock)


def _footprint(spec: TensorCreate, rows: int) -> int:
    """Bytes of a tensor of ``rows`` rows and its optimizer state (Adam: + int32 steps)."""
    return rows * row_nbytes(spec)


def _initial(spec: TensorCreate, rows: int, start: int) -> Tensor:
    """The initial rows; random ones depend only on the seed and the part's first id."""
    out = torch.zeros((rows, *spec.row_shape), dtype=NODE_TENSOR_DTYPES[spec.dtype])
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + start) % 2**63)
    if spec.init == "uniform":
        out.uniform_(-spec.init_scale, spec.init_scale, generator=gen)
    elif spec.init == "normal":
        out.normal_(0.0, spec.init_scale, generator=gen)
    return out


def _sgd(t: _NodeTensor, rows: Tensor, g: Tensor) -> None:
    t.data.index_add_(0, rows, g, alpha=-t.spec.lr)


def _adagrad(t: _NodeTensor, rows: Tensor, g: Tensor) -> None:
    """torch.optim.Adagrad's sparse step (lr_decay 0, initial accumulator 0)."""
    acc = t.state[0].index_add_(0, rows, g * g)
    t.data.index_add_(0, rows, g / (acc[rows].sqrt() + t.spec.eps), alpha=-t.spec.lr)


def _adam(t: _NodeTensor, rows: Tensor, g: Tensor) -> None:
    """torch.optim.SparseAdam's step, with the step count kept per row."""
    s = t.spec
    exp_avg, exp_avg_sq, steps = t.state
    steps[rows] += 1
    m = exp_avg[rows].mul_(s.beta1).add_(g, alpha=1 - s.beta1)
    v = exp_avg_sq[rows].mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
    exp_avg[rows], exp_avg_sq[rows] = m, v
    n = steps[rows].to(torch.float64).reshape(-1, *[1] * (g.dim() - 1))
    step_size = (s.lr * torch.sqrt(1 - s.beta2 ** n) / (1 - s.beta1 ** n)).to(g.dtype)
    t.data.index_add_(0, rows, -step_size * m / (v.sqrt() + s.eps))


_STEPS: dict[str, Callable[[_NodeTensor, Tensor, Tensor], None]] = {
    "sgd": _sgd, "adagrad": _adagrad, "adam": _adam}


class NodeTensorStore:
    """The node tensors of part ``part_id`` (owned global ids ``[start, end)``)."""

    def __init__(self, part_id: int, start: int, end: int, max_bytes: int):
        self.part_id, self.start, self.end = part_id, start, end
        self.max_bytes = max_bytes
        self._tensors: dict[str, _NodeTensor] = {}
        self._lock = threading.Lock()  # guards the name table and the byte count
        self._bytes = 0

    def handlers(self) -> dict[type[Message], Callable[[Any], Message]]:
        """Message class -> handler, for the server's handler table."""
        return {TensorCreate: self.handle_create, TensorWrite: self.handle_write,
                TensorRead: self.handle_read, TensorUpdate: self.handle_update,
                TensorDrop: self.handle_drop}

    def register(self, service) -> None:
        """Answer the node tensor messages on ``service`` (a common.service.Service)."""
        for cls, fn in self.handlers().items():
            service.handle(cls, lambda msg, _call, fn=fn: fn(msg))

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    # ------------------------------------------------------------------ handlers
    def handle_create(self, msg: TensorCreate) -> TensorInfo:
        rows = self.end - self.start
        need = _footprint(msg, rows)
        with self._lock:
            old = self._tensors.get(msg.name)
            if old is not None:
                self._same_spec(old.spec, msg)
                return self._info(msg.name, created=False)
            if self._bytes + need > self.max_bytes:
                raise ProtocolError(
                    "too_large", f"part {self.part_id}: node tensor {msg.name!r} needs "
                    f"{need} bytes ({rows} rows with optimizer state), {self._bytes} of "
                    f"{self.max_bytes} are in use: drop a tensor or raise --max-node-tensor-mb")
            self._bytes += need  # reserved before the allocation, so two creates cannot both fit
        try:
            data = _initial(msg, rows, self.start)
            state = [torch.zeros((rows, *shape), dtype=dtype)
                     for _, dtype, shape in state_layout(msg)]
        except BaseException:
            with self._lock:
                self._bytes -= need
            raise
        with self._lock:
            self._tensors[msg.name] = _NodeTensor(dataclasses.replace(msg, set_id=""), data,
                                                  state, need)
        return self._info(msg.name, created=True)

    def handle_write(self, msg: TensorWrite) -> Ack:
        """Rows, and with ``msg.state`` their optimizer state, written as one step."""
        t = self._get(msg.name)
        rows = self._local(msg.ids)
        self._check_rows(t, msg.rows, "rows")
        if msg.state:
            self._check_state(t, msg.state)
        with t.lock:
            t.data.index_copy_(0, rows, msg.rows)
            for have, new in zip(t.state, msg.state):
                have.index_copy_(0, rows, new)
        return Ack()

    def handle_read(self, msg: TensorRead) -> TensorRows:
        t = self._get(msg.name)
        rows = self._local(msg.ids)
        with t.lock:
            state = [s.index_select(0, rows) for s in t.state] if msg.with_state else []
            return TensorRows(rows=t.data.index_select(0, rows), state=state)

    def handle_update(self, msg: TensorUpdate) -> Ack:
        t = self._get(msg.name)
        if t.spec.optimizer == "none":
            raise ProtocolError("no_optimizer", f"node tensor {msg.name!r} was created with "
                                "optimizer 'none': write rows instead, or create it with an "
                                "optimizer (sgd, adagrad, adam)")
        rows = self._local(msg.ids)
        self._check_rows(t, msg.grads, "grads")
        uniq, inverse = torch.unique(rows, return_inverse=True)
        g = torch.zeros((uniq.numel(), *t.spec.row_shape), dtype=t.data.dtype)
        g.index_add_(0, inverse, msg.grads)  # a repeated id's gradients are summed
        with t.lock:
            _STEPS[t.spec.optimizer](t, uniq, g)
        return Ack()

    def handle_drop(self, msg: TensorDrop) -> Ack:
        with self._lock:
            t = self._tensors.pop(msg.name, None)
            if t is not None:
                self._bytes -= t.nbytes
        return Ack()

    # ------------------------------------------------------------------ checks
    def _info(self, name: str, created: bool) -> TensorInfo:
        return TensorInfo(name=name, first_id=self.start, num_rows=self.end - self.start,
                          created=created)

    def _get(self, name: str) -> _NodeTensor:
        with self._lock:
            t = self._tensors.get(name)
        if t is None:
            raise ProtocolError("unknown_tensor", f"part {self.part_id} holds no node tensor "
                                f"{name!r}: create it first (TENSOR_CREATE)")
        return t

    def _local(self, ids: Tensor) -> Tensor:
        """Row indices of global ``ids`` (1-D int64, checked by the codec)."""
        if ids.numel() and (int(ids.min()) < self.start or int(ids.max()) >= self.end):
            raise ProtocolError(
                "not_owned", f"ids [{int(ids.min())}, {int(ids.max())}] are not all owned by "
                f"part {self.part_id} (global ids [{self.start}, {self.end})): send each id "
                "to the server of the part that owns it (PONG node_offsets)")
        return ids - self.start

    @staticmethod
    def _check_rows(t: _NodeTensor, rows: Tensor, what: str) -> None:
        want = list(t.spec.row_shape)
        if rows.dtype != t.data.dtype or list(rows.shape[1:]) != want:
            raise ProtocolError(
                "tensor_mismatch", f"node tensor {t.spec.name!r} holds {t.spec.dtype} rows of "
                f"shape {want}, but {what} are {str(rows.dtype).replace('torch.', '')} rows of "
                f"shape {list(rows.shape[1:])}")

    @staticmethod
    def _check_state(t: _NodeTensor, state: list[Tensor]) -> None:
        """``state`` has the dtype and row shape of each of ``t``'s optimizer state tensors."""
        want = [(name, dtype, list(shape)) for name, dtype, shape in state_layout(t.spec)]
        got = [("", s.dtype, list(s.shape[1:])) for s in state]
        if len(got) != len(want) or any(w[1:] != g[1:] for w, g in zip(want, got)):
            raise ProtocolError(
                "tensor_mismatch", f"node tensor {t.spec.name!r} (optimizer "
                f"{t.spec.optimizer}) keeps state {[(n, str(d), s) for n, d, s in want]} per "
                f"row, but the write carries {[(str(d), s) for _, d, s in got]}")

    @staticmethod
    def _same_spec(have: TensorCreate, want: TensorCreate) -> None:
        diff = [f"{k}={getattr(have, k)!r} (asked {getattr(want, k)!r})"
                for k in _SPEC_FIELDS if getattr(have, k) != getattr(want, k)]
        if diff:
            raise ProtocolError(
                "tensor_mismatch", f"node tensor {have.name!r} exists with another spec: "
                f"{', '.join(diff)}; use the same spec, another name, or drop it first")
