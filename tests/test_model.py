"""The plain-torch SAGE layer equals dgl.nn.SAGEConv on the same block; MFG helpers."""

from __future__ import annotations

import pytest
import torch

from common.dgl_compat import import_dgl
from common.mfg import MFG, NID, Block, to_device
from common.sampled_mfg import Features, Layer, SampledMFG
from trainer_client.loader import hidden_share
from trainer_client.model import GraphSAGE, SAGEConv, gemm_rows

pytestmark = pytest.mark.timeout(60)


def random_block(num_src: int, num_dst: int, max_deg: int, seed: int) -> Block:
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, max_deg + 1, (num_dst,), generator=g)
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    torch.cumsum(deg, 0, out=indptr[1:])
    indices = torch.randint(0, max(num_src, 1), (int(deg.sum()),), generator=g)  # 0: no edges
    return Block(indptr, indices, num_src, num_dst)


@pytest.mark.parametrize("in_feats,out_feats", [(16, 8), (8, 16), (12, 12)])
def test_sageconv_equals_dgl(in_feats, out_feats):
    dgl = import_dgl()
    from dgl.nn import SAGEConv as DGLSAGEConv

    block = random_block(50, 20, 6, seed=in_feats * out_feats)
    assert (block.in_degrees() == 0).any(), "want a destination without neighbours"
    x = torch.randn(50, in_feats)
    ours = SAGEConv(in_feats, out_feats)
    ref = DGLSAGEConv(in_feats, out_feats, "mean")
    with torch.no_grad():
        ref.fc_self.weight.copy_(ours.fc_self.weight)
        ref.fc_neigh.weight.copy_(ours.fc_neigh.weight)
        ours.fc_self.bias.copy_(torch.randn(out_feats))
        ref.fc_self.bias.copy_(ours.fc_self.bias)
    out = ours(block, x)  # [rows, out]: rows past num_dst where gemm_rows buckets
    assert out.shape[0] == gemm_rows(20, x.device) and out.shape[1] == out_feats
    got = out[: block.num_dst_nodes()]
    want = ref(block.to_dgl(), (x, x[: block.num_dst_nodes()]))
    assert got.shape == (20, out_feats)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert isinstance(dgl.NID, str) and dgl.NID == NID


@pytest.mark.parametrize("in_feats,out_feats,num_src,first", [
    (16, 8, 50, False), (16, 8, 20, True), (8, 16, 50, False), (8, 16, 20, False),
    (12, 12, 50, False), (4, 16, 50, False), (3, 12, 20, False)])
