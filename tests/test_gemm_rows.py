"""Bucketed GEMM rows (trainer_client.model.gemm_rows, ``--matmul-precision medium``): the
model computes the same function and the same gradients with its layers' rows padded as
without; the buckets; the precision in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.test_model import random_block
from trainer_client import model as model_mod
from trainer_client.model import GraphSAGE, SAGEConv, gemm_rows

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _mkl_products(monkeypatch):
    """torch's own float32 products (--cpu-gemm mkl), which do not bucket: the unpadded
    baseline here on any CPU (``auto`` buckets where it takes oneDNN; tests/test_cpu_gemm.py
    checks that route against DGL)."""
    monkeypatch.setattr(model_mod, "_CPU_GEMM", "mkl")


def _bucket(n: int, device) -> int:
    """What gemm_rows gives where bucketing is on (forced here at float32 precision, so
    both runs below multiply alike and only the padding differs)."""
    step = 1 << max(6, n.bit_length() - 5)
    return max(step, -(-n // step) * step)


def _blocks(sizes: list[int], max_deg: int, seed: int):
    """One block per layer, sources then destinations shrinking: sizes[0] input rows."""
    return [random_block(a, b, max_deg, seed + i) for i, (a, b) in
            enumerate(zip(sizes[:-1], sizes[1:]))]


def _run(model, blocks, x, labels, seed: int):
    torch.manual_seed(seed)  # the same dropout draws... only where the shapes are equal
    model.zero_grad()
    out = model(blocks, x)
    loss = torch.nn.functional.cross_entropy(out, labels)
    loss.backward()
    return out.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("sizes,in_feats,hidden,classes", [
    ([3000, 700, 130, 33], 24, 32, 7),       # aggregate first in every layer
    ([500, 480, 470, 400], 40, 16, 5),      # few sources more than destinations: project
                                            # first where in > out, pads past num_src
    ([300, 90, 0 + 64, 64], 8, 8, 3),       # bucket == num_dst already
    ([200, 150, 70, 20], 8, 8, 3),          # small blocks: padded up to 64 rows
])
def test_padded_rows_give_the_same_outputs_and_gradients(monkeypatch, sizes, in_feats, hidden,
                                                         classes):
    blocks = _blocks(sizes, max_deg=7, seed=sizes[0])
    torch.manual_seed(0)
    model = GraphSAGE(in_feats, hidden, classes, len(blocks), dropout=0.0)
    for p in model.parameters():  # non-zero biases, so padded rows are not zeros
        if p.dim() == 1:
            torch.nn.init.uniform_(p, -0.5, 0.5)
    x = torch.randn(sizes[0], in_feats)
    labels = torch.randint(0, classes, (sizes[-1],))
    want_out, want_grads = _run(model, blocks, x, labels, 1)
    padded = []
    monkeypatch.setattr(model_mod, "gemm_rows",
                        lambda n, device: padded.append((n, _bucket(n, device)))
                        or _bucket(n, device))
    got_out, got_grads = _run(model, blocks, x, labels, 1)
    assert any(b > n for n, b in padded), f"nothing was padded: {padded}"
    assert got_out.shape == (sizes[-1], classes)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    # layer by layer (layer-wise inference): num_dst rows, the same values
    with torch.no_grad():
        h = x
        for i, b in enumerate(blocks):
            h = model.forward_layer(i, b, h)
            assert h.shape[0] == b.num_dst_nodes()
    torch.testing.assert_close(h, want_out, rtol=1e-5, atol=1e-6)


def test_padded_rows_of_a_layer_with_input_gradient(monkeypatch):
    """SAGEConv alone on an input that needs a gradient (a middle layer): the input's
    gradient has the input's rows, and equals the unpadded one."""
    block = random_block(400, 150, 9, seed=3)
    conv = SAGEConv(16, 24)
    x = torch.randn(400, 16, requires_grad=True)
    w = torch.randn(150, 24)
    (conv(block, x) * w).sum().backward()
    want = x.grad.clone()
    x.grad = None
    monkeypatch.setattr(model_mod, "gemm_rows", lambda n, device: _bucket(n, device))
    out = conv(block, x)
    assert out.shape[0] == _bucket(150, "cpu") > 150
    (out[:150] * w).sum().backward()
    assert x.grad.shape == x.shape
    torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes,in_feats,hidden,classes", [
    ([3000, 700, 130, 33], 24, 32, 7),       # aggregate first in every layer
    ([200, 150, 70, 20], 8, 8, 3),          # small blocks: padded up to 64 rows
])
def test_bfloat16_casts_match_float32_within_their_error(monkeypatch, sizes, in_feats, hidden,
                                                         classes):
    """``medium`` where torch computes float32 but the CPU multiplies bfloat16 (an AMD
    Zen 4): SAGEConv rounds its operands itself (_LinearSumPacked), with bucketed rows.
    Forced here, on any CPU: the outputs and every parameter gradient are float32's within
    bfloat16's error, the dtypes stay float32, and layer-wise rows are num_dst."""
    blocks = _blocks(sizes, max_deg=7, seed=sizes[0])
    torch.manual_seed(0)
    model = GraphSAGE(in_feats, hidden, classes, len(blocks), dropout=0.0)
    x = torch.randn(sizes[0], in_feats)
    labels = torch.randint(0, classes, (sizes[-1],))
    want_out, want_grads = _run(model, blocks, x, labels, 1)
    calls = []
    real = model_mod._LinearSumPacked.forward
    monkeypatch.setattr(model_mod._LinearSumPacked, "forward",
                        staticmethod(lambda *a: calls.append(1) or real(*a)))
    monkeypatch.setattr(model_mod, "bf16_products",
                        lambda device: "cast" if device.type == "cpu" else None)
    got_out, got_grads = _run(model, blocks, x, labels, 1)
    assert len(calls) == len(blocks), calls
    assert got_out.dtype == torch.float32 and got_out.shape == want_out.shape

    def close(got, want, name, bound):  # relative Frobenius error, and not float32's own
        err = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
        assert 0 < err < bound, (name, err)

    # bfloat16 operands: ~3e-3 of a product going forward. Going back the input layer's
    # weight gradients sum terms that largely cancel: 4-5 % here, as much as bfloat16
    # operands with float32 products give (torch's medium, emulated: 4.4-5.0 %)
    close(got_out, want_out, "logits", 2e-2)
    for name, g in want_grads.items():
        assert got_grads[name].dtype == torch.float32
        close(got_grads[name], g, name, 0.1)
    with torch.no_grad():
        h = x
        for i, b in enumerate(blocks):
            h = model.forward_layer(i, b, h)
            assert h.shape[0] == b.num_dst_nodes() and h.dtype == torch.float32
    close(h, want_out, "layer-wise", 2e-2)


