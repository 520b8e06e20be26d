"""Trainer side of server-held node tensors (see sampler_server/node_tensors.py).

A :class:`DistNodeTensor` is one named per-node tensor whose rows live on the sampler servers,
each part's rows on its part's server. ``read``/``write``/``update`` take global node ids in
any order, split them by owning part (``node_offsets`` from PONG), send one request per part
over the trainer's :class:`~trainer_client.server_pool.ServerPool` at once, and put the
answers back in the order asked (the ReplicaSet's ``scatter_gather``).

Message size: a request or reply larger than the pool's max message size (the trainer's
``--max-message-mb``; the servers' must be at least as large) is split into rounds of at
most that many bytes, each round one request per part at once. A part's share of one round
is applied as one step on its server; a call that needs several rounds is not atomic as a
whole (rows written by another trainer meanwhile may interleave by round). ``update`` sums
the gradients of a repeated id before splitting, so every row still gets one optimizer step.

Checkpoints: :meth:`DistNodeTensor.state_dict` reads every row and the servers' optimizer
state (Adagrad's sum, Adam's moments and per-row step counts) in rounds;
:meth:`DistNodeTensor.load_state_dict` checks it against this tensor's spec and writes both
back, so the updates after a restore equal those of the run that was saved.

Replicas: a tensor's rows are state held by one server, so every part must have exactly one
server in the cluster file (replicas would each hold their own diverging copy).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from common.errors import ConfigError, MfgServeError
from common.messages import (
    NODE_TENSOR_DTYPES,
    Ack,
    TensorCreate,
    TensorDrop,
    TensorInfo,
    TensorRead,
    TensorRows,
    TensorUpdate,
    TensorWrite,
)
from common.tensor_messages import OPTIMIZER_STATE, row_nbytes, state_layout

if TYPE_CHECKING:
    from trainer_client.server_pool import ServerPool

_HEADER_BYTES = 64 << 10  # room left in a message for its msgpack header
_ID_BYTES = 8
_HPARAMS = ("lr", "beta1", "beta2", "eps")  # spec fields a state dict records and checks


class DistNodeTensor:
    """Create (or attach to, when the spec matches) node tensor ``name`` on every part.

    ``init``: zeros, uniform (U(-init_scale, init_scale)) or normal (std init_scale), seeded
    by ``seed``; ``optimizer``: none, sgd, adagrad or adam, applied by :meth:`update` on the
    servers with ``lr``, ``betas`` and ``eps``. ``max_message_bytes``: the largest message
    sent or expected back (default: the pool's channels' limit, ``--max-message-mb``).
    """

    def __init__(self, pool: ServerPool, name: str, row_shape: Sequence[int], *,
                 dtype: str = "float32", init: str = "zeros", init_scale: float = 0.0,
                 seed: int = 0, optimizer: str = "none", lr: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 node_offsets: Sequence[int] | None = None,
                 max_message_bytes: int | None = None):
        replicated = sorted(p for p, eps_ in pool.cluster.partitions.items() if len(eps_) > 1)
        if replicated:
            raise ConfigError(f"node tensor {name!r}: parts {replicated} have several servers "
                              "in the cluster file; server-held tensors need exactly one "
                              "server per part (each replica would hold its own copy)")
        self.pool = pool
        self.name = name
        self.spec = TensorCreate(name=name, dtype=dtype, row_shape=list(row_shape), init=init,
                                 init_scale=init_scale, seed=seed, optimizer=optimizer, lr=lr,
                                 beta1=betas[0], beta2=betas[1], eps=eps)
        self.spec.check()  # a bad spec fails here, before any server sees it
        self.dtype = NODE_TENSOR_DTYPES[dtype]
        self.row_shape = tuple(row_shape)
        self.max_message_bytes = max_message_bytes or min(
            pool.channel(ep).max_message_bytes for _, ep in pool.cluster.all_endpoints())
        offsets = node_offsets if node_offsets is not None else pool.info().node_offsets
        self.offsets = torch.tensor(list(offsets), dtype=torch.int64)
        self.num_nodes = int(self.offsets[-1])
        infos = pool.scatter_gather({p: self.spec for p in self._parts()}, TensorInfo)
        self.created = any(info.created for info in infos.values())

    # ------------------------------------------------------------------ row operations
    def read(self, ids: Tensor) -> Tensor:
        """The rows of global node ``ids``: shape ``(len(ids), *row_shape)``."""
        ids = self._check_ids(ids)
        return self._gather(ids, with_state=False)[0]

    def write(self, ids: Tensor, rows: Tensor) -> None:
        """Set the rows of global node ``ids`` (unique) to ``rows``; each part's rows of a
        round (see the module doc) are written as one step on its server."""
        ids = self._check_ids(ids)
        self._scatter(ids, [self._check_rows(rows, ids, "rows")])

    def update(self, ids: Tensor, grads: Tensor) -> None:
        """One optimizer step on the servers for the rows of ``ids`` (gradients of a repeated
        id are summed)."""
        ids = self._check_ids(ids)
        grads = self._check_rows(grads, ids, "grads")
        ids, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros((ids.numel(), *self.row_shape), dtype=self.dtype)
        summed.index_add_(0, inverse, grads)
        for s in self._rounds(ids.numel(), _ID_BYTES + row_nbytes(self.spec, False)):
            chunk = ids[s]
            self.pool.scatter_gather(
                {p: TensorUpdate(name=self.name, ids=chunk[pos], grads=summed[s][pos])
                 for p, pos in self._split(chunk).items()}, Ack)

    def drop(self) -> None:
        """Free the tensor on every server."""
        self.pool.scatter_gather({p: TensorDrop(name=self.name) for p in self._parts()}, Ack)

    def nbytes_per_server(self) -> dict[int, int]:
        """Part -> bytes its server holds for this tensor (rows and optimizer state)."""
        rows = (self.offsets[1:] - self.offsets[:-1]).tolist()
        return {p: n * row_nbytes(self.spec) for p, n in enumerate(rows)}

    # ------------------------------------------------------------------ checkpoints
    def state_names(self) -> tuple[str, ...]:
        """The keys of :meth:`state_dict` that hold rows: "data", then the optimizer's."""
        return ("data", *OPTIMIZER_STATE[self.spec.optimizer])

    def state_dict(self) -> dict[str, Tensor]:
        """Every row (``"data"``, global id order) and the servers' optimizer state of each
        (``"sum"``; ``"exp_avg"``, ``"exp_avg_sq"``, ``"step"``), plus ``"hparams"`` (lr,
        beta1, beta2, eps as float64), read in rounds of at most the max message size."""
        parts = self._gather(torch.arange(self.num_nodes), with_state=True)
        return {**dict(zip(self.state_names(), parts)), "hparams": self._hparams()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Write rows and optimizer state of :meth:`state_dict` back exactly. A key, shape,
        dtype or hyper-parameter that differs from this tensor's is named (every one at
        once) and nothing is written."""
        problems = self._state_problems(state)
        if problems:
            raise ConfigError(f"node tensor {self.name!r}: the state dict does not fit "
                              f"this tensor: {'; '.join(problems)}")
        self._scatter(torch.arange(self.num_nodes), [state[k] for k in self.state_names()])

    # ------------------------------------------------------------------ rounds
    def _rounds(self, n: int, per_row: int) -> Iterator[slice]:
        """Slices of ``range(n)`` whose messages stay within the max message size."""
        step = (self.max_message_bytes - _HEADER_BYTES) // per_row
        if step < 1:
            raise ConfigError(f"node tensor {self.name!r}: one row ({per_row} bytes with its "
                              f"id and state) does not fit in {self.max_message_bytes} bytes "
                              "with the header; raise --max-message-mb")
        for lo in range(0, n, step):
            yield slice(lo, min(n, lo + step))

    def _gather(self, ids: Tensor, with_state: bool) -> list[Tensor]:
        """[rows, *optimizer state] of ``ids`` (state only ``with_state``), in rounds."""
        layout = [(self.dtype, self.row_shape)]
        if with_state:
            layout += [(dtype, shape) for _, dtype, shape in state_layout(self.spec)]
        out = [torch.empty((ids.numel(), *shape), dtype=dtype) for dtype, shape in layout]
        for s in self._rounds(ids.numel(), _ID_BYTES + row_nbytes(self.spec, with_state)):
            chunk = ids[s]
            split = self._split(chunk)
            replies = self.pool.scatter_gather(
                {p: TensorRead(name=self.name, ids=chunk[pos], with_state=with_state)
                 for p, pos in split.items()}, TensorRows)
            for p, pos in split.items():
                got = [replies[p].rows, *replies[p].state]
                if len(got) != len(out):
                    raise MfgServeError(f"node tensor {self.name!r}: part {p} sent "
                                        f"{len(got)} tensors per row, {len(out)} expected")
                for o, t in zip(out, got):
                    o[s][pos] = t
        return out

    def _scatter(self, ids: Tensor, parts: list[Tensor]) -> None:
        """Write ``parts`` ([rows, *optimizer state]) of ``ids`` in rounds."""
        per_row = _ID_BYTES + row_nbytes(self.spec, with_state=len(parts) > 1)
        for s in self._rounds(ids.numel(), per_row):
            chunk, rows = ids[s], [t[s] for t in parts]
            self.pool.scatter_gather(
                {p: TensorWrite(name=self.name, ids=chunk[pos], rows=rows[0][pos],
                                state=[t[pos] for t in rows[1:]])
                 for p, pos in self._split(chunk).items()}, Ack)

    # ------------------------------------------------------------------ helpers
    def _parts(self) -> range:
        return range(self.offsets.numel() - 1)

    def _hparams(self) -> Tensor:
        return torch.tensor([getattr(self.spec, k) for k in _HPARAMS], dtype=torch.float64)

    def _state_problems(self, state: dict[str, Tensor]) -> list[str]:
        """What in ``state`` differs from this tensor's spec (empty: it fits)."""
        want = {"data": (self.dtype, (self.num_nodes, *self.row_shape)), "hparams": (
            torch.float64, (len(_HPARAMS),))}
        want.update({n: (dtype, (self.num_nodes, *shape))
                     for n, dtype, shape in state_layout(self.spec)})
        problems = [f"keys {sorted(state)} but optimizer {self.spec.optimizer!r} needs "
                    f"{sorted(want)}"] if set(state) != set(want) else []
        for key in sorted(set(want) & set(state)):
            t = state[key]
            if not isinstance(t, Tensor) or (t.dtype, tuple(t.shape)) != want[key]:
                got = (t.dtype, tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__
                problems.append(f"{key!r} is {got}, expected {want[key]}")
        if not problems and not torch.equal(state["hparams"], self._hparams()):
            problems += [f"{k}={a} in the state dict, {b} here" for k, a, b in zip(
                _HPARAMS, state["hparams"].tolist(), self._hparams().tolist()) if a != b]
        return problems

    def _check_ids(self, ids: Tensor) -> Tensor:
        ids = torch.as_tensor(ids).detach().cpu()
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"node tensor {self.name!r}: ids must be a 1-D int64 tensor, got "
                             f"{ids.dtype} of shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_nodes):
            raise ValueError(f"node tensor {self.name!r}: ids must be in [0, {self.num_nodes})")
        return ids

    def _check_rows(self, rows: Tensor, ids: Tensor, what: str) -> Tensor:
        rows = rows.detach().cpu()
        want = (ids.numel(), *self.row_shape)
        if rows.dtype != self.dtype or tuple(rows.shape) != want:
            raise ValueError(f"node tensor {self.name!r}: {what} must be {self.dtype} of shape "
                             f"{want}, got {rows.dtype} of shape {tuple(rows.shape)}")
        return rows

    def _split(self, ids: Tensor) -> dict[int, Tensor]:
        """Part -> positions in ``ids`` of the ids it owns (parts with none left out)."""
        part_of = torch.searchsorted(self.offsets, ids, right=True) - 1
        return {int(p): torch.nonzero(part_of == p).flatten()
                for p in torch.unique(part_of).tolist()}
