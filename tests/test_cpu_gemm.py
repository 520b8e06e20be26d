"""``--cpu-gemm``: the model's float32 products through oneDNN (model._LinearSumDnn) give
the same outputs and gradients as through torch's mm (MKL), ``auto`` decides from the CPU
alone, and a bad value is a clear error. (The seed model under either library against DGL's:
tests/test_model.py.)"""

from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, TrainerConfig
from tests.test_model import term_by_term_and_linear_sum
from trainer_client import model as model_mod

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cpu_gemm(monkeypatch):
    """Set this process's --cpu-gemm for one test (restored after it)."""
    monkeypatch.setattr(model_mod, "_CPU_GEMM", "auto")
    return model_mod.set_cpu_gemm


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_x", [True, False])
def test_onednn_products_equal_mkl_products(cpu_gemm, bias, need_x):
    """linear_sum under ``onednn`` takes _LinearSumDnn (counted), and its output and the
    gradients of every input, weight and the bias equal _LinearSum's (torch's mm) for 1 to 3
    terms, 1 to 100 rows, and an input that is a column slice (not contiguous); under
    ``mkl`` nothing goes to oneDNN."""
    cpu_gemm("onednn")
    g = torch.Generator().manual_seed(3)
    for rows, widths, out in [(33, [16], 24), (100, [20, 12], 16), (1, [8, 8], 8),
                              (57, [10, 30, 9], 20)]:
        xs = [torch.randn(rows, k + 3, generator=g)[:, 3:] if i == 0 else
              torch.randn(rows, k, generator=g) for i, k in enumerate(widths)]
        assert rows == 1 or not xs[0].is_contiguous()
        ws = [torch.randn(out, k, generator=g) for k in widths]
        b = torch.randn(out, generator=g)
        grad = torch.randn(rows, out, generator=g)
        before = model_mod.ONEDNN_PRODUCTS_RUN[0]
        wgrads_before = model_mod.ONEDNN_WEIGHT_GRADS_RUN[0]
        results = term_by_term_and_linear_sum(xs, ws, b if bias else None, grad, need_x)
        ran = model_mod.ONEDNN_PRODUCTS_RUN[0] - before
        assert ran == len(widths), (rows, widths)  # linear_sum's products, all on oneDNN
        # and every weight's gradient, by oneDNN's inner-product backward
        assert model_mod.ONEDNN_WEIGHT_GRADS_RUN[0] - wgrads_before == len(widths)
        assert len(results[0]) == len(results[1])
        for want, got in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    cpu_gemm("mkl")
    before = model_mod.ONEDNN_PRODUCTS_RUN[0]
    model_mod.linear_sum(None, [(torch.randn(5, 16), torch.randn(8, 16))])
    assert model_mod.ONEDNN_PRODUCTS_RUN[0] == before


@pytest.mark.parametrize("weights_grad,bias_grad", [(True, True), (True, False),
                                                     (False, True), (False, False)])
def test_onednn_weight_and_bias_gradients_where_asked(cpu_gemm, weights_grad, bias_grad):
    """_LinearSumDnn's backward computes exactly the gradients autograd asks for: the
    weights' by oneDNN's inner-product backward (counted), the bias's with the first of them
    or, with frozen weights, as the gradient's column sums; equal to torch's mm route."""
    cpu_gemm("onednn")
    g = torch.Generator().manual_seed(5)
    rows, widths, out = 70, [12, 9], 16
    xs = [torch.randn(rows, k, generator=g) for k in widths]
    ws = [torch.randn(out, k, generator=g) for k in widths]
    b = torch.randn(out, generator=g)
    grad = torch.randn(rows, out, generator=g)
    got = {}
    for route in ("mm", "onednn"):
        leaves = ([x.clone().requires_grad_() for x in xs]
                  + [w.clone().requires_grad_(weights_grad) for w in ws])
        bb = b.clone().requires_grad_(bias_grad)
        terms = list(zip(leaves[:2], leaves[2:]))
        before = model_mod.ONEDNN_WEIGHT_GRADS_RUN[0]
        y = (model_mod._LinearSum.apply(bb, *[t for term in terms for t in term])
             if route == "mm" else model_mod.linear_sum(bb, terms))
        y.backward(grad)
        ran = model_mod.ONEDNN_WEIGHT_GRADS_RUN[0] - before
        assert ran == (len(widths) if route == "onednn" and weights_grad else 0)
        got[route] = [y.detach()] + [t.grad for t in [*leaves, bb]]
        assert [t is None for t in got[route][3:]] == [not weights_grad] * 2 + [not bias_grad]
    for want, have in zip(got["mm"], got["onednn"]):
        if want is None:
            assert have is None
        else:
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("vendor,family,flags,want", [
    ("AuthenticAMD", 26, {"avx2", "avx512f"}, True),   # Zen 5: MKL would run AVX2 kernels
    ("AuthenticAMD", 25, {"avx2", "avx512f"}, False),  # Zen 4: AVX-512 at AVX2's rate
    ("AuthenticAMD", None, {"avx2", "avx512f"}, False),  # family unknown
    ("AuthenticAMD", 26, {"avx2"}, False),             # no AVX-512 for oneDNN to use
    ("GenuineIntel", 6, {"avx2", "avx512f"}, False),   # MKL runs AVX-512 itself
    ("", None, set(), False),                          # no /proc/cpuinfo
])
def test_auto_decides_from_the_cpu_alone(cpu_gemm, monkeypatch, vendor, family, flags, want):
    """``auto`` takes oneDNN exactly on an AMD CPU of family 26 or later with AVX-512 (from
    /proc/cpuinfo, no timing: every run on a machine multiplies the same way), and says so
    in the summary."""
    monkeypatch.setattr(model_mod, "_cpu_info", lambda: (vendor, frozenset(flags)))
    monkeypatch.setattr(model_mod, "_cpu_family", lambda: family)
    monkeypatch.setattr(model_mod, "_ONEDNN_AUTO", None)
    cpu = torch.device("cpu")
    assert model_mod.cpu_gemm_auto() is (want and torch.backends.mkldnn.is_available())
    assert model_mod.float32_library(cpu) == ("onednn" if model_mod.cpu_gemm_auto() else "mkl")
    summary = model_mod.cpu_gemm_summary(cpu)
    assert summary["mode"] == "auto" and summary["library"] == model_mod.float32_library(cpu)
    for mode in ("mkl", "onednn"):
        cpu_gemm(mode)
        assert model_mod.float32_library(cpu) == mode
    assert model_mod.float32_library(torch.device("cuda")) is None  # a GPU multiplies itself


def test_cpu_info_reads_vendor_and_flags():
    vendor, flags = model_mod._cpu_info()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert (vendor, flags) == ("", frozenset())
        assert model_mod._cpu_family() is None
        return
    assert vendor and vendor in text
    assert flags and all(f in text for f in list(flags)[:5])
    family = model_mod._cpu_family()
    assert family is None or f"cpu family\t: {family}\n" in text


def test_bad_cpu_gemm_is_a_clear_error(cpu_gemm):
    with pytest.raises(ValueError, match="auto, mkl, onednn"):
        cpu_gemm("openblas")
    with pytest.raises(ConfigError, match="--cpu-gemm must be one of auto, mkl, onednn"):
        TrainerConfig(cluster="c.yaml", cpu_gemm="blas").validate()
