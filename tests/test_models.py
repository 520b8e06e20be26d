"""The model choice: each plain-torch layer equals its dgl.nn counterpart on the same block
with the same weights (forward and gradients, including destinations without in-edges);
forward is the loop of forward_layer; build_model validates the spec; models train; the
trainer's optimizer (build_optimizer) is Adam's update through the fused kernel, and its
guarded step (guarded_step) is that update where everything is finite and no change at all
where anything is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_model import random_block

from common.dgl_compat import import_dgl
from common.errors import ConfigError
from trainer_client.model import GraphSAGE
from trainer_client.models import (
    GAT,
    GCN,
    MODEL_NAMES,
    DGLGraphSAGE,
    GATConv,
    GraphConv,
    build_model,
    build_optimizer,
    check_spec,
    edge_softmax,
    guarded_step,
    supports_guard,
)

pytestmark = pytest.mark.timeout(120)

TOL = {"rtol": 1e-4, "atol": 1e-5}
REPO = Path(__file__).resolve().parents[1]


def spec(name: str, **kw) -> dict:
    s = {"name": name, "in_feats": 8, "hidden": 6, "num_classes": 3, "num_layers": 2,
         "dropout": 0.5}
    if name == "gat":
        s["heads"] = 2
    s.update(kw)
    return s


def blocks_for(num_layers: int, seed: int) -> list:
    """Blocks of an MFG: each block's destinations are the next block's sources."""
    sizes = [60, 25, 10, 4][-(num_layers + 1):]
    return [random_block(s, d, 5, seed=seed + i)
            for i, (s, d) in enumerate(zip(sizes[:-1], sizes[1:]))]


def assert_same_forward_and_grads(ours, ref, block, in_feats: int):
    """Same output and same gradients w.r.t. the input and every (same-named) parameter."""
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(block.num_src_nodes(), in_feats, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    got, want = ours(block, x), ref(block.to_dgl(), x_ref)
    torch.testing.assert_close(got, want, **TOL)
    g = torch.randn_like(got)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=name)


@pytest.mark.parametrize("in_feats,out_feats,num_src,first", [
    (16, 8, 50, False), (16, 8, 20, True), (8, 16, 50, False), (12, 12, 50, False)])
def test_graphconv_equals_dgl(in_feats, out_feats, num_src, first):
    """Forward and gradients, in both association orders (``first``: model.project_first
    multiplies by the weight before the aggregation)."""
    import_dgl()
    from dgl.nn import GraphConv as DGLGraphConv

    from trainer_client.model import project_first

    block = random_block(num_src, 20, 6, seed=in_feats + out_feats)
    assert project_first(block, in_feats, out_feats) is first
    assert (block.in_degrees() == 0).any(), "want a destination without in-edges"
    assert (torch.bincount(block.indices, minlength=num_src) == 0).any(), "and an unused source"
    ours = GraphConv(in_feats, out_feats)
    with torch.no_grad():
        ours.bias.copy_(torch.randn(out_feats))
    ref = DGLGraphConv(in_feats, out_feats, norm="both", allow_zero_in_degree=True)
    assert_same_forward_and_grads(ours, ref, block, in_feats)


@pytest.mark.parametrize("in_feats,out_feats,heads", [(16, 4, 3), (5, 8, 1)])
def test_gatconv_equals_dgl(in_feats, out_feats, heads):
    import_dgl()
    from dgl.nn import GATConv as DGLGATConv

    block = random_block(50, 20, 6, seed=7 * heads)
    assert (block.in_degrees() == 0).any(), "want a destination without in-edges"
    ours = GATConv(in_feats, out_feats, heads)
    with torch.no_grad():
        ours.bias.copy_(torch.randn(heads * out_feats))
    ref = DGLGATConv(in_feats, out_feats, heads, feat_drop=0.0, attn_drop=0.0,
                     negative_slope=0.2, residual=False, allow_zero_in_degree=True)
    assert_same_forward_and_grads(ours, ref, block, in_feats)


def test_edge_softmax_equals_dgl_and_is_stable():
    dgl = import_dgl()
    from dgl.nn.functional import edge_softmax as dgl_edge_softmax

    block = random_block(40, 15, 7, seed=11)
    e = torch.randn(block.num_edges(), 2) * 30 + 500  # exp() alone would overflow
    got = edge_softmax(block, e)
    want = dgl_edge_softmax(block.to_dgl(), e)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL)
    sums = torch.zeros(15, 2).index_add(0, block.dst_index(), got)
    has_edges = block.in_degrees() > 0
    torch.testing.assert_close(sums[has_edges], torch.ones(int(has_edges.sum()), 2))
    assert isinstance(dgl.__version__, str)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_forward_is_the_loop_of_forward_layer(name, num_layers):
    model = build_model(spec(name, num_layers=num_layers)).eval()
    assert model.num_layers == num_layers
    blocks = blocks_for(num_layers, seed=20)
    x = torch.randn(blocks[0].num_src_nodes(), 8)
    h = x
    for i, block in enumerate(blocks):
        h = model.forward_layer(i, block, h)
    out = model(blocks, x)
    assert out.shape == (blocks[-1].num_dst_nodes(), 3)
    torch.testing.assert_close(out, h, rtol=0, atol=0)
    with pytest.raises(ValueError, match="blocks"):
        model(blocks[:-1] if num_layers > 1 else blocks * 2, x)


def test_gat_concatenates_hidden_heads_and_averages_the_last():
    model = build_model(spec("gat", hidden=5, heads=3, num_layers=2)).eval()
    assert isinstance(model, GAT)
    b0, b1 = blocks_for(2, seed=30)
    x = torch.randn(b0.num_src_nodes(), 8)
    h = model.forward_layer(0, b0, x)
    assert h.shape == (b0.num_dst_nodes(), 15)
    out = model.forward_layer(1, b1, h)
    torch.testing.assert_close(out, model.layers[1](b1, h).mean(1))


def test_dgl_sage_matches_sage_with_the_same_weights():
    sage = build_model(spec("sage", num_layers=3))
    dgl_sage = build_model(spec("dgl-sage", num_layers=3))
    assert isinstance(sage, GraphSAGE) and isinstance(dgl_sage, DGLGraphSAGE)
    dgl_sage.load_state_dict(sage.state_dict())  # the same state-dict keys
    sage.eval()
    dgl_sage.eval()
    blocks = blocks_for(3, seed=40)
    x = torch.randn(blocks[0].num_src_nodes(), 8)
    torch.testing.assert_close(dgl_sage(blocks, x), sage(blocks, x), **TOL)
    # DGL blocks pass through unchanged
    torch.testing.assert_close(dgl_sage([b.to_dgl() for b in blocks], x), sage(blocks, x),
                               **TOL)

    # An inference block serves no labels (an empty tensor): to_dgl keeps node data only
    for b in blocks:
        b.dstdata["label"] = torch.empty(0, dtype=torch.int64)
    torch.testing.assert_close(dgl_sage(blocks, x), sage(blocks, x), **TOL)
    assert "label" not in blocks[-1].to_dgl().dstdata


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_trains_on_a_tiny_block_set(name):
    """A few Adam steps on fixed blocks and labels lower the loss: backward reaches every
    parameter through every layer."""
    torch.manual_seed(0)
    model = build_model(spec(name, hidden=16, dropout=0.1))
    blocks = blocks_for(2, seed=50)
    x = torch.randn(blocks[0].num_src_nodes(), 8)
    y = torch.randint(0, 3, (blocks[-1].num_dst_nodes(),))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(blocks, x), y)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_build_model_kinds_and_spec_normalisation():
    assert type(build_model(spec("gcn"))) is GCN
    s = check_spec({**spec("sage"), "dropout": 0})
    assert s["dropout"] == 0.0 and isinstance(s["dropout"], float)
    assert check_spec(spec("gat"))["heads"] == 2


@pytest.mark.parametrize("bad,pattern", [
    ({"name": "gin"}, r"'name' must be one of \['sage', 'gcn', 'gat', 'dgl-sage'\]"),
    ({"hidden": 0}, "'hidden' must be an integer >= 1, got 0"),
    ({"num_layers": 2.0}, "'num_layers' must be an integer"),
    ({"in_feats": True}, "'in_feats' must be an integer"),
    ({"num_classes": None}, "'num_classes' must be an integer"),
    ({"dropout": 1.0}, r"'dropout' must be a number in \[0, 1\), got 1.0"),
    ({"dropout": "0.5"}, "'dropout' must be a number"),
    ({"heads": 0}, "'heads' must be an integer >= 1"),
    ({"hiden": 16}, r"unknown key\(s\) \['hiden'\]; accepted: \['name'"),
])
def test_build_model_rejects_bad_specs(bad, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_model({**spec("gat"), **bad})


def test_build_model_requires_heads_for_gat_and_a_dict():
    s = spec("gat")
    del s["heads"]
    with pytest.raises(ConfigError, match="'heads' must be an integer >= 1, got None"):
        build_model(s)
    s = spec("sage")
    del s["dropout"]
    with pytest.raises(ConfigError, match="'dropout'"):
        build_model(s)
    with pytest.raises(ConfigError, match="must be a dict"):
        build_model(["sage"])  # type: ignore[arg-type]


def test_plain_torch_models_never_import_dgl():
    """sage, gcn and gat build, run and train without DGL (a fresh interpreter, so nothing
    imported by other tests counts)."""
    code = (
        "import sys, torch\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_model import random_block\n"
        "from trainer_client.models import build_model\n"
        "b0, b1 = random_block(30, 10, 4, seed=1), random_block(10, 4, 4, seed=2)\n"
        "for name in ('sage', 'gcn', 'gat'):\n"
        "    m = build_model({'name': name, 'in_feats': 5, 'hidden': 4, 'num_classes': 3,\n"
        "                     'num_layers': 2, 'dropout': 0.5, 'heads': 2})\n"
        "    m([b0, b1], torch.randn(30, 5)).sum().backward()\n"
        "assert not [m for m in sys.modules if m == 'dgl' or m.startswith('dgl.')]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["sage", "gcn", "gat"])
def test_plain_torch_models_give_the_same_result_on_cuda(name):
    model = build_model(spec(name, num_layers=3)).eval()
    blocks = blocks_for(3, seed=60)
    x = torch.randn(blocks[0].num_src_nodes(), 8)
    want = model(blocks, x)
    got = model.to("cuda")([b.to("cuda") for b in blocks], x.to("cuda"))
    torch.testing.assert_close(got.cpu(), want, **TOL)


def _adam_params(opt_of, steps: int = 20) -> torch.Tensor:
    torch.manual_seed(0)
    model = GraphSAGE(16, 32, 5, 2, 0.0)
    opt = opt_of(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_the_trainers_optimizer_is_fused_adam_with_adams_update():
    opt = build_optimizer(GraphSAGE(16, 32, 5, 2, 0.0).parameters(), 3e-3, 5e-4)
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["fused"] is True
    assert (opt.defaults["lr"], opt.defaults["weight_decay"]) == (3e-3, 5e-4)
    fused = _adam_params(lambda ps: build_optimizer(ps, 3e-3, 5e-4))
    plain = _adam_params(lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=5e-4))
    assert torch.allclose(fused, plain, rtol=0, atol=1e-6)
    moved = _adam_params(lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=5e-4), 0)
    assert (plain - moved).abs().max() > 1e-3  # the steps did move the parameters


def _guard_params(bad_steps: set[int], guarded: bool, steps: int = 12):
    """GraphSAGE's parameters and Adam's state after ``steps`` steps of random gradients, the
    steps in ``bad_steps`` with a NaN gradient entry and through ``guarded_step`` (else
    ``opt.step()``, skipping the bad steps: what the guard must amount to)."""
    torch.manual_seed(0)
    model = GraphSAGE(16, 32, 5, 2, 0.0)
    opt = build_optimizer(model.parameters(), 3e-3, 5e-4)
    g = torch.Generator().manual_seed(1)
    flags = []
    for i in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        loss = torch.tensor(0.5)
        if i in bad_steps:
            next(model.parameters()).grad[0, 0] = float("nan")
        if guarded:
            flags.append(float(guarded_step(opt, model.parameters(), loss)))
        elif i not in bad_steps:
            opt.step()
    state = [t.detach().clone() for p in model.parameters()
             for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"],
                       opt.state[p]["step"])]
    return state, flags


def test_the_guarded_step_is_adams_step_and_changes_nothing_on_a_non_finite_gradient():
    """Bitwise the plain step where all is finite; where a gradient entry is NaN, the
    parameters, both moments and the step count stay as they were (the flag reads 1)."""
    opt = build_optimizer(GraphSAGE(16, 32, 5, 2, 0.0).parameters(), 3e-3, 5e-4)
    assert supports_guard(opt)
    assert not supports_guard(torch.optim.Adam(GraphSAGE(4, 4, 2, 1).parameters()))
    want, _ = _guard_params(set(), guarded=False)
    got, flags = _guard_params(set(), guarded=True)
    assert flags == [0.0] * 12
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    want, _ = _guard_params({3, 7}, guarded=False)
    got, flags = _guard_params({3, 7}, guarded=True)
    assert flags == [1.0 if i in (3, 7) else 0.0 for i in range(12)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert float(want[3]) == 10  # the first parameter's step count: 12 steps, 2 skipped


def test_the_guard_flags_a_non_finite_loss_with_finite_gradients():
    w = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([w], 0.1, 0.0)
    w.grad = torch.ones(3)
    assert float(guarded_step(opt, [w], torch.tensor(float("inf")))) == 1.0
    assert torch.equal(w.detach(), torch.ones(3))
    assert float(guarded_step(opt, [w], torch.tensor(2.0))) == 0.0
    assert not torch.equal(w.detach(), torch.ones(3))


@pytest.mark.parametrize("kernel", ["multi-tensor", "sums"])
def test_the_non_finite_flag_sees_any_nan_or_inf_entry(kernel, monkeypatch):
    """Both ways of computing the flag: the multi-tensor check, and one sum per parameter
    where a torch has no such kernel for the device."""
    from trainer_client.models import non_finite_flag

    if kernel == "sums":
        def missing(*args):
            raise NotImplementedError("no kernel for this device")
        monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    ws = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(4))]
    for w in ws:
        w.grad = torch.ones_like(w)
    finite = torch.tensor(0.25)
    assert float(non_finite_flag(ws, finite)) == 0.0
    for bad in (float("nan"), float("inf"), -float("inf")):
        ws[1].grad[2] = bad
        assert float(non_finite_flag(ws, finite)) == 1.0
        ws[1].grad[2] = 1.0
        assert float(non_finite_flag(ws, torch.tensor(bad))) == 1.0
    ws[0].grad[1, 1] = float("nan")
    assert float(non_finite_flag(ws, torch.tensor(float("nan")))) == 1.0  # 1, never 2
    assert torch.equal(ws[1].grad, torch.ones(4))  # the check leaves finite gradients as they are


def test_the_trainers_optimizer_falls_back_where_torch_refuses_the_fused_kernel(monkeypatch):
    real = torch.optim.Adam

    class NoFused(real):  # torch before 2.4: no fused Adam for CPU parameters
        def __init__(self, params, fused=None, **kw):
            if fused:
                raise RuntimeError("`fused=True` requires all the params to be floating point "
                                   "Tensors of supported devices: ['cuda']")
            super().__init__(params, **kw)

    monkeypatch.setattr(torch.optim, "Adam", NoFused)
    opt = build_optimizer(GraphSAGE(16, 32, 5, 2, 0.0).parameters(), 3e-3, 5e-4)
    assert isinstance(opt, NoFused) and not opt.defaults["fused"]
    assert len(opt.param_groups[0]["params"]) == len(list(GraphSAGE(16, 32, 5, 2).parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,dropout", [("sage", 0.0), ("sage", 0.5), ("gcn", 0.0)])
def test_a_training_step_on_cuda_never_makes_the_host_wait(name, dropout):
    """Forward, loss, backward, the finite check and the fused Adam step skipped on it
    (``guarded_step``, the trainer's step) are only queued: none reads a value back (torch's
    sync debug mode warns at each line that does; the message names them). The trainer reads
    each step's loss and flag after fetching the next batch (``train.settle``)."""
    import torch.nn.functional as F
    from syncs import assert_detects_a_sync, syncs_of

    model = build_model(spec(name, num_layers=3, dropout=dropout)).to("cuda").train()
    opt = build_optimizer(model.parameters(), 3e-3, 5e-4)
    batches = []
    for seed in (70, 80):  # fresh blocks each step, as each batch is
        blocks = [b.to("cuda") for b in blocks_for(3, seed=seed)]
        x = torch.randn(blocks[0].num_src_nodes(), 8, device="cuda")
        batches.append((blocks, x, torch.randint(0, 3, (blocks[-1].num_dst_nodes(),),
                                                 device="cuda")))
    losses, flags = [], []

    def steps():
        for blocks, x, y in batches:
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            flags.append(guarded_step(opt, model.parameters(), loss))
            losses.append(loss.detach())

    assert_detects_a_sync()
    syncs = syncs_of(steps)
    assert not syncs, "\n".join(syncs)
    assert len(losses) == 2 and bool(torch.isfinite(torch.stack(losses)).all())
    assert torch.stack(flags).tolist() == [0.0, 0.0]