@pytest.mark.parametrize("name", ["gcn", "gat"])
@pytest.mark.parametrize("route", ["cast", "onednn"])
def test_gcn_and_gat_projections_take_the_medium_route(monkeypatch, name, route):
    """gcn's and gat's projections go through model.project at ``medium``. Forced to
    ``"onednn"`` at this process's float32 precision, rows are bucketed and the outputs and
    gradients are the unpadded ones within float32 rounding. Forced to ``"cast"`` (bfloat16
    operands, bucketed rows: _LinearSumPacked), they are float32's within bfloat16's error, and
    stay float32. Layer-wise inference gives num_dst rows either way."""
    from trainer_client.models import build_model

    sizes = [3000, 700, 130, 33]
    blocks = _blocks(sizes, max_deg=7, seed=11)
    torch.manual_seed(0)
    model = build_model({"name": name, "in_feats": 24, "hidden": 32, "num_classes": 7,
                         "num_layers": 3, "dropout": 0.0, "heads": 2})
    for p in model.parameters():  # non-zero biases, so padded rows are not zeros
        if p.dim() == 1:
            torch.nn.init.uniform_(p, -0.5, 0.5)
    x = torch.randn(sizes[0], 24)
    labels = torch.randint(0, 7, (sizes[-1],))
    want_out, want_grads = _run(model, blocks, x, labels, 1)
    padded, casts = [], []
    real_rows, real_cast = model_mod.gemm_rows, model_mod._LinearSumPacked.forward
    monkeypatch.setattr(model_mod, "gemm_rows", lambda n, d: padded.append(n) or real_rows(n, d))
    monkeypatch.setattr(model_mod, "gemm_buckets", lambda device: device.type == "cpu")
    monkeypatch.setattr(model_mod._LinearSumPacked, "forward",
                        staticmethod(lambda *a: casts.append(1) or real_cast(*a)))
    monkeypatch.setattr(model_mod, "bf16_products",
                        lambda device: route if device.type == "cpu" else None)
    got_out, got_grads = _run(model, blocks, x, labels, 1)
    assert len(padded) == len(blocks), padded  # one projection a layer
    assert any(_bucket(n, None) > n for n in padded), padded
    assert len(casts) == (len(blocks) if route == "cast" else 0), casts
    assert got_out.dtype == torch.float32 and got_out.shape == want_out.shape

    def close(got, want, what, bound):  # relative Frobenius error
        err = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
        assert err < bound and (route == "onednn" or err > 0), (what, err)

    # "cast": logits 0.3-0.6 % off. Gradients whose terms largely cancel are further off:
    # gcn's input-layer weight 5.8 %; gat's input-layer attention vector attn_r 12 % (6 % with
    # bfloat16 operands and float32 products, torch's medium emulated: the cast route also
    # rounds each product's output, and the attention scores pass that on). Cora trains to
    # float32's accuracy with either (test_worker_mode.py).
    bound_out, bound_grad = ((1e-5, 1e-5) if route == "onednn"
                             else (2e-2, 0.25 if name == "gat" else 0.1))
    close(got_out, want_out, "logits", bound_out)
    for what, g in want_grads.items():
        assert got_grads[what].dtype == torch.float32
        close(got_grads[what], g, what, bound_grad)
    with torch.no_grad():
        h = x
        for i, b in enumerate(blocks):
            h = model.forward_layer(i, b, h)
            assert h.shape[0] == b.num_dst_nodes() and h.dtype == torch.float32
    close(h, want_out, "layer-wise", bound_out)


