"""Trainer side of server-held node tensors (see sampler_server/node_tensors.py).

A :class:`DistNodeTensor` is one named per-node tensor whose rows live on the sampler servers,
each part's rows on its part's server. ``read``/``write``/``update`` take global node ids in
any order, split them by owning part (``node_offsets`` from PONG), send one request per part
over the trainer's :class:`~trainer_client.server_pool.ServerPool` at once, and put the
answers back in the order asked (the ReplicaSet's ``scatter_gather``).

Replicas: a tensor's rows are state held by one server, so every part must have exactly one
server in the cluster file (replicas would each hold their own diverging copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from common.errors import ConfigError
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

if TYPE_CHECKING:
    from trainer_client.server_pool import ServerPool


class DistNodeTensor:
    """Create (or attach to, when the spec matches) node tensor ``name`` on every part.

    ``init``: zeros, uniform (U(-init_scale, init_scale)) or normal (std init_scale), seeded
    by ``seed``; ``optimizer``: none, sgd, adagrad or adam, applied by :meth:`update` on the
    servers with ``lr``, ``betas`` and ``eps``.
    """

    def __init__(self, pool: ServerPool, name: str, row_shape: Sequence[int], *, dtype: str = "float32",
                 init: str = "zeros", init_scale: float = 0.0, seed: int = 0,
                 optimizer: str = "none", lr: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 node_offsets: Sequence[int] | None = None):
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
        offsets = node_offsets if node_offsets is not None else pool.info().node_offsets
        self.offsets = torch.tensor(list(offsets), dtype=torch.int64)
        self.num_nodes = int(self.offsets[-1])
        parts = range(self.offsets.numel() - 1)
        infos = pool.scatter_gather({p: self.spec for p in parts}, TensorInfo)
        self.created = any(info.created for info in infos.values())

    # ------------------------------------------------------------------ row operations
    def read(self, ids: Tensor) -> Tensor:
        """The rows of global node ``ids``: shape ``(len(ids), *row_shape)``."""
        ids = self._check_ids(ids)
        out = torch.empty((ids.numel(), *self.row_shape), dtype=self.dtype)
        split = self._split(ids)
        replies = self.pool.scatter_gather(
            {p: TensorRead(name=self.name, ids=ids[pos]) for p, pos in split.items()}, TensorRows)
        for p, pos in split.items():
            out[pos] = replies[p].rows
        return out

    def write(self, ids: Tensor, rows: Tensor) -> None:
        """Set the rows of global node ``ids`` (unique) to ``rows``; each part's rows are
        written as one step on its server."""
        ids = self._check_ids(ids)
        rows = self._check_rows(rows, ids, "rows")
        self.pool.scatter_gather({p: TensorWrite(name=self.name, ids=ids[pos], rows=rows[pos])
                                  for p, pos in self._split(ids).items()}, Ack)

    def update(self, ids: Tensor, grads: Tensor) -> None:
        """One optimizer step on the servers for the rows of ``ids`` (gradients of a repeated
        id are summed)."""
        ids = self._check_ids(ids)
        grads = self._check_rows(grads, ids, "grads")
        self.pool.scatter_gather({p: TensorUpdate(name=self.name, ids=ids[pos], grads=grads[pos])
                                  for p, pos in self._split(ids).items()}, Ack)

    def drop(self) -> None:
        """Free the tensor on every server."""
        self.pool.scatter_gather({p: TensorDrop(name=self.name)
                                  for p in range(self.offsets.numel() - 1)}, Ack)

    # ------------------------------------------------------------------ helpers
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