def test_sageconv_gradients_equal_dgl(in_feats, out_feats, num_src, first):
    """The gradients w.r.t. the input (one fused gradient for the self term and the
    neighbour mean, see model._MeanAggregate) and every parameter equal dgl.nn.SAGEConv's,
    with destinations without in-edges and sources without out-edges, in both association
    orders (``first``: model.project_first picks projecting before the mean; with as many
    sources as destinations it does whenever in > out, as DGL does), and with narrow inputs
    (in <= out / 4: the two terms and the bias in one product, model._LinearSumNarrow)."""
    import_dgl()
    from dgl.nn import SAGEConv as DGLSAGEConv

    from trainer_client.model import project_first

    block = random_block(num_src, 20, 6, seed=in_feats + 2 * out_feats)
    assert project_first(block, in_feats, out_feats) is first
    assert (block.in_degrees() == 0).any()
    assert (torch.bincount(block.indices, minlength=num_src) == 0).any()
    ours = SAGEConv(in_feats, out_feats)
    ref = DGLSAGEConv(in_feats, out_feats, "mean")
    with torch.no_grad():
        ours.fc_self.bias.copy_(torch.randn(out_feats))
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(num_src, in_feats, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    got = ours(block, x)[: block.num_dst_nodes()]  # rows past num_dst where gemm_rows buckets
    want = ref(block.to_dgl(), (x_ref, x_ref[: block.num_dst_nodes()]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(got)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("library", ["mkl", "onednn"])
@pytest.mark.parametrize("dropout,in_feats", [(0.0, 10), (0.5, 10), (0.0, 4)])
def test_graphsage_model_equals_the_dgl_seed_model(monkeypatch, dropout, in_feats, library):
    """The whole 3-layer model (in-place ReLU, fused self term) against the benchmark's DGL
    seed model with the same weights: same logits and parameter gradients (dropout off by
    eval mode for the forward check; with dropout the training step must still run). With 4
    input features the input layer's terms are narrow (model._LinearSumNarrow). With either
    ``--cpu-gemm`` library on any CPU: torch's mm, or oneDNN with bucketed rows
    (model._LinearSumDnn)."""
    from benchmarks.dgl_pipeline import DGLGraphSAGE
    from trainer_client import model as model_mod

    monkeypatch.setattr(model_mod, "_CPU_GEMM", library)
    import_dgl()
    sizes = [80, 30, 12, 5]
    blocks = [random_block(s, d, 6, seed=40 + i)
              for i, (s, d) in enumerate(zip(sizes[:-1], sizes[1:]))]
    ours = GraphSAGE(in_feats, 16, 4, 3, dropout)
    ref = DGLGraphSAGE(in_feats, 16, 4, 3, dropout)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(80, in_feats)
    ours.eval()
    ref.eval()
    got = ours(blocks, x)
    want = ref([b.to_dgl() for b in blocks], x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-4, atol=1e-5,
                                   msg=name)
    ours.train()
    ours(blocks, x).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())


def test_mfg_of_sampled_prefix_ids_and_to_dgl():
    input_nodes = torch.tensor([7, 3, 9, 1, 4])
    b0 = random_block(5, 3, 2, seed=1)
    b1 = random_block(3, 2, 2, seed=2)
    feat, label = torch.randn(5, 4), torch.tensor([1, 0])
    sampled = SampledMFG.homogeneous(
        input_nodes, [Layer.homogeneous(5, 3, b0.indptr, b0.indices),
                      Layer.homogeneous(3, 2, b1.indptr, b1.indices)],
        Features.frames(feat), label)
    sampled.check()
    mfg = MFG.of(sampled)
    assert len(mfg) == 2
    # a view: the blocks share the sampled tensors (no copy)
    assert mfg[0].indptr is b0.indptr and mfg[0].srcdata["feat"] is feat
    assert mfg[-1].dstdata["label"] is label and mfg.input_nodes is input_nodes
    assert mfg[1].srcdata[NID].tolist() == mfg[0].dstdata[NID].tolist() == [7, 3, 9]
    assert mfg.output_nodes.tolist() == [7, 3]
    blocks = mfg.to_dgl()
    assert blocks[0].num_src_nodes() == 5 and blocks[0].num_dst_nodes() == 3
    assert blocks[1].dstdata[NID].tolist() == [7, 3]
    src, dst = blocks[0].edges(order="srcdst")
    ours = sorted(zip(b0.edges()[0].tolist(), b0.edges()[1].tolist()))
    assert sorted(zip(src.tolist(), dst.tolist())) == ours
    moved = mfg.to("cpu", non_blocking=True)
    assert moved[0].num_edges() == mfg[0].num_edges()


def _copies(monkeypatch, pinned: set[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Record every ``Tensor.to`` call (the source; a clone stands for the copy) and every
    ``pin_memory`` call (its source; a clone stands for the page-locked copy, and answers
    True to ``is_pinned`` like the tensors whose id is in ``pinned``)."""
    calls: list[torch.Tensor] = []
    staged: list[torch.Tensor] = []
    pinned = set(pinned)

    def pin(t):
        staged.append(t)
        out = t.clone()
        pinned.add(id(out))
        return out

    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: calls.append(t) or t.clone())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: id(t) in pinned)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return calls, staged


def _tensors(mfg) -> list[torch.Tensor]:
    out = [mfg.input_nodes, mfg.output_nodes]
    for b in mfg:
        out += [b.indptr, b.indices, *b.srcdata.values(), *b.dstdata.values()]
    return out


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_to_device_stages_pageable_sources_and_copies_each_id_prefix_once(monkeypatch, device):
    input_nodes = torch.tensor([7, 3, 9, 1, 4])
    b0 = random_block(5, 3, 2, seed=1)
    b1 = random_block(3, 2, 2, seed=2)
    feat, label = torch.randn(5, 4), torch.tensor([1, 0])
    mfg = MFG.of(SampledMFG.homogeneous(
        input_nodes, [Layer.homogeneous(5, 3, b0.indptr, b0.indices),
                      Layer.homogeneous(3, 2, b1.indptr, b1.indices)],
        Features.frames(feat), label))
    calls, staged = _copies(monkeypatch, pinned={id(feat)})
    moved = to_device(mfg, device)
    # the ids and their per-block slices ids[:n] and the output nodes (a prefix too) one
    # copy; every other tensor once
    assert len(calls) == 1 + 4 + 1 + 1  # ids, two CSCs, label, feat
    if device == "cuda":
        # every copy from page-locked memory (no copy waits): each pageable source staged
        # once, the features (page-locked in a ring slot) as they are
        assert all(t.is_pinned() for t in calls)
        assert len(staged) == 6 and not any(t is feat for t in staged)
        assert sum(t.data_ptr() == input_nodes.data_ptr() for t in staged) == 1
    else:
        assert not staged  # nothing to wait for on the CPU
        assert sum(t.data_ptr() == input_nodes.data_ptr() for t in calls) == 1
    for got, want in zip(_tensors(moved), _tensors(mfg), strict=True):
        assert torch.equal(got, want) and got is not want
    assert moved[1].srcdata[NID].data_ptr() == moved.input_nodes.data_ptr()  # a device slice
    assert moved[0].num_src_nodes() == 5 and moved[1].num_dst_nodes() == 2


def test_hidden_share_counts_issue_and_wait_against_copy_time():
    assert hidden_share(0.0, 0.0, 0.0) is None  # no copies (CPU)
    assert hidden_share(0.0, 0.0, 2.0) == 1.0
    assert hidden_share(0.1, 0.1, 1.0) == pytest.approx(0.8)
    # a pageable copy queued behind the features holds the host for all of it: none hidden
    assert hidden_share(0.918, 0.002, 0.908) == 0.0


def test_graphsage_shapes():
    b0 = random_block(40, 12, 5, seed=4)
    b1 = random_block(12, 4, 5, seed=5)
    model = GraphSAGE(8, 16, 3, num_layers=2, dropout=0.5)
    out = model([b0, b1], torch.randn(40, 8))
    assert out.shape == (4, 3)


def test_cpu_dropout_drops_with_probability_p_and_scales():
    """The fast CPU dropout: P(drop) = p (within sampling error), kept values scaled by
    1/(1-p), the same mask in backward, identity in eval mode; for p a multiple of 1/2, 1/4
    or 1/16 (1, 2 or 4 random bits an element) and for others (15 bits)."""
    from trainer_client.model import Dropout

    torch.manual_seed(0)
    x = torch.randn(400, 500, requires_grad=True)
    for p in (0.1, 0.5, 0.8, 0.25, 0.75, 0.0625):
        drop = Dropout(p)
        y = drop(x)
        dropped = y == 0
        frac = dropped.float().mean().item()
        assert abs(frac - p) < 0.01, (p, frac)
        torch.testing.assert_close(y[~dropped], x[~dropped] / (1 - p), rtol=1e-3, atol=1e-6)
        (g,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(g, (~dropped).float() / (1 - p), rtol=1e-3, atol=1e-6)
        drop.eval()
        assert torch.equal(drop(x), x)
    # masks differ between calls and follow torch's seed
    d = Dropout(0.5)
    torch.manual_seed(1)
    a = d(x)
    b = d(x)
    torch.manual_seed(1)
    assert not torch.equal(a == 0, b == 0) and torch.equal(d(x) == 0, a == 0)


def test_dropout_byte_tables_unpack_each_field_of_a_random_byte():
    """The table behind the few-bit masks: entry k viewed as bools is, for each ``bits``-bit
    field of k from the lowest, whether it is >= cut; the masks' elements of one random word
    are independent fair draws (no bit of an int64 that torch's random_ leaves 0 is used)."""
    from trainer_client.model import _byte_table, _keep_mask

    for bits, cut in ((1, 1), (2, 1), (2, 3), (4, 5)):
        per = 8 // bits
        got = _byte_table(bits, cut).view(torch.bool).view(256, per)
        want = torch.tensor([[((k >> (j * bits)) & ((1 << bits) - 1)) >= cut
                              for j in range(per)] for k in range(256)])
        assert torch.equal(got, want), (bits, cut)
    torch.manual_seed(3)
    keep, scale = _keep_mask(torch.Size([4000, 56]), 0.5)
    assert scale == 2.0 and keep.shape == (4000, 56)
    assert abs(keep.float().mean().item() - 0.5) < 0.004  # an always-0 bit would give 0.492
    by_position = keep.float().mean(0)  # each of a word's 56 elements is kept half the time
    assert ((by_position - 0.5).abs() < 0.04).all(), by_position
    a, b = keep[:, :-1].float(), keep[:, 1:].float()
    assert abs((a * b).mean().item() - 0.25) < 0.01  # neighbours independent


@pytest.mark.parametrize("empty_layer,last_src", [(None, 15), (1, 15), (None, 7)])
@pytest.mark.parametrize("dropout", [0.0, 0.5, 0.25, 0.3])
def test_activation_in_the_next_layers_mean_equals_one_after_each_layer(empty_layer, last_src,
                                                                         dropout):
    """GraphSAGE.forward (training, CPU) applies each ReLU and dropout inside the next layer's
    mean (model._MeanAggregate: the mask applied in place, the scale in the mean's weights and
    the self term, no ReLU or dropout node): the same output and gradients as
    forward_layer's ReLU then the Dropout module after each layer, for the same random state;
    bit for bit where the scale is a power of two (p 0 and 0.5), with a block without edges,
    a last layer that projects first (7 sources for 6 destinations, 32 -> 5: the activation
    applied before, not in a mean) and in eval mode without gradients."""
    from trainer_client.model import LayerwiseGNN, project_first

    sizes = [90, 40, last_src, 6]
    blocks = [random_block(s, d, 0 if i == empty_layer else 6, seed=70 + i)
              for i, (s, d) in enumerate(zip(sizes[:-1], sizes[1:]))]
    model = GraphSAGE(12, 32, 5, 3, dropout=dropout)
    assert project_first(blocks[2], 32, 5) == (last_src == 7)
    x = torch.randn(90, 12)

    def by_layer(blocks, x):
        h = x
        for i, block in enumerate(blocks):
            h = LayerwiseGNN.forward_layer(model, i, block, h)
        return h[: blocks[-1].num_dst_nodes()]

    results = []
    for forward in (model, by_layer):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        torch.manual_seed(123)
        out = forward(blocks, xi)
        out.pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((out, xi.grad, grads))
    (out_a, gx_a, ga), (out_b, gx_b, gb) = results
    tol = 0 if dropout in (0.0, 0.5) else 1e-5
    torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol)
    torch.testing.assert_close(gx_a, gx_b, rtol=tol, atol=tol)
    assert (gx_a != 0).any()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=tol, atol=tol, msg=name)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(blocks, x), by_layer(blocks, x), rtol=0, atol=0)


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_mean_with_relu_dropout_equals_relu_dropout_then_mean(p):
    """mean_and_self(relu_dropout=p) against ReLU, the Dropout module, then mean_and_self:
    the same mean, self term and gradient for the same random state, with a NaN passing
    forward as there (and back as through ReLU); with only its self term used, the gradient
    is that term's, masked and scaled, and zero after the destinations; padded to more rows
    than destinations, the same with zero rows after them."""
    from trainer_client.model import Dropout, mean_and_self

    block = random_block(20, 8, 4, seed=5)
    base = torch.randn(20, 6)
    base[2, 1] = base[11, 4] = float("nan")
    got = []
    for fused in (True, False):
        leaf = base.clone().requires_grad_()
        h = leaf * 1.0
        torch.manual_seed(7)
        agg, dst = (mean_and_self(block, h, relu_dropout=p) if fused
                    else mean_and_self(block, Dropout(p)(torch.relu(h))))
        (agg.sum() + (dst * 2).sum()).backward()
        got.append((agg, dst, leaf.grad))
    finite = ~torch.isnan(base)  # a dropped NaN's gradient passes here (see _MeanAggregate)
    for a, b in zip(got[0][:2], got[1][:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[0][2][finite], got[1][2][finite], rtol=0, atol=0)
    leaf = base.clone().requires_grad_()
    torch.manual_seed(7)
    _, dst = mean_and_self(block, leaf * 1.0, relu_dropout=p)
    (g,) = torch.autograd.grad(dst.sum(), leaf)
    kept = dst[:8] != 0  # a NaN stays NaN, kept or dropped (NaN * 0), as in nn.Dropout
    scale = 1 / (1 - p)
    want = torch.where(kept & ~(base[:8] <= 0), scale, 0.0)
    assert torch.equal(g[:8], want) and (g[8:] == 0).all()
    assert torch.isnan(dst[2, 1]) and g[2, 1] == scale
    padded = []  # rows past the destinations (gemm_rows' buckets): zeros, the rest the same
    for rows in (8, 11):
        leaf = base.clone().requires_grad_()
        torch.manual_seed(7)
        agg, dst = mean_and_self(block, leaf * 1.0, rows, relu_dropout=p)
        (agg.sum() + dst.nan_to_num().sum()).backward()
        padded.append((agg, dst, leaf.grad))
    (agg8, dst8, g8), (agg11, dst11, g11) = padded
    assert agg11.shape[0] == dst11.shape[0] == 11
    assert (agg11[8:] == 0).all() and (dst11[8:] == 0).all()
    torch.testing.assert_close(agg11[:8], agg8, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dst11[:8], dst8, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(g11, g8, rtol=0, atol=0, equal_nan=True)


def term_by_term_and_linear_sum(xs, ws, b, grad, need_x: bool) -> list[list]:
    """``bias + sum x W^T`` over ``zip(xs, ws)`` (``b``: the bias or None) by model._LinearSum
    (torch's mm, term by term), then by model.linear_sum (whatever route it takes here), each
    on fresh leaves, backward with ``grad``: per way, [output, the gradients of the inputs
    (where ``need_x``), of the weights, of the bias]."""
    from trainer_client import model as model_mod

    results = []
    for fn in (lambda bb, terms: model_mod._LinearSum.apply(
                   bb, *[t for term in terms for t in term]),
               model_mod.linear_sum):
        leaves = ([x.detach().clone().requires_grad_(need_x) for x in xs]
                  + [w.detach().clone().requires_grad_() for w in ws])
        bb = b.detach().clone().requires_grad_() if b is not None else None
        got = fn(bb, list(zip(leaves[:len(xs)], leaves[len(xs):])))
        got.backward(grad)
        results.append([got.detach(), *[t.grad for t in leaves if t.requires_grad],
                        *([bb.grad] if bb is not None else [])])
    return results


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_x", [True, False])
def test_narrow_terms_take_one_product_with_the_same_results(monkeypatch, bias, need_x):
    """linear_sum packs terms whose inputs are at most a quarter of the output wide into one
    product with the bias as a column of ones (model._LinearSumNarrow): the same output and
    the same gradients of every input, weight and the bias as term by term
    (model._LinearSum), for 1 to 3 terms; wider terms go term by term."""
    from trainer_client import model as model_mod

    calls = {"narrow": 0}
    forward = model_mod._LinearSumNarrow.forward

    def counted(ctx, *args):
        calls["narrow"] += 1
        return forward(ctx, *args)

    monkeypatch.setattr(model_mod._LinearSumNarrow, "forward", staticmethod(counted))
    g = torch.Generator().manual_seed(7)
    for widths, out, narrow in [([4], 16, True), ([4, 3], 16, True), ([2, 4, 1], 20, True),
                                ([4, 5], 16, False), ([16], 16, False)]:
        xs = [torch.randn(33, k, generator=g) for k in widths]
        ws = [torch.randn(out, k, generator=g) for k in widths]
        b = torch.randn(out, generator=g)
        grad = torch.randn(33, out, generator=g)
        results = term_by_term_and_linear_sum(xs, ws, b if bias else None, grad, need_x)
        before = calls["narrow"]
        model_mod.linear_sum(None, list(zip(xs, ws)))
        assert (calls["narrow"] > before) is narrow, (widths, out)
        assert len(results[0]) == len(results[1])
        for want, got in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
