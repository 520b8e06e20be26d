"""GraphSAGE in plain torch on :class:`common.mfg.Block` s: runs on CPU and CUDA alike.

(The other models, GCN and GAT, and ``build_model`` are in :mod:`trainer_client.models`;
they share :func:`mean_aggregate`, :class:`Dropout` and :class:`LayerwiseGNN` from here.)

:class:`SAGEConv` computes exactly what ``dgl.nn.SAGEConv(in, out, "mean")`` computes on the
same block with the same weights (tested against DGL)::

    h_dst' = fc_self(h_dst) + fc_neigh(mean_{u in N(v)} h_u)      (fc_self carries the bias)

with the mean over the block's sampled in-edges (0 for a destination without any). The mean
is one weighted ``embedding_bag`` over the CSC (fused, no per-edge message tensor) whose
backward is the same kernel over the transposed bags: the same code on CPU and CUDA. The
step is built to move as few bytes and multiply as little as it can (see
:class:`_MeanAggregate`, :class:`_LinearSum`, :func:`project_first` and GraphSAGE's
in-place ReLU): on 2 CPU cores the trainer step is bound by its GEMMs (at 120-180 GFLOP/s)
and memory passes, and every full-size temporary costs page faults and passes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common import native
from common.config import check_cpu_gemm
from common.cpuinfo import first_cpu
from common.mfg import Block, SourceRows


class _MeanAggregate(torch.autograd.Function):
    """The mean over each destination's sampled in-neighbours, as one weighted
    ``embedding_bag`` over the block's CSC (no per-edge message tensor; on CPU about twice as
    fast as a CSR sparse-dense product, and the same call on CUDA). The backward is the same
    kernel over the transposed bags.

    With ``with_dst`` it also returns ``x[:num_dst]`` (a copy): the layer's self term. The
    backward then adds that term's gradient into the first rows of the one gradient it writes
    for ``x``, instead of autograd zero-filling a full-size gradient for the slice and adding
    the two (three passes over a [num_src, width] tensor per layer).

    With ``relu`` (and ``with_dst``) it first applies the previous layer's activation to
    ``x``: ReLU, then, where ``keep`` is given, dropout (``x * keep * scale``,
    :func:`_keep_mask`'s mask and scale).
    ``x`` is changed in place to ``relu(x) * keep`` and becomes a third output (for autograd's
    version tracking); the scale goes into the mean's weights and the self term's copy, so no
    pass over ``x`` applies it. The backward scales through the same weights and the self
    term's addition, then masks the gradient it wrote by that ``x``, in place: ``x > 0``
    exactly where an element was kept and positive. NaN's gradient passes, as through ReLU;
    so does a dropped NaN's, which dropout's backward would zero (its NaN reaches the loss
    either way). No ReLU or dropout node, each of which would write a further
    ``[num_src, width]`` gradient (:class:`GraphSAGE`; docs/benchmarks.md, "Issue 14,
    session 46").
    """

    @staticmethod
    def forward(ctx, x: Tensor, block: Block, with_dst: bool, rows: int, relu: bool = False,
                keep: Tensor | None = None, scale: float = 1.0):
        ctx.block, ctx.x_rows, ctx.relu, ctx.scale = block, x.shape[0], relu, scale
        if relu:
            ctx.set_materialize_grads(False)
            x.clamp_min_(0)  # NaN stays, as in F.relu
            if keep is not None:
                x.mul_(keep.view(torch.uint8))
            ctx.mark_dirty(x)
            ctx.save_for_backward(x)
        num_dst = block.num_dst_nodes()
        idx, off, w = block.mean_bags(x.dtype)
        agg = F.embedding_bag(idx, x, _pad_offsets(off, rows - num_dst), mode="sum",
                              per_sample_weights=w if scale == 1.0 else w * scale,
                              include_last_offset=True)
        if not with_dst:
            return agg
        head = x[:num_dst]
        if rows == num_dst:
            dst = head.clone() if scale == 1.0 else torch.mul(head, scale)
        else:
            dst = F.pad(head, (0, 0, 0, rows - num_dst))
            if scale != 1.0:
                dst.mul_(scale)
        return (agg, dst, x) if relu else (agg, dst)

    @staticmethod
    def backward(ctx, grad_agg: Tensor | None, grad_dst: Tensor | None = None,
                 grad_x: Tensor | None = None):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        block, scale = ctx.block, ctx.scale
        if grad_agg is None:  # only with relu (no materialized zeros)
            like = grad_dst if grad_dst is not None else grad_x
            grad = like.new_zeros((ctx.x_rows, like.shape[1]))
        else:
            idx, off, w = block.mean_bags_t(grad_agg.dtype)
            grad = F.embedding_bag(idx, grad_agg.contiguous(),
                                   _pad_offsets(off, ctx.x_rows - block.num_src_nodes()),
                                   mode="sum", per_sample_weights=w if scale == 1.0
                                   else w * scale, include_last_offset=True)
        if grad_dst is not None:
            num_dst = block.num_dst_nodes()
            grad[:num_dst].add_(grad_dst[:num_dst], alpha=scale)
        if grad_x is not None:  # the third output, relu(x) * keep, unscaled
            grad += grad_x
        if ctx.relu:
            (y,) = ctx.saved_tensors
            torch.ops.aten.threshold_backward.grad_input(grad, y, 0, grad_input=grad)
        return grad, None, None, None, None, None, None


def _pad_offsets(offsets: Tensor, extra: int) -> Tensor:
    """``offsets`` (``include_last_offset``) with ``extra`` empty bags appended: their rows
    of the ``embedding_bag`` are zeros."""
    if extra <= 0:
        return offsets
    return torch.cat([offsets, offsets[-1:].expand(extra)])


_BF16_GEMM: bool | None = None  # whether medium precision multiplies in bfloat16 here (probed)
#: ``--cpu-gemm`` (one of common.config.CPU_GEMMS): which library multiplies the model's float32
#: products on the CPU (:func:`float32_library`)
_CPU_GEMM = "auto"
_ONEDNN_AUTO: bool | None = None  # what "auto" chose on this CPU (cpu_gemm_auto)
#: how many of this process's float32 model products went to oneDNN (_LinearSumDnn's
#: forward products)
ONEDNN_PRODUCTS_RUN = [0]
#: how many weight gradients _LinearSumDnn's backward computed through oneDNN
ONEDNN_WEIGHT_GRADS_RUN = [0]
_BF16_CAST: bool | None = None  # whether bfloat16 tensors multiply natively here (CPU flags)


def gemm_rows(num_rows: int, device: torch.device) -> int:
    """Rows to give a layer's GEMM operands of ``num_rows`` rows: ``num_rows`` itself, or,
    where SAGEConv's products run through oneDNN (in bfloat16: ``--matmul-precision medium``
    on a CPU where that takes effect, :func:`bf16_products`; in float32: ``--cpu-gemm``'s
    oneDNN, :func:`float32_library`), the next multiple of a step of 1/16 to 1/32 of it.

    oneDNN builds (JIT-compiles) a kernel for every new GEMM shape, 5-10 ms each on this
    2-core machine, while a sampled block's row count changes every batch: with exact shapes
    every GEMM of a step would pay that and run slower than float32. Bucketed shapes repeat
    and hit oneDNN's primitive cache. The extra rows are zeros (or rows no one reads) going
    forward and carry zero gradients back (see :class:`SAGEConv`), so the function and the
    gradients are the same. In float32 the build is cheaper but grows with the rows: at
    45-55k rows x 100 x 256 (the products graph's input layer) a new shape's first product
    took 30-73 ms against 12-14 ms once built (session 50, AMD EPYC), and the varying
    output sizes kept growing the heap (100 MB of fresh pages in some calls); bucketed, every
    call took 12-14 ms. MKL's float32 GEMM has no such cost: on it nothing is padded."""
    if not gemm_buckets(device):
        return num_rows
    step = 1 << max(6, num_rows.bit_length() - 5)
    return max(step, -(-num_rows // step) * step)


def gemm_buckets(device: torch.device) -> bool:
    """Whether :func:`gemm_rows` buckets on ``device`` now: wherever SAGEConv's products
    go to oneDNN, which builds a kernel per shape: in bfloat16 (:func:`bf16_products`) or
    in float32 (:func:`float32_library`)."""
    return bf16_products(device) is not None or float32_library(device) == "onednn"


def bf16_products(device: torch.device) -> str | None:
    """How SAGEConv's float32 products get bfloat16 on ``device`` at the process's matmul
    precision: ``"onednn"`` where torch's ``medium`` itself rounds them
    (:func:`bf16_gemms_possible`: an Intel CPU with AMX), ``"cast"`` where it does not but
    the CPU has bfloat16 dot-product instructions (:func:`cpu_multiplies_bf16`: AMD Zen 4
    and later, Intel Cooper Lake), so that SAGEConv rounds the operands itself
    (:class:`_LinearSumPacked`); None at ``highest`` / ``high``, off the CPU, or on a
    CPU without either."""
    if device.type != "cpu" or torch.get_float32_matmul_precision() != "medium":
        return None
    return medium_products()


def bf16_gemms_possible() -> bool:
    """Whether torch multiplies float32 in bfloat16 on this CPU at matmul precision
    ``medium`` (what ``--matmul-precision medium`` then uses): probed once, by one small
    product at that precision (:func:`_medium_rounds_to_bf16`).

    A CPU flag is not enough: torch sends a float32 product to oneDNN with bfloat16 allowed
    on any CPU with AVX-512, and oneDNN uses bfloat16 only where it has a kernel for it.
    Session 38's Intel Xeon (AMX) got bfloat16 products; session 39's AMD EPYC (Zen 4, with
    ``avx512_bf16`` but no AMX) got float32 products at float32's speed under torch 2.13, so
    padding rows there would only cost time."""
    global _BF16_GEMM
    if _BF16_GEMM is None:
        _BF16_GEMM = torch.backends.mkldnn.is_available() and _medium_rounds_to_bf16()
    return _BF16_GEMM


def medium_products() -> str | None:
    """What :func:`bf16_products` gives on the CPU at ``medium``, from a process at any
    precision (for callers that do not set it, e.g. tests)."""
    if bf16_gemms_possible():
        return "onednn"
    return "cast" if bf16_casts_possible() else None


def bf16_casts_possible() -> bool:
    """Whether multiplying bfloat16 tensors is worth it here: oneDNN present and the CPU
    has bfloat16 dot-product instructions (there oneDNN multiplies bfloat16 tensors with
    them, e.g. ``brg_matmul:avx512_core_bf16``: 3.7x float32's rate on session 39's AMD
    EPYC; without them it would emulate bfloat16 and gain nothing)."""
    global _BF16_CAST
    if _BF16_CAST is None:
        _BF16_CAST = torch.backends.mkldnn.is_available() and cpu_multiplies_bf16()
    return _BF16_CAST


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bfloat16 multiply instructions (AVX512-BF16 or AMX), as Linux's
    /proc/cpuinfo lists them; False where that file is not there."""
    return bool(_cpu_info()[1] & {"amx_bf16", "avx512_bf16"})


@functools.cache
def _cpu_info() -> tuple[str, frozenset[str]]:
    """(vendor_id, flags) of the first CPU in Linux's /proc/cpuinfo; ("", {}) without it."""
    cpu = first_cpu()
    return cpu.get("vendor_id", ""), frozenset(cpu.get("flags", "").split())


#: the first AMD ``cpu family`` whose AVX-512 runs at full width (Zen 5), where ``--cpu-gemm
#: auto`` takes oneDNN (:func:`cpu_gemm_auto`)
ONEDNN_MIN_AMD_FAMILY = 26


@functools.cache
def _cpu_family() -> int | None:
    """The first CPU's ``cpu family`` in Linux's /proc/cpuinfo; None without it."""
    value = first_cpu().get("cpu family", "")
    return int(value) if value.isdigit() else None


def set_cpu_gemm(mode: str) -> None:
    """``--cpu-gemm`` for this process: which library multiplies the model's float32
    products on the CPU (:func:`float32_library`). ``onednn`` needs a torch built with it."""
    global _CPU_GEMM
    check_cpu_gemm(mode)
    if mode == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError("--cpu-gemm onednn: this torch build has no oneDNN "
                         "(torch.backends.mkldnn.is_available() is False); use auto or mkl")
    _CPU_GEMM = mode


def cpu_gemm_auto() -> bool:
    """Whether ``--cpu-gemm auto`` sends the float32 products to oneDNN on this CPU: an AMD
    CPU of ``cpu family`` 26 or later (Zen 5) with AVX-512 (``/proc/cpuinfo``'s vendor,
    family and flags) and a torch with oneDNN.

    torch multiplies float32 through MKL, which picks its kernels by vendor: on an AMD CPU
    its AVX2 ones, while oneDNN picks by instruction set and runs AVX-512 kernels. On
    session 50's AMD EPYC (Zen 5, 2 cores) the seed model's product shapes ran at 1.3-2.2x
    MKL's rate through oneDNN (forward products and input gradients; the weight gradients,
    by oneDNN's inner-product backward, 1.1-2.3x). Zen 4 (``cpu family`` 25) has AVX-512 but
    executes each 512-bit operation as two 256-bit halves, so its multiply-add rate is
    AVX2's: on session 59's Zen 4 (``model`` 17) MKL was ahead, the step alone 5-7 %
    shorter and worker mode 10-15 % faster (docs/benchmarks.md, "Issue 14, session 59").
    On Intel CPUs MKL already runs AVX-512. Decided from the CPU rather than by timing, so
    that every run on one machine multiplies the same way and repeats its losses to the
    bit."""
    global _ONEDNN_AUTO
    if _ONEDNN_AUTO is None:
        vendor, flags = _cpu_info()
        family = _cpu_family()
        _ONEDNN_AUTO = (vendor == "AuthenticAMD" and "avx512f" in flags
                        and family is not None and family >= ONEDNN_MIN_AMD_FAMILY
                        and torch.backends.mkldnn.is_available())
    return _ONEDNN_AUTO


def float32_library(device: torch.device) -> str | None:
    """Which library multiplies SAGEConv's and the typed layers' float32 products
    (:func:`linear_sum`) on ``device``: ``"onednn"`` (:class:`_LinearSumDnn`) or ``"mkl"``
    (torch's ``mm``, as DGL's pipeline multiplies); None off the CPU or where the products
    run in bfloat16 (:func:`bf16_products`). ``--cpu-gemm auto`` takes oneDNN where
    :func:`cpu_gemm_auto` says so."""
    if device.type != "cpu" or bf16_products(device) is not None:
        return None
    if _CPU_GEMM == "auto":
        return "onednn" if cpu_gemm_auto() else "mkl"
    return _CPU_GEMM


def cpu_gemm_summary(device: torch.device) -> dict:
    """``--cpu-gemm`` as it took effect on ``device``, for a run's summary: the mode, the
    library the float32 products went to (:func:`float32_library`), and how many of this
    process's products oneDNN computed."""
    return {"mode": _CPU_GEMM, "library": float32_library(device),
            "onednn_products_run": ONEDNN_PRODUCTS_RUN[0],
            "onednn_weight_grads_run": ONEDNN_WEIGHT_GRADS_RUN[0]}


def _medium_rounds_to_bf16() -> bool:
    """Whether a float32 product at precision ``medium`` comes out rounded to bfloat16:
    ``1 + 2**-10`` (exact in float32, 1.0 in bfloat16's 8 significand bits) times an
    identity, through ``addmm`` and ``mm`` (the model's products). The process's precision is
    restored afterwards."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        a = torch.full((64, 64), 1 + 2 ** -10)
        eye = torch.eye(64)
        with torch.no_grad():
            outs = (torch.addmm(torch.zeros(64), a, eye), torch.mm(a, eye))
        return any(bool((out != a).any()) for out in outs)
    finally:
        torch.set_float32_matmul_precision(before)


def mean_aggregate(block: Block, h_src: Tensor, rows: int | None = None) -> Tensor:
    """Mean of each destination's sampled in-neighbours' rows of ``h_src`` (0 if none);
    ``rows`` (>= num_dst) pads the result with zero rows."""
    num_dst = block.num_dst_nodes()
    rows = num_dst if rows is None else rows
    if block.num_edges() == 0:
        return h_src.new_zeros((rows, h_src.shape[1]))
    return _MeanAggregate.apply(h_src, block, False, rows)


def _leading_rows(h_src: Tensor, num_dst: int, rows: int) -> Tensor:
    """``h_src[:rows]`` (a view), or ``h_src[:num_dst]`` padded with zero rows where
    ``h_src`` has fewer than ``rows`` rows."""
    if h_src.shape[0] >= rows:
        return h_src[:rows]
    return F.pad(h_src[:num_dst], (0, 0, 0, rows - num_dst))


def mean_and_self(block: Block, h_src: Tensor, rows: int | None = None,
                  relu_dropout: float | None = None) -> tuple[Tensor, Tensor]:
    """``(mean_aggregate(block, h_src), h_src[:num_dst])`` with one gradient for ``h_src``
    (see :class:`_MeanAggregate`); a plain slice when ``h_src`` needs no gradient. ``rows``
    (>= num_dst) pads both to that many rows (:func:`gemm_rows`). ``relu_dropout`` (a drop
    probability, 0 for none): the previous layer's ReLU and training-mode dropout applied to
    ``h_src`` (in place) first; with a gradient, their backward is the mean's."""
    num_dst = block.num_dst_nodes()
    rows = num_dst if rows is None else rows
    if block.num_edges() == 0 or not (h_src.requires_grad and torch.is_grad_enabled()):
        if relu_dropout is not None:
            h_src = relu_dropout_(h_src, relu_dropout)
        return mean_aggregate(block, h_src, rows), _leading_rows(h_src, num_dst, rows)
    if relu_dropout is None:
        return _MeanAggregate.apply(h_src, block, True, rows)
    keep, scale = _keep_mask(h_src.shape, relu_dropout) if relu_dropout > 0 else (None, 1.0)
    agg, dst, _ = _MeanAggregate.apply(h_src, block, True, rows, True, keep, scale)
    return agg, dst


def mean_and_self_rows(block: Block, src: SourceRows, rows: int) -> tuple[Tensor, Tensor]:
    """:func:`mean_and_self` of rows not gathered yet (an input layer's, which need no
    gradient): the mean reads each edge's source row straight from the parts' matrices (a
    weighted ``embedding_bag`` over the block's CSC mapped to matrix rows, one per part), and
    only the destinations' rows are copied, for the self term. One part: the same sums in the
    same order as ``mean_and_self(block, src.gather(), rows)``; several: each destination's
    sum is its per-part sums added (float32 rounding only)."""
    num_dst = block.num_dst_nodes()
    dst = _leading_rows(src.gather(min(rows, src.shape[0])), num_dst, rows)
    if block.num_edges() == 0:
        return dst.new_zeros((rows, dst.shape[1])), dst
    idx, off, w = block.mean_bags(src.dtype)
    off = _pad_offsets(off, rows - num_dst)
    if src.num_parts == 1:
        agg = F.embedding_bag(src.ids.index_select(0, idx), src.matrix, off, mode="sum",
                              per_sample_weights=w, include_last_offset=True)
        return agg, dst
    agg = None
    for matrix, (rows_p, w_p, off_p) in zip(src.matrices, part_bags(idx, off, w, src)):
        if rows_p.numel() == 0:
            continue
        part_agg = F.embedding_bag(rows_p, matrix, off_p, mode="sum", per_sample_weights=w_p,
                                   include_last_offset=True)
        agg = part_agg if agg is None else agg.add_(part_agg)
    return agg, dst


def part_bags(idx: Tensor, off: Tensor, w: Tensor, src: SourceRows
              ) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The weighted bags ``(idx, off, w)`` over ``src``'s positions split by the part that
    owns each edge's source: per part, ``(rows in its matrix, weights, bag offsets)``, each
    bag's edges in the CSC's order (common/native.c ``mfg_split_bags``; torch's masks where
    the library is not loaded)."""
    part, local = src.owners()
    parts = src.num_parts
    lib = native.load() if idx.device.type == "cpu" and w.dtype == torch.float32 else None
    if lib is not None:
        idx, off, w = idx.contiguous(), off.contiguous(), w.contiguous()
        start = torch.empty(parts + 1, dtype=torch.int64)
        rows = torch.empty(idx.numel(), dtype=torch.int64)
        w_out = torch.empty(idx.numel(), dtype=torch.float32)
        offs = torch.empty((parts, off.numel()), dtype=torch.int64)
        got = lib.mfg_split_bags(off.data_ptr(), off.numel() - 1, idx.data_ptr(), idx.numel(),
                                 part.data_ptr(), local.data_ptr(), part.numel(), w.data_ptr(),
                                 parts, start.data_ptr(), rows.data_ptr(), w_out.data_ptr(),
                                 offs.data_ptr())
        if got == native.NO_MEMORY:
            raise MemoryError(f"part_bags: no memory for {parts} cursors")
        if got < 0:
            raise ValueError(f"part_bags: bags not rising from 0 to {idx.numel()} edges of "
                             f"sources in [0, {part.numel()}) owned by {parts} parts")
        b = start.tolist()
        return [(rows[b[p]:b[p + 1]], w_out[b[p]:b[p + 1]], offs[p]) for p in range(parts)]
    edge_part, edge_row = part.index_select(0, idx), local.index_select(0, idx)
    out = []
    for p in range(parts):
        mine = edge_part == p
        # part p's bags: its edges of each bag, whose bounds are the running count of its
        # edges at the bags' offsets
        ends = torch.zeros(mine.numel() + 1, dtype=off.dtype, device=off.device)
        torch.cumsum(mine, 0, out=ends[1:])
        at = mine.nonzero().squeeze(1)
        out.append((edge_row.index_select(0, at), w.index_select(0, at),
                    ends.index_select(0, off)))
    return out


def relu_dropout_(h: Tensor, p: float) -> Tensor:
    """ReLU (in place) on ``h``, then training-mode dropout with probability ``p`` (0: none)
    as :class:`Dropout` applies it."""
    h = F.relu(h, inplace=True)
    if p == 0:
        return h
    return _CpuDropout.apply(h, p) if cpu_mask_applies(h, p) else F.dropout(h, p, training=True)


def project_first(block: Block, in_feats: int, out_feats: int) -> bool:
    """Whether ``W mean(h)`` is cheaper as ``mean(h W)`` on this block (the same function).

    Projecting first multiplies every source row by ``W`` (``num_src * in * out``
    multiply-adds) and then aggregates ``out`` columns along the edges; aggregating first moves
    ``in`` columns along the edges and multiplies only the destination rows. Project first iff
    ``(num_src - num_dst) * in * out < num_edges * (in - out)``. DGL's SAGEConv decides by
    ``in > out`` alone, which on a sampled block (several times more sources than
    destinations) projects thousands of rows whose projection only feeds a mean: the seed
    model's last layer (256 -> 47, 4-6k sources for 1,024 seeds) then costs 2.5x the
    multiply-adds of aggregating first.
    """
    extra_rows = block.num_src_nodes() - block.num_dst_nodes()
    return extra_rows * in_feats * out_feats < block.num_edges() * (in_feats - out_feats)


class _LinearSum(torch.autograd.Function):
    """``bias + sum_i x_i W_i^T`` into one output: ``apply(bias, x_1, W_1, x_2, W_2, ...)``
    (``bias`` may be None). SAGEConv's ``h_dst W_self^T + bias + h_neigh W_neigh^T`` is the
    two-term case; a typed layer's destination state (its self loop plus one term per
    relation into its type, trainer_client/hetero_model.py) the n-term one. The terms after
    the first are accumulated in place (``addmm_``: no further ``[rows, out]`` tensors).

    Its backward computes each weight gradient as ``(x^T grad)^T``. Autograd's ``addmm``
    backward computes ``grad^T x`` for a weight used as ``W.t()``; with ``rows`` in the tens
    of thousands and ``in`` 100 (the input layer) that GEMM runs at 120-130 GFLOP/s on this
    2-core machine, and this form at 137-150 (docs/benchmarks.md, "Issue 14, session 23"):
    4-5 % of the seed model's step. The same products, so the same gradients.
    """

    @staticmethod
    def forward(ctx, bias: Tensor | None, *xw: Tensor) -> Tensor:
        ctx.save_for_backward(*xw)
        ctx.has_bias = bias is not None
        out = (torch.mm(xw[0], xw[1].t()) if bias is None
               else torch.addmm(bias, xw[0], xw[1].t()))
        for i in range(2, len(xw), 2):
            out.addmm_(xw[i], xw[i + 1].t())
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        """The bias's gradient, then per term ``grad W`` and the weight's ``(x^T grad)^T``."""
        xw, need = ctx.saved_tensors, ctx.needs_input_grad
        grad = grad.contiguous()
        got: list[Tensor | None] = [grad.sum(0) if ctx.has_bias and need[0] else None]
        for i in range(0, len(xw), 2):
            x, w = xw[i], xw[i + 1]
            got.append(grad.mm(w) if need[1 + i] else None)
            got.append(x.t().mm(grad).t().contiguous() if need[2 + i] else None)
        return tuple(got)


def _dnn_weight_grad(grad_dnn: Tensor, x: Tensor, w: Tensor, with_bias: bool
                     ) -> tuple[Tensor, Tensor]:
    """oneDNN's inner-product backward for a weight (and the bias): ``(grad^T x, grad summed
    over rows)``, ``grad_dnn`` in oneDNN's tensor type (``to_mkldnn``), ``x`` dense."""
    return torch.ops.aten.mkldnn_linear_backward_weights(grad_dnn, x.to_mkldnn(), w,
                                                          with_bias)


def _dnn_mm(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ w.T (+ bias)`` by oneDNN (``torch.ops.mkldnn._linear_pointwise``, its matmul
    kernels for the CPU's widest vectors); ``x``, ``w``: float32 matrices."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


class _LinearSumDnn(torch.autograd.Function):
    """:class:`_LinearSum` with oneDNN's float32 kernels (``--cpu-gemm``,
    :func:`float32_library`): the forward's products and the inputs' gradients ``grad W``
    (``W`` read in place as the transposed right operand) run through oneDNN. Each term
    after the first is its own product added in place: oneDNN's fused ``add`` post-op was
    slower than that on session 50's AMD EPYC (14.0 against 11.7 ms for two 25,500 x 100 x
    256 terms; 31.2 against 20.9 at 50,000 rows). The weights' gradients ``grad^T x`` (and
    the bias's, with the first of them) come from oneDNN's inner-product backward
    (``aten::mkldnn_linear_backward_weights``), given ``grad`` and each ``x`` copied into
    oneDNN's tensor type. A product through ``_linear_pointwise`` would need ``grad^T`` or
    ``x^T`` contiguous, and torch's transposing copy of a 25,600 x 256 gradient took 7-10 ms
    (session 51, two terms, 2 threads): 25.3 against MKL's 21.8 ms. The inner-product
    backward took 17.3 against 22.2 at 25,600 x 100 x 256, 4.5 against 10.4 at 4,352 x 256
    x 256, copies included. Float32 products either way: the same function and gradients up
    to the order of float32 sums."""

    @staticmethod
    def forward(ctx, bias: Tensor | None, *xw: Tensor) -> Tensor:
        ctx.save_for_backward(*xw)
        ctx.has_bias = bias is not None
        out = _dnn_mm(xw[0].contiguous(), xw[1], bias)
        for i in range(2, len(xw), 2):
            out += _dnn_mm(xw[i].contiguous(), xw[i + 1])
        ONEDNN_PRODUCTS_RUN[0] += len(xw) // 2
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        xw, need = ctx.saved_tensors, ctx.needs_input_grad
        grad = grad.contiguous()
        got: list[Tensor | None] = [None]
        # the weights' gradients grad^T x by oneDNN's inner-product backward (its operands
        # in oneDNN's tensor type: one copy of grad for every term, one of each x)
        grad_dnn = grad.to_mkldnn() if any(need[2::2]) else None
        bias_grad = None
        for i in range(0, len(xw), 2):
            x, w = xw[i], xw[i + 1]
            got.append(_dnn_mm(grad, w.t()) if need[1 + i] else None)
            if not need[2 + i]:
                got.append(None)
                continue
            with_bias = ctx.has_bias and need[0] and bias_grad is None
            dw, db = _dnn_weight_grad(grad_dnn, x, w, with_bias)
            got.append(dw)
            if with_bias:
                bias_grad = db
        if ctx.has_bias and need[0]:
            got[0] = bias_grad if bias_grad is not None else grad.sum(0)
        ONEDNN_WEIGHT_GRADS_RUN[0] += sum(need[2::2])
        return tuple(got)


class _LinearSumNarrow(torch.autograd.Function):
    """:class:`_LinearSum` for narrow terms (:func:`narrow_terms`: each ``in`` at most a
    quarter of ``out``, as the input layer of a graph with 8-dim features, ogbn-proteins'):
    the ``x_i`` side by side in one ``[rows, sum in_i + 1]`` buffer whose last column is ones,
    the weights and the bias side by side in one ``[out, sum in_i + 1]``.

    With ``in`` that small a product is bound by writing its ``[rows, out]`` output, not by
    its multiply-adds. Term by term, the output is written by the first product, read and
    written again by each further one and by the bias; the gradient is read once per weight
    and once more for the bias's sum. Packed, the forward writes the output once and the
    backward reads the gradient once for every weight's gradient and the bias's (its last
    column, ``grad^T 1``). The same products, so the same function and gradients (summed in
    another order). On this 2-core machine, forward and weight gradients of 36,845 rows into
    256: ``in`` 8 0.66x the time term by term, 16 0.72x, 32 0.79x, 64 0.92x; at 100 (the
    products and RMAT graphs' input layer) 1.06x, hence the quarter
    (docs/benchmarks.md, "Issue 14, session 42")."""

    @staticmethod
    def forward(ctx, bias: Tensor | None, *xw: Tensor) -> Tensor:
        xs, ws = xw[0::2], xw[1::2]
        widths = [x.shape[1] for x in xs]
        x = torch.empty((xs[0].shape[0], sum(widths) + (bias is not None)),
                        dtype=xs[0].dtype, device=xs[0].device)
        at = 0
        for xi, k in zip(xs, widths):
            x[:, at:at + k] = xi
            at += k
        if bias is not None:
            x[:, at] = 1.0
        w = torch.cat([*ws, bias.unsqueeze(1)] if bias is not None else ws, 1)
        ctx.save_for_backward(x, w)
        ctx.widths, ctx.has_bias = widths, bias is not None
        return torch.mm(x, w.t())

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        need, has_bias = ctx.needs_input_grad, ctx.has_bias
        grad = grad.contiguous()
        gx = grad.mm(w) if any(need[1::2]) else None  # [rows, sum in_i (+ 1)]
        gw = (x.t().mm(grad).t() if any(need[2::2]) or (has_bias and need[0])
              else None)  # [out, sum in_i (+ 1)]
        got: list[Tensor | None] = [gw[:, -1].contiguous()  # type: ignore[index]
                                    if has_bias and need[0] else None]
        at = 0
        for i, k in enumerate(ctx.widths):
            got.append(gx[:, at:at + k] if need[1 + 2 * i] else None)  # type: ignore[index]
            got.append(gw[:, at:at + k].contiguous() if need[2 + 2 * i] else None)  # type: ignore[index]
            at += k
        return tuple(got)


def narrow_terms(terms: list[tuple[Tensor, Tensor]]) -> bool:
    """Whether :func:`linear_sum` packs ``terms`` (``(x, W)``, ``W``: ``[out, in]``) into one
    product at float32 (:class:`_LinearSumNarrow`): on the CPU, where it was measured,
    when every term's ``in`` is at most a quarter of its ``out``."""
    return (terms[0][0].device.type == "cpu"
            and all(x.shape[1] * 4 <= w.shape[0] for x, w in terms))


class _LinearSumPacked(torch.autograd.Function):
    """:class:`_LinearSum` with the ``x_i`` side by side in one ``[padded, sum in_i]`` buffer
    of ``dtype`` and the weights in one ``[out, sum in_i]``: the forward is one GEMM and so
    is the weights' gradient. ``apply(bias, padded, dtype, x_1, W_1, ...)``; rows past the
    ``x_i``'s (up to ``padded``, :func:`gemm_rows`'s bucket) are zeros going forward and back,
    so they change nothing, and the output has the ``x_i``'s rows.

    For ``--matmul-precision medium``. With ``dtype`` bfloat16 (the ``"cast"`` route of
    :func:`bf16_products`, where torch's ``medium`` computes float32): filling the buffer
    rounds the operands, oneDNN sums in float32, each product's output is rounded to
    bfloat16 and widened back to float32, so activations, the mean, the loss and the
    gradients handed on stay float32; products are off by about 4e-3 of their size (torch's
    ``medium``: 3e-3), and the buffer saved for the backward is half the float32 inputs'
    size. With ``dtype`` float32 (the ``"onednn"`` route), torch's ``medium`` rounds inside
    the product; the buffer then only gives a typed layer's unpadded rows a bucketed shape.
    :func:`linear_sum` uses it for SAGEConv's and the typed layers' sums, :func:`project`
    (one term, bfloat16) for GCN's and GAT's projections."""

    @staticmethod
    def forward(ctx, bias: Tensor | None, padded: int, dtype: torch.dtype,
                *xw: Tensor) -> Tensor:
        xs, ws = xw[0::2], xw[1::2]
        rows, widths = xs[0].shape[0], [x.shape[1] for x in xs]
        x = torch.empty((padded, sum(widths)), dtype=dtype, device=xs[0].device)
        at = 0
        for xi, k in zip(xs, widths):
            x[:rows, at:at + k] = xi
            at += k
        x[rows:] = 0
        w = torch.cat(ws, 1).to(dtype)
        out = torch.mm(x, w.t())
        # a tensor of its own (a view of the product would forbid the in-place ReLU after)
        if dtype != torch.float32:
            out = out[:rows].float()
        elif padded != rows:
            out = out[:rows].clone()
        if bias is not None:
            out += bias
        ctx.save_for_backward(x, w)
        ctx.widths, ctx.rows, ctx.has_bias = widths, rows, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        need, rows = ctx.needs_input_grad, ctx.rows
        g = torch.empty((x.shape[0], grad.shape[1]), dtype=x.dtype, device=grad.device)
        g[:rows] = grad
        g[rows:] = 0
        gx = g.mm(w)[:rows] if any(need[3::2]) else None  # [rows, sum in_i]
        gw = x.t().mm(g).t().float() if any(need[4::2]) else None  # [out, sum in_i]
        got: list[Tensor | None] = [grad.sum(0) if ctx.has_bias and need[0] else None,
                                    None, None]
        at = 0
        for i, k in enumerate(ctx.widths):
            got.append(gx[:, at:at + k].float() if need[3 + 2 * i] else None)  # type: ignore[index]
            got.append(gw[:, at:at + k].contiguous() if need[4 + 2 * i] else None)  # type: ignore[index]
            at += k
        return tuple(got)


#: how many of this process's model products took each bfloat16 route (``"cast"``,
#: ``"onednn"``) through :func:`linear_sum` and :func:`project`, every model's layers
#: (GraphSAGE, GCN, GAT, rsage, hetero-sage): the trainer's summary reports it as
#: ``bf16_products_run``, what a model did rather than what the device offers
#: (``bf16_products``)
PRODUCTS_RUN: dict[str, int] = {}


def _count(route: str) -> None:
    PRODUCTS_RUN[route] = PRODUCTS_RUN.get(route, 0) + 1


def linear_sum(bias: Tensor | None, terms: list[tuple[Tensor, Tensor]]) -> Tensor:
    """``bias + sum x W^T`` over ``terms`` (``(x, W)``, ``W``: ``[out, in]`` as in
    nn.Linear; every ``x`` with the same rows). At float32 narrow terms
    (:func:`narrow_terms`) are packed into one product (:class:`_LinearSumNarrow`), other
    terms go through :class:`_LinearSum`. Where the products run in bfloat16
    (:func:`bf16_products`), rows are bucketed (:func:`gemm_rows`; SAGEConv's come
    bucketed already) and the terms packed (:class:`_LinearSumPacked`): on the ``"cast"``
    route always, in bfloat16; on the ``"onednn"`` route in float32 where rows need a
    bucket (a typed layer's), else as at float32, by :class:`_LinearSum`."""
    x0 = terms[0][0]
    route = bf16_products(x0.device)
    flat = [t for term in terms for t in term]
    if route is None:
        if narrow_terms(terms):
            return _LinearSumNarrow.apply(bias, *flat)
        if (x0.dtype == torch.float32 and x0.shape[0] > 0
                and float32_library(x0.device) == "onednn"):
            return _LinearSumDnn.apply(bias, *flat)
        return _LinearSum.apply(bias, *flat)
    _count(route)
    rows = x0.shape[0]
    padded = gemm_rows(rows, x0.device)
    if route == "cast":
        return _LinearSumPacked.apply(bias, padded, torch.bfloat16, *flat)
    if padded != rows:
        return _LinearSumPacked.apply(bias, padded, torch.float32, *flat)
    return _LinearSum.apply(bias, *flat)


def project(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` (``w``: ``[in, out]``) for a model's projection, by the route
    :func:`bf16_products` gives ``x``'s device: float32 (the default), torch's ``medium``
    with the rows bucketed (``"onednn"``), or bfloat16 operands with the rows bucketed
    (``"cast"``: :class:`_LinearSumPacked`'s one-term case, bfloat16 operands). Always
    ``[rows of x, out]``, float32."""
    route = bf16_products(x.device)
    if route is None:
        return x @ w
    _count(route)
    rows = x.shape[0]
    padded = gemm_rows(rows, x.device)
    if route == "cast":
        return _LinearSumPacked.apply(None, padded, torch.bfloat16, x, w.t())
    return (_leading_rows(x, rows, padded) @ w)[:rows]


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

    def forward(self, block: Block, h_src: Tensor,
                relu_dropout: float | None = None) -> Tensor:
        """``[rows, out]``: the block's destinations first; ``rows`` is ``num_dst`` or
        :func:`gemm_rows`'s bucket (the rows after ``num_dst`` are read by no one, and their
        gradients are zeros: the layer above pads its gradient with empty bags and the
        model's output is sliced to the seeds, see :meth:`GraphSAGE.forward`).
        ``relu_dropout``: the previous layer's activation, applied to ``h_src`` (in place)
        first: ReLU, then training-mode dropout with that probability (0: none).
        ``h_src`` may be :class:`~common.mfg.SourceRows` (an input layer's rows read from the
        partition's feature matrix): the mean then reads them in place
        (:func:`mean_and_self_rows`)."""
        num_dst = block.num_dst_nodes()
        rows = gemm_rows(num_dst, h_src.device)
        if isinstance(h_src, SourceRows):
            if relu_dropout is None and not project_first(block, self.in_feats,
                                                          self.out_feats):
                h_neigh, h_dst = mean_and_self_rows(block, h_src, rows)
                return linear_sum(self.fc_self.bias, [(h_dst, self.fc_self.weight),
                                                      (h_neigh, self.fc_neigh.weight)])
            h_src = h_src.gather()
        if project_first(block, self.in_feats, self.out_feats):
            if relu_dropout is not None:
                h_src = relu_dropout_(h_src, relu_dropout)
            h_neigh = mean_aggregate(block, self.fc_neigh(h_src), rows)
            return self.fc_self(_leading_rows(h_src, num_dst, rows)) + h_neigh
        h_neigh, h_dst = mean_and_self(block, h_src, rows, relu_dropout)
        return linear_sum(self.fc_self.bias, [(h_dst, self.fc_self.weight),
                                              (h_neigh, self.fc_neigh.weight)])


_BITS = 15  # random bits per element of a CPU dropout mask


@functools.cache
def _byte_table(bits: int, cut: int) -> Tensor:
    """[256] integers of ``8 // bits`` bytes: byte j of entry k is 1 where k's j-th
    ``bits``-bit field is >= ``cut`` (kept), else 0: looked up by a random byte, the entry
    viewed as bools is the keep mask of ``8 // bits`` elements."""
    per = 8 // bits
    k = torch.arange(256, dtype=torch.int64)
    table = torch.zeros(256, dtype=torch.int64)
    for j in range(per):
        table |= (((k >> (j * bits)) & ((1 << bits) - 1)) >= cut).long() << (8 * j)
    return table.to({8: torch.int64, 4: torch.int32, 2: torch.int16}[per])


def _keep_mask(shape: torch.Size, p: float) -> tuple[Tensor, float]:
    """(True where kept, scale of the kept) from bulk random bits (see _CpuDropout).

    Where ``p`` is a multiple of 2**-b for b = 1, 2 or 4 (0.5, 0.25, 0.75, ...: exact), each
    element takes b random bits, unpacked by a 256-entry table lookup per random byte:
    one 64-bit draw serves 56 elements at p = 0.5 (7 of its bytes; torch's ``random_``
    leaves an int64's top bit 0), and a 25,068 x 256 mask took 3.1 ms against 8.1 with 15
    bits an element (docs/benchmarks.md, "Issue 14, session 45"). Otherwise 15 bits an
    element, with ``p`` rounded to a multiple of 2**-15."""
    n = shape.numel()
    for bits in (1, 2, 4):
        cut = p * (1 << bits)
        if cut != int(cut):
            continue
        cut, per = int(cut), 8 // bits
        table = _byte_table(bits, cut)
        words = torch.empty(-(-n // (7 * per)), dtype=torch.int64).random_()
        drawn = words.view(torch.uint8).view(-1, 8)[:, :7]  # the 7 bytes of 63 random bits
        keep = table[drawn.long()].view(torch.bool).view(-1)[:n].view(shape)
        return keep, (1 << bits) / ((1 << bits) - cut)
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_()
    r = words.view(torch.int16)[:n].view(shape) & ((1 << _BITS) - 1)
    cut = round(p * (1 << _BITS))
    return r >= cut, (1 << _BITS) / ((1 << _BITS) - cut)


def _times_mask(x: Tensor, keep: Tensor, scale: float) -> Tensor:
    """``x * keep * scale`` into a new tensor (``keep``: bool, as 0/1 bytes)."""
    return torch.mul(x, keep.view(torch.uint8)).mul_(scale)


class _CpuDropout(torch.autograd.Function):
    """Dropout whose mask comes from bulk random bits (:func:`_keep_mask`):
    ``torch.bernoulli_`` draws one Mersenne-Twister number per element and takes ~0.26 s for a
    50,000 x 256 activation on 2 cores; 64-bit draws cut into 15-bit uniforms take ~0.03 s,
    and 1, 2 or 4 bits an element where p allows it less. The drop probability is rounded to
    a multiple of 2**-15 (exact for 0.5) and kept rows are scaled by 1 / (1 - that).

    The mask is applied as a product with its bytes, as ``nn.Dropout`` applies its own (a
    dropped NaN or infinity becomes NaN there too): ``masked_fill`` with a bool mask took
    12.2 ms for a 25,600 x 256 activation on 2 cores here, the product 1.9
    (docs/benchmarks.md, "Issue 14, session 45")."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        keep, scale = _keep_mask(x.shape, p)
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _times_mask(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return _times_mask(grad, keep, ctx.scale), None


def cpu_mask_applies(x: Tensor, p: float) -> bool:
    """Whether training-mode dropout with probability ``p`` on ``x`` draws its mask by
    :func:`_keep_mask` (:class:`_CpuDropout`); elsewhere (CUDA, p 0 or >= 1) it is
    ``F.dropout``'s."""
    return 0 < p < 1 and x.device.type == "cpu"


class Dropout(nn.Dropout):
    """``nn.Dropout`` with a faster mask on CPU (see :class:`_CpuDropout`); CUDA and eval
    mode behave exactly like ``nn.Dropout``."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training and cpu_mask_applies(x, self.p):
            return _CpuDropout.apply(x, self.p)
        return super().forward(x)


class LayerwiseGNN(nn.Module):
    """Layers with ReLU + dropout between them, run one layer at a time.

    ``forward_layer(i, block, h)`` is layer i and the ReLU + dropout after it (none after the
    last): layer-wise full-neighbour inference calls it per layer over all nodes, training
    calls :meth:`forward`, which loops over it, so both compute the same function.
    Subclasses whose layer output is not ``[num_dst, features]`` override :meth:`conv`.
    """

    #: ReLU in place on the layer's output: only for layers whose last op's backward does not
    #: need its output (SAGEConv's addmm_ / add); saves a full-size tensor per layer
    inplace_relu = False

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
        if i == len(self.layers) - 1:
            return h
        return self.dropout(F.relu(h, inplace=self.inplace_relu))

    def _check_blocks(self, blocks) -> None:
        if len(blocks) != len(self.layers):
            raise ValueError(f"{type(self).__name__} has {len(self.layers)} layers but got "
                             f"{len(blocks)} blocks: sample one block per layer (as many "
                             "fanouts as layers)")

    def forward(self, blocks, x: Tensor) -> Tensor:
        self._check_blocks(blocks)
        h = x
        for i, block in enumerate(blocks):
            h = self.forward_layer(i, block, h)
        return h


def layer_dims(in_feats: int, hidden: int, num_classes: int, num_layers: int) -> list[int]:
    """Input width, then each layer's output width: ``[in, hidden, ..., num_classes]``."""
    return [in_feats] + [hidden] * (num_layers - 1) + [num_classes]


class GraphSAGE(LayerwiseGNN):
    """Layers of mean-SAGEConv with ReLU and dropout between them (the seed tutorial's model)."""

    inplace_relu = True
    #: forward's ``x`` may be :class:`~common.mfg.SourceRows` (SAGEConv reads them in its mean)
    takes_source_rows = True

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int,
                 dropout: float = 0.5):
        dims = layer_dims(in_feats, hidden, num_classes, num_layers)
        super().__init__([SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:])], dropout)

    # A SAGEConv's output may have rows after num_dst (gemm_rows): the layers pass them on
    # (the next layer reads none of them, and their gradients are zeros); what leaves the
    # model is sliced to the destinations.

    def forward_layer(self, i: int, block: Block, h: Tensor) -> Tensor:
        return super().forward_layer(i, block, h)[: block.num_dst_nodes()]

    def forward(self, blocks, x: Tensor) -> Tensor:
        self._check_blocks(blocks)
        h = x
        d = self.dropout
        p = d.p if d.training else 0.0
        if p > 0 and not cpu_mask_applies(x, p):  # nn.Dropout's own mask, after each layer
            for i, block in enumerate(blocks):
                h = LayerwiseGNN.forward_layer(self, i, block, h)
        else:
            # each ReLU (and CPU dropout) is applied by the next layer's mean: one backward
            # pass for the three (see _MeanAggregate), the same function as forward_layer's
            for i, block in enumerate(blocks):
                h = self.layers[i](block, h, p if i > 0 else None)
        return h[: blocks[-1].num_dst_nodes()]
