"""GraphSAGE in plain torch on :class:`common.mfg.Block` s: runs on CPU and CUDA alike.

(The other models, GCN and GAT, and ``build_model`` are in :mod:`trainer_client.models`;
they share :func:`mean_aggregate`, :class:`Dropout` and :class:`LayerwiseGNN` from here.)

:class:`SAGEConv` computes exactly what ``dgl.nn.SAGEConv(in, out, "mean")`` computes on the
same block with the same weights (tested against DGL)::

    h_dst' = fc_self(h_dst) + fc_neigh(mean_{u in N(v)} h_u)      (fc_self carries the bias)

with the mean over the block's sampled in-edges (0 for a destination without any). The mean
is one sparse-dense matrix product (CSR, fused, no per-edge message tensor) whose backward
is the product with the transposed matrix: the same code on CPU and CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.mfg import Block


class _SpMM(torch.autograd.Function):
    """``A @ x`` for the block's constant mean matrix; A^T is built only if x needs a grad."""

    @staticmethod
    def forward(ctx, x: Tensor, block: Block) -> Tensor:
        ctx.block = block
        a = block.mean_adj()
        return torch.sparse.mm(a if a.dtype == x.dtype else a.to(x.dtype), x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a_t = ctx.block.mean_adj_t()
        if a_t.dtype != grad.dtype:
            a_t = a_t.to(grad.dtype)
        return torch.sparse.mm(a_t, grad.contiguous()), None


def mean_aggregate(block: Block, h_src: Tensor) -> Tensor:
    """Mean of each destination's sampled in-neighbours' rows of ``h_src`` (0 if none)."""
    if block.num_edges() == 0:
        return h_src.new_zeros((block.num_dst_nodes(), h_src.shape[1]))
    return _SpMM.apply(h_src, block)


class SAGEConv(nn.Module):
    def __init__(self, in_feats: int, out_feats: int, bias: bool = True):
        super().__init__()
        self.in_feats, self.out_feats = in_feats, out_feats
        self.fc_self = nn.Linear(in_feats, out_feats, bias=bias)
        self.fc_neigh = nn.Linear(in_feats, out_feats, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gain = nn.init.calculate_gain("relu")
        nn.init.xavier_uniform_(self.fc_self.weight, gain=gain)
        nn.init.xavier_uniform_(self.fc_neigh.weight, gain=gain)

    def forward(self, block: Block, h_src: Tensor) -> Tensor:
        num_dst = block.num_dst_nodes()
        h_dst = h_src[:num_dst]
        # Project first when that shrinks the rows we move along edges (same result).
        project_first = self.in_feats > self.out_feats
        msg_src = self.fc_neigh(h_src) if project_first else h_src
        h_neigh = mean_aggregate(block, msg_src)
        if not project_first:
            h_neigh = self.fc_neigh(h_neigh)
        return self.fc_self(h_dst) + h_neigh


_BITS = 15  # random bits per element of a CPU dropout mask


class _CpuDropout(torch.autograd.Function):
    """Dropout whose mask comes from bulk random bits: ``torch.bernoulli_`` draws one
    Mersenne-Twister number per element and takes ~0.26 s for a 50,000 x 256 activation on 2
    cores; 64-bit draws cut into 15-bit uniforms take ~0.03 s. The drop probability is rounded
    to a multiple of 2**-15 (exact for 0.5) and kept rows are scaled by 1 / (1 - that)."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        n = x.numel()
        words = torch.empty((n + 3) // 4, dtype=torch.int64).random_()
        r = words.view(torch.int16)[:n].view(x.shape) & ((1 << _BITS) - 1)
        cut = round(p * (1 << _BITS))
        drop = r < cut
        scale = (1 << _BITS) / ((1 << _BITS) - cut)
        ctx.save_for_backward(drop)
        ctx.scale = scale
        return x.masked_fill(drop, 0.0).mul_(scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (drop,) = ctx.saved_tensors
        return grad.masked_fill(drop, 0.0).mul_(ctx.scale), None


class Dropout(nn.Dropout):
    """``nn.Dropout`` with a faster mask on CPU (see :class:`_CpuDropout`); CUDA and eval
    mode behave exactly like ``nn.Dropout``."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu" or self.p >= 1:
            return super().forward(x)
        return _CpuDropout.apply(x, self.p)


class LayerwiseGNN(nn.Module):
    """Layers with ReLU + dropout between them, run one layer at a time.

    ``forward_layer(i, block, h)`` is layer i and the ReLU + dropout after it (none after the
    last): layer-wise full-neighbour inference calls it per layer over all nodes, training
    calls :meth:`forward`, which loops over it, so both compute the same function.
    Subclasses whose layer output is not ``[num_dst, features]`` override :meth:`conv`.
    """

    def __init__(self, layers: list[nn.Module], dropout: float):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.dropout = Dropout(dropout)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def conv(self, i: int, block: Block, h: Tensor) -> Tensor:
        return self.layers[i](block, h)

    def forward_layer(self, i: int, block: Block, h: Tensor) -> Tensor:
        h = self.conv(i, block, h)
        if i != len(self.layers) - 1:
            h = self.dropout(F.relu(h))
        return h

    def forward(self, blocks, x: Tensor) -> Tensor:
        if len(blocks) != len(self.layers):
            raise ValueError(f"{type(self).__name__} has {len(self.layers)} layers but got "
                             f"{len(blocks)} blocks: sample one block per layer (as many "
                             "fanouts as layers)")
        h = x
        for i, block in enumerate(blocks):
            h = self.forward_layer(i, block, h)
        return h


def layer_dims(in_feats: int, hidden: int, num_classes: int, num_layers: int) -> list[int]:
    """Input width, then each layer's output width: ``[in, hidden, ..., num_classes]``."""
    return [in_feats] + [hidden] * (num_layers - 1) + [num_classes]


class GraphSAGE(LayerwiseGNN):
    """Layers of mean-SAGEConv with ReLU and dropout between them (the seed tutorial's model)."""

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int,
                 dropout: float = 0.5):
        dims = layer_dims(in_feats, hidden, num_classes, num_layers)
        super().__init__([SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:])], dropout)
