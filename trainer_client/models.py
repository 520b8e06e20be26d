"""The choice of models: ``build_model(spec)`` from a plain-dict model spec.

A spec is JSON-able (it is saved in ``config.json``, ``best_model.pt`` and checkpoints, and
rebuilds the same module for inference)::

    {"name": "sage" | "gcn" | "gat" | "dgl-sage", "in_feats": int, "hidden": int,
     "num_classes": int, "num_layers": int, "dropout": float, "heads": int (gat only)}

* ``sage``: mean GraphSAGE (:class:`trainer_client.model.GraphSAGE`), plain torch.
* ``gcn``: :class:`GraphConv` layers, what ``dgl.nn.GraphConv(norm="both")`` computes.
* ``gat``: :class:`GATConv` layers, what ``dgl.nn.GATConv`` computes (no feature/attention
  dropout, no residual); ``hidden`` is the width per head, hidden layers concatenate their
  ``heads`` heads (``hidden * heads`` wide) and the last layer averages them.
* ``rsage``, ``hetero-sage`` (common.config.HETERO_MODEL_NAMES): the typed models over typed
  MFGs, relational GraphSAGE (:class:`trainer_client.hetero_model.RelGraphSAGE`) and DGL's
  ``HeteroGraphConv`` of ``SAGEConv`` (:class:`~trainer_client.hetero_model.HeteroSAGE`);
  their spec is that module's (see :func:`~trainer_client.hetero_model.check_hetero_spec`),
  built by :func:`~trainer_client.hetero_model.build_hetero_model`: ``forward(mfg, x)`` with
  a HeteroMFG and a dict of inputs per type.
* ``dgl-sage``: ``dgl.nn.SAGEConv("mean")`` layers applied to ``block.to_dgl()``: the path for
  models written against DGL (CPU, needs DGL); the same state-dict keys as ``sage``.

Every model has ``num_layers``, ``forward_layer(i, block, h)`` and ``forward(blocks, x)``
(see :class:`trainer_client.model.LayerwiseGNN`). The plain-torch ones run on any device and
never import DGL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.config import HETERO_MODEL_NAMES, MODEL_NAMES  # the --model choices
from common.errors import ConfigError
from common.mfg import Block, count_index
from trainer_client.model import (
    GraphSAGE,
    LayerwiseGNN,
    layer_dims,
    mean_aggregate,
    project,
    project_first,
)

__all__ = ["MODEL_NAMES", "build_model", "check_spec", "GraphConv", "GATConv", "GCN", "GAT",
           "DGLGraphSAGE", "edge_softmax"]
_INT_KEYS = ("in_feats", "hidden", "num_classes", "num_layers")
SPEC_KEYS = ("name",) + _INT_KEYS + ("dropout", "heads")


class GraphConv(nn.Module):
    """``h_v' = sum_{u -> v} h_u W / sqrt(d_out(u) d_in(v)) + b`` with the block's sampled
    degrees clamped at 1, as ``dgl.nn.GraphConv(in, out, norm="both")`` computes on a block
    (same parameter names: ``weight`` [in, out], ``bias``). The sum is the block's mean
    SpMM times the in-degree, so it shares that kernel and its backward. The projection goes
    through :func:`~trainer_client.model.project` (bfloat16 at ``--matmul-precision
    medium`` where the CPU has it)."""

    def __init__(self, in_feats: int, out_feats: int):
        super().__init__()
        self.in_feats, self.out_feats = in_feats, out_feats
        self.weight = nn.Parameter(torch.empty(in_feats, out_feats))
        self.bias = nn.Parameter(torch.zeros(out_feats))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, block: Block, h_src: Tensor) -> Tensor:
        out_deg = count_index(block.indices, block.num_src_nodes())
        h = h_src * out_deg.clamp(min=1).to(h_src.dtype).rsqrt().unsqueeze(1)
        first = project_first(block, self.in_feats, self.out_feats)  # the cheaper order
        if first:
            h = project(h, self.weight)
        h = mean_aggregate(block, h)
        if not first:
            h = project(h, self.weight)
        # mean * d_in / sqrt(d_in) = sum / sqrt(d_in)
        in_deg = block.in_degrees().clamp(min=1).to(h.dtype)
        return h * in_deg.sqrt().unsqueeze(1) + self.bias


def edge_softmax(block: Block, e: Tensor) -> Tensor:
    """Softmax of edge scores ``e`` [num_edges, heads] over each destination's in-edges.

    The per-destination max is subtracted first (no overflow); it is a constant for the
    gradient (softmax does not depend on it), so it is taken from ``e.detach()``."""
    dst = block.dst_index()
    shape = (block.num_dst_nodes(),) + tuple(e.shape[1:])
    index = dst.view((-1,) + (1,) * (e.dim() - 1)).expand_as(e)
    e_max = e.new_zeros(shape).scatter_reduce_(0, index, e.detach(), "amax",
                                               include_self=False)
    ex = torch.exp(e - e_max[dst])
    denom = e.new_zeros(shape).index_add(0, dst, ex)
    return ex / denom[dst]


class GATConv(nn.Module):
    """Graph attention as ``dgl.nn.GATConv(in, out, heads)`` computes it with no feature or
    attention dropout and no residual (same parameter names: ``fc``, ``attn_l``,
    ``attn_r``, ``bias``). Output ``[num_dst, heads, out]``; a destination without in-edges
    gets the bias only. ``fc`` is applied through :func:`~trainer_client.model.project`
    (bfloat16 at ``--matmul-precision medium`` where the CPU has it)."""

    def __init__(self, in_feats: int, out_feats: int, num_heads: int,
                 negative_slope: float = 0.2):
        super().__init__()
        self.num_heads, self.out_feats = num_heads, out_feats
        self.negative_slope = negative_slope
        self.fc = nn.Linear(in_feats, out_feats * num_heads, bias=False)
        self.attn_l = nn.Parameter(torch.empty(1, num_heads, out_feats))
        self.attn_r = nn.Parameter(torch.empty(1, num_heads, out_feats))
        self.bias = nn.Parameter(torch.zeros(num_heads * out_feats))
        gain = nn.init.calculate_gain("relu")
        for p in (self.fc.weight, self.attn_l, self.attn_r):
            nn.init.xavier_normal_(p, gain=gain)

    def forward(self, block: Block, h_src: Tensor) -> Tensor:
        feat = project(h_src, self.fc.weight.t()).view(-1, self.num_heads, self.out_feats)
        el = (feat * self.attn_l).sum(-1)  # [num_src, heads]
        er = (feat[:block.num_dst_nodes()] * self.attn_r).sum(-1)
        src, dst = block.edges()
        e = F.leaky_relu(el[src] + er[dst], self.negative_slope)
        a = edge_softmax(block, e)
        msg = feat[src] * a.unsqueeze(-1)  # [num_edges, heads, out]
        out = feat.new_zeros((block.num_dst_nodes(), self.num_heads, self.out_feats))
        out = out.index_add(0, dst, msg)
        return out + self.bias.view(1, self.num_heads, self.out_feats)


class GCN(LayerwiseGNN):
    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int,
                 dropout: float = 0.5):
        dims = layer_dims(in_feats, hidden, num_classes, num_layers)
        super().__init__([GraphConv(a, b) for a, b in zip(dims[:-1], dims[1:])], dropout)


class GAT(LayerwiseGNN):
    """GATConv layers: hidden layers concatenate their heads, the last averages them."""

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int,
                 dropout: float = 0.5, heads: int = 4):
        ins = [in_feats] + [hidden * heads] * (num_layers - 1)
        outs = [hidden] * (num_layers - 1) + [num_classes]
        super().__init__([GATConv(a, b, heads) for a, b in zip(ins, outs)], dropout)

    def conv(self, i: int, block: Block, h: Tensor) -> Tensor:
        out = self.layers[i](block, h)
        return out.mean(1) if i == len(self.layers) - 1 else out.flatten(1)


class DGLGraphSAGE(LayerwiseGNN):
    """``dgl.nn.SAGEConv("mean")`` layers on ``block.to_dgl()``: how a model written for DGL
    runs on mfgserve's blocks. Same parameters (and state-dict keys) as :class:`GraphSAGE`."""

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int,
                 dropout: float = 0.5):
        from common.dgl_compat import DGLUnavailableError, import_dgl

        try:
            import_dgl()
        except DGLUnavailableError as e:
            raise ConfigError(f"model 'dgl-sage' needs DGL, which cannot be imported ({e}); "
                              "install dgl or choose the plain-torch 'sage'") from e
        from dgl.nn import SAGEConv

        dims = layer_dims(in_feats, hidden, num_classes, num_layers)
        super().__init__([SAGEConv(a, b, "mean") for a, b in zip(dims[:-1], dims[1:])],
                         dropout)

    def conv(self, i: int, block, h: Tensor) -> Tensor:
        g = block.to_dgl() if isinstance(block, Block) else block  # DGL blocks pass through
        return self.layers[i](g, (h, h[:g.num_dst_nodes()]))