def _child_json(code: str):
    """The JSON of the last stdout line of ``python -c code`` (which must exit 0): for
    what changes the process-wide matmul precision."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_gemm_rows_pads_only_at_medium_precision_on_a_bf16_cpu():
    """At the default precision (and on any device but the CPU) the rows are the block's.
    At ``medium`` they are bucketed where SAGEConv's products then run in bfloat16
    (through torch's ``medium`` or its own casts): a step of
    1/32 to 1/16 of the rows, at least 64, and never fewer rows. Run in a child process:
    the precision is process-wide."""
    assert torch.get_float32_matmul_precision() == "highest"
    assert [gemm_rows(n, torch.device("cpu")) for n in (1, 1000, 25150)] == [1, 1000, 25150]
    code = (
        "import torch, json\n"
        "from trainer_client.model import gemm_rows, bf16_products, set_cpu_gemm\n"
        "set_cpu_gemm('mkl')\n"  # float32 products that do not bucket (see _mkl_products)
        "torch.set_float32_matmul_precision('medium')\n"
        "bf16 = bf16_products(torch.device('cpu')) is not None\n"
        "print(json.dumps([bool(bf16), [gemm_rows(n, torch.device('cpu')) for n in "
        "(0, 1, 64, 65, 1000, 1024, 4188, 25150)], gemm_rows(4188, torch.device('meta'))]))\n")
    bf16, rows, meta = _child_json(code)
    assert meta == 4188
    ns = [0, 1, 64, 65, 1000, 1024, 4188, 25150]
    if not bf16:
        assert rows == ns
        return
    assert rows == [64, 64, 64, 128, 1024, 1024, 4352, 25600]
    for n, r in zip(ns, rows):
        assert r >= n and (r - n) * 16 <= max(r, 64 * 16)


def test_bf16_probe_says_what_medium_precision_does_here():
    """bf16_gemms_possible probes, rather than reads CPU flags: torch hands float32 products
    at ``medium`` to oneDNN on any AVX-512 CPU, and oneDNN rounds to bfloat16 only where it
    has such kernels (an AMD Zen 4 with ``avx512_bf16`` gets float32 products). Whatever this
    CPU does, the probe must agree with a model-sized product's error at ``medium``, and
    leave the process's precision as it found it. In a child process: the precision is
    process-wide."""
    code = (
        "import torch, json\n"
        "from trainer_client.model import bf16_gemms_possible\n"
        "torch.set_float32_matmul_precision('high')\n"
        "probe = bf16_gemms_possible()\n"
        "after = torch.get_float32_matmul_precision()\n"
        "torch.set_float32_matmul_precision('medium')\n"
        "g = torch.Generator().manual_seed(0)\n"
        "a = torch.randn(2000, 100, generator=g); w = torch.randn(256, 100, generator=g)\n"
        "ref = a.double() @ w.double().t()\n"
        "err = ((torch.addmm(torch.zeros(256), a, w.t()).double() - ref).abs().max()\n"
        "       / ref.abs().max()).item()\n"
        "print(json.dumps([probe, after, err]))\n")
    probe, after, err = _child_json(code)
    assert after == "high"
    # float32 sums of 100 products: ~1e-7 of the largest; bfloat16 operands: ~1e-3
    assert (err > 1e-4) == probe, (probe, err)
