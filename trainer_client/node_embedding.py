"""Learnable node embeddings held on the sampler servers (DistDGL's DistEmbedding).

A :class:`NodeEmbedding` is a :class:`~trainer_client.node_tensors.DistNodeTensor` of shape
``(num_nodes, dim)`` with a sparse optimizer run by the servers: the trainer never holds the
whole table, only the rows of the current mini-batch.

One training step::

    x = torch.cat([batch_features, emb.lookup(input_nodes)], dim=1)
    loss = ...; loss.backward(); opt.step()   # the dense parameters
    emb.step()                                # the looked-up rows, on the servers

:meth:`lookup` returns the rows as a fresh leaf tensor that requires grad (in training mode,
with grad enabled) and remembers it; :meth:`step` sends the gradients of every row looked up
since the last step (a row looked up twice gets its gradients summed: one optimizer step per
row, as DGL's sparse optimizers do) and forgets them.

Several trainers (DDP ranks): the embedding is not a DDP parameter; each rank sends the
gradients of the rows *it* looked up, and the server applies each rank's update as it
arrives, so a row two ranks used in the same step gets two optimizer steps, each with one
rank's gradient (the push-based update of DistDGL's DistEmbedding and its sparse optimizers;
nothing is averaged across ranks). Updates of different rows never interfere.

The optimizer (default ``adam``: DGL's SparseAdam, i.e. per-row step counts for the bias
correction; also ``adagrad``, ``sgd``) and its state live on the servers;
:meth:`state_dict` reads rows and optimizer state back for a checkpoint and
:meth:`load_state_dict` restores both exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from common.errors import ConfigError
from trainer_client.node_tensors import DistNodeTensor

if TYPE_CHECKING:
    from trainer_client.server_pool import ServerPool


class NodeEmbedding:
    """``num_nodes`` rows of width ``dim`` on the servers, initialised U(-init_scale,
    init_scale) from ``seed`` (each part's rows from the seed and the part's first id), and
    trained by the servers' ``optimizer`` with ``lr``, ``betas`` and ``eps``.

    Constructing it on several ranks attaches every rank to the one table (same spec); a
    different spec on an existing name is refused with the fields that differ.
    """

    def __init__(self, pool: ServerPool, name: str, num_nodes: int, dim: int, *, lr: float,
                 optimizer: str = "adam", init_scale: float = 1.0, seed: int = 0,
                 node_offsets: Sequence[int] | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 max_message_bytes: int | None = None):
        if optimizer == "none":
            raise ConfigError(f"node embedding {name!r}: optimizer must be sgd, adagrad or "
                              "adam (a DistNodeTensor holds rows nothing trains)")
        self.tensor = DistNodeTensor(
            pool, name, [dim], dtype="float32", init="uniform", init_scale=init_scale,
            seed=seed, optimizer=optimizer, lr=lr, betas=betas, eps=eps,
            node_offsets=node_offsets, max_message_bytes=max_message_bytes)
        if self.tensor.num_nodes != num_nodes:
            raise ConfigError(f"node embedding {name!r}: {num_nodes} nodes asked, but the "
                              f"servers' parts hold {self.tensor.num_nodes} (node_offsets)")
        self.name, self.num_nodes, self.dim = name, num_nodes, dim
        self.training = True
        self._trace: list[tuple[Tensor, Tensor]] = []  # (ids, leaf rows) since the last step

    # ------------------------------------------------------------------ mode
    def train(self, mode: bool = True) -> NodeEmbedding:
        """Training mode: lookups are recorded for :meth:`step` (like nn.Module.train)."""
        self.training = mode
        return self

    def eval(self) -> NodeEmbedding:
        return self.train(False)

    # ------------------------------------------------------------------ training
    def lookup(self, ids: Tensor, device: torch.device | str | None = None) -> Tensor:
        """The rows of global node ``ids`` (1-D int64, any order, repeats allowed) on
        ``device``: shape ``(len(ids), dim)``. In training mode with grad enabled, a leaf
        that requires grad, remembered until :meth:`step`."""
        ids = torch.as_tensor(ids).detach().to("cpu", torch.int64)
        rows = self.tensor.read(ids)
        if device is not None:
            rows = rows.to(device)
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._trace.append((ids, rows))
        return rows

    def step(self) -> None:
        """One sparse optimizer step on the servers for every row looked up since the last
        step (rows whose lookup got no gradient are skipped), then forget the lookups."""
        trace, self._trace = self._trace, []
        used = [(ids, rows.grad) for ids, rows in trace if rows.grad is not None]
        if not used:
            return
        ids = torch.cat([i for i, _ in used])
        grads = torch.cat([g.detach().to("cpu", torch.float32) for _, g in used])
        self.tensor.update(ids, grads)

    def zero_grad(self) -> None:
        """Forget the lookups since the last step without updating anything."""
        self._trace = []

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Tensor]:
        """Every row and the servers' optimizer state (see DistNodeTensor.state_dict)."""
        return self.tensor.state_dict()

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Write rows and optimizer state back exactly; a mismatch is named and nothing is
        written."""
        self.tensor.load_state_dict(state)

    def nbytes_per_server(self) -> dict[int, int]:
        """Part -> bytes its server holds for this embedding (rows + optimizer state)."""
        return self.tensor.nbytes_per_server()