def _check_int(spec: dict, key: str) -> int:
    v = spec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"model spec: {key!r} must be an integer >= 1, got {v!r}")
    return v


def check_spec(spec: dict) -> dict:
    """``spec`` validated and normalised (a new dict); :class:`ConfigError` names the key
    that is missing, unknown or out of range and what it accepts."""
    if not isinstance(spec, dict):
        raise ConfigError(f"model spec must be a dict, got {type(spec).__name__}")
    if spec.get("name") in HETERO_MODEL_NAMES:
        from trainer_client.hetero_model import check_hetero_spec

        return check_hetero_spec(spec)
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ConfigError(f"model spec: unknown key(s) {unknown}; accepted: {list(SPEC_KEYS)}")
    name = spec.get("name")
    if name not in MODEL_NAMES:
        raise ConfigError(f"model spec: 'name' must be one of {list(MODEL_NAMES)} (or, "
                          f"typed, {list(HETERO_MODEL_NAMES)}), got {name!r}")
    out: dict = {"name": name}
    for key in _INT_KEYS:
        out[key] = _check_int(spec, key)
    p = spec.get("dropout")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ConfigError(f"model spec: 'dropout' must be a number in [0, 1), got {p!r}")
    out["dropout"] = float(p)
    if name == "gat" or "heads" in spec:  # only gat uses it; any spec may carry it
        out["heads"] = _check_int(spec, "heads")
    return out


