"""Functional layers: QAT straight-through gradients, FP8 W8A8, errors on bad input."""

import pytest
import torch
import torch.nn.functional as F

from quads.formats import fp8, nvfp4
from quads.quant import fp8_linear, qat_linear, w4a4_linear
from quads.quant.ops import nvfp4_quantize_weight


def _xw(t=12, k=64, n=32, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, t // 3, k, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, generator=g, dtype=dtype, requires_grad=True)
    return x, w


def _grads(fn, x, w):
    x.grad = w.grad = None
    y = fn(x, w)
    g = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    (y * g).sum().backward()
    return y.detach(), x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)], ids=lambda t: f"tile{t[0]}x{t[1]}")
@pytest.mark.parametrize("quantize_acts", [False, True], ids=["W4A16", "W4A4"])
@pytest.mark.parametrize("act_scale", ["tensor", "token"])
def test_ste_grads_equal_linear_at_quantized_point(tile, quantize_acts, act_scale):
    x, w = _xw()
    y, gx, gw = _grads(
        lambda a, b: qat_linear(a, b, quantize_acts=quantize_acts, tile=tile, act_scale=act_scale), x, w
    )
    wq = nvfp4.qdq(w.detach(), tile=tile)
    xq = nvfp4.qdq(x.detach(), per_token=act_scale == "token") if quantize_acts else x.detach()
    xr, wr = xq.clone().requires_grad_(), wq.clone().requires_grad_()
    yr, gxr, gwr = _grads(F.linear, xr, wr)
    assert torch.equal(y, yr)
    torch.testing.assert_close(gx, gxr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, gwr, rtol=1e-12, atol=1e-12)
    assert not torch.equal(wq, w.detach())  # the weight really was quantized


def test_qat_bias_and_dtypes_bf16():
    x, w = _xw(dtype=torch.bfloat16)
    b = torch.randn(w.shape[0], dtype=torch.bfloat16, requires_grad=True)
    y = qat_linear(x, w, bias=b)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert b.grad is not None and torch.isfinite(w.grad.float()).all()


def test_w4a4_ste_grads_at_effective_operands():
    x, w = _xw()
    y, gx, gw = _grads(lambda a, b: w4a4_linear(a, b), x, w)
    xr = nvfp4.qdq(x.detach().float()).double().requires_grad_()
    wr = nvfp4.qdq(w.detach()).clone().requires_grad_()
    yr, gxr, gwr = _grads(F.linear, xr, wr)
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)  # fp32 GEMM vs fp64 reference
    torch.testing.assert_close(gx, gxr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, gwr, rtol=1e-12, atol=1e-12)


def test_expert_stack_weights_have_one_global_scale_per_expert():
    w = torch.randn(3, 32, 64)
    w[1] *= 100.0  # experts of very different magnitudes
    q = nvfp4_quantize_weight(w)
    assert q.global_scale.shape == (3, 1, 1)
    for e in range(3):
        qe = nvfp4.quantize(w[e])
        assert torch.equal(q.codes[e], qe.codes) and torch.equal(
            q.scales[e].view(torch.uint8), qe.scales.view(torch.uint8)
        )
        assert torch.equal(q.global_scale[e].reshape(()), qe.global_scale)


@pytest.mark.parametrize("scheme", ["tensor", "row", "block"])
def test_fp8_linear_is_qdq_of_both_operands(scheme):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 256, generator=g, requires_grad=True)
    w = torch.randn(128, 256, generator=g, requires_grad=True)
    y = fp8_linear(x, w, scheme=scheme)
    wblock = (128, 128) if scheme == "block" else None
    wq = fp8.qdq(w.detach(), granularity=scheme, **({"block": wblock} if wblock else {}))
    xq = fp8.qdq(x.detach().reshape(-1, 256), granularity=scheme, **({"block": (1, 128)} if wblock else {}))
    torch.testing.assert_close(y.reshape(-1, 128), xq @ wq.T, rtol=1e-5, atol=1e-5)
    rel = (y - x.detach() @ w.detach().T).norm() / (x.detach() @ w.detach().T).norm()
    assert 0 < rel < 0.1, f"FP8 {scheme} relative error {rel:.4f}"
    y.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(10, 128).T @ xq, rtol=1e-5, atol=1e-4)


def test_no_grad_path_matches_grad_path():
    x, w = _xw(dtype=torch.float32)
    y1 = w4a4_linear(x, w, rac_ratio=0.5)
    with torch.no_grad():
        y2 = w4a4_linear(x, w, rac_ratio=0.5)
    assert torch.equal(y1.detach(), y2)


@pytest.mark.parametrize(
    "fn", [lambda x, w: qat_linear(x, w), lambda x, w: w4a4_linear(x, w)], ids=["qat", "w4a4"]
)
def test_k_not_multiple_of_16(fn):
    with pytest.raises(ValueError, match="multiple of 16"):
        fn(torch.randn(4, 40), torch.randn(8, 40))


def test_shape_mismatch_and_bad_options():
    with pytest.raises(ValueError, match="same K"):
        qat_linear(torch.randn(4, 32), torch.randn(8, 64))
    with pytest.raises(ValueError, match="valid: tensor, token"):
        w4a4_linear(torch.randn(4, 32), torch.randn(8, 32), act_scale="row")
    with pytest.raises(ValueError, match=r"rac_ratio must be in \[0, 1\]"):
        w4a4_linear(torch.randn(4, 32), torch.randn(8, 32), rac_ratio=1.2)
    with pytest.raises(ValueError, match="valid: tensor, row, block"):
        fp8_linear(torch.randn(4, 32), torch.randn(8, 32), scheme="channel")
    with pytest.raises(ValueError, match="static RAC selection needs a channel order"):
        w4a4_linear(torch.randn(4, 32), torch.randn(8, 32), rac_ratio=0.5, selection="static")