def build_model(spec: dict) -> nn.Module:
    """The model ``spec`` describes (see the module docstring; ``rsage`` / ``hetero-sage``:
    a typed model, trainer_client.hetero_model's spec), freshly initialised."""
    s = check_spec(spec)
    if s["name"] in HETERO_MODEL_NAMES:
        from trainer_client.hetero_model import build_hetero_model

        return build_hetero_model(s)
    args = (s["in_feats"], s["hidden"], s["num_classes"], s["num_layers"], s["dropout"])
    if s["name"] == "gat":
        return GAT(*args, heads=s["heads"])
    cls = {"sage": GraphSAGE, "gcn": GCN, "dgl-sage": DGLGraphSAGE}[s["name"]]
    return cls(*args)


def build_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Adam:
    """The trainer's optimizer: ``torch.optim.Adam`` (L2 weight decay) with torch's fused
    kernel, one kernel per parameter instead of about ten element-wise ops each. The same
    update up to float rounding (GraphSAGE's parameters 3e-8 apart after 50 steps). On 2 CPU
    cores the seed model's optimizer step takes 0.25 ms instead of 1.12 (docs/benchmarks.md,
    "Issue 14, session 26"). Where torch refuses the fused kernel (torch before 2.4 has none
    for CPU), the default implementation."""
    params = list(params)
    try:
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:  # "`fused=True` requires all the params to be ... supported devices"
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)


def non_finite_flag(params, loss: Tensor) -> Tensor:
    """1.0 when ``loss`` or any gradient entry of ``params`` is NaN/inf, else 0.0: a 0-dim
    float tensor on the loss's device, computed without reading anything back. One
    multi-tensor kernel checks every gradient (``GradScaler``'s check, with a scale of 1: the
    gradients are multiplied by exactly 1) instead of a reduction per parameter: on a GPU one
    launch instead of about fifteen, on the CPU 190 us a step instead of 240 for the seed
    model's 10 parameters. Where a torch has no such kernel for the device, one sum per
    parameter (a finite sum overflowing float32 then counts as a blow-up too)."""
    grads = [p.grad for p in params if p.grad is not None]
    found = torch.zeros((), device=loss.device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [*grads, loss.detach().reshape(1)], found, found.new_ones(()))
        return found  # the kernel writes 1.0, never more: the fused Adam skips on == 1
    except (NotImplementedError, RuntimeError):
        return sums_non_finite([*grads, loss.detach().reshape(())])


def sums_non_finite(tensors: list[Tensor]) -> Tensor:
    """1.0 when any of ``tensors`` (non-empty, one device) holds a NaN/inf, else 0.0, as a
    0-dim float tensor, from one sum per tensor: NaN/inf anywhere makes its sum non-finite
    (a finite sum overflowing float32 counts too: a blow-up all the same). About 10x cheaper
    than ``isfinite(t).all()`` per tensor."""
    values = torch.stack([t.sum() for t in tensors]).float()
    return torch.logical_not(torch.isfinite(values)).any().float()


def supports_guard(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` can skip a step on a device-side flag (``guarded_step``): torch's fused
    Adam takes ``found_inf``, the protocol ``torch.amp.GradScaler`` uses; the default
    implementation refuses it."""
    return isinstance(opt, torch.optim.Adam) and bool(opt.defaults.get("fused"))


def guarded_step(opt: torch.optim.Optimizer, params, loss: Tensor) -> Tensor:
    """Queue ``opt``'s step so that it changes nothing when the loss or a gradient is not
    finite, and return that flag (``non_finite_flag``) for the caller to read later. The fused
    kernel skips the parameters, moments and step count where the flag is 1; on a GPU nothing
    here makes the host wait, so the caller can read the loss after fetching the next batch
    (``train._step``). Needs ``supports_guard(opt)``."""
    bad = non_finite_flag(params, loss)
    opt.found_inf = bad  # type: ignore[attr-defined]  # read by torch.optim.adam._fused_adam
    opt.step()
    return bad

