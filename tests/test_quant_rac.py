"""Residual Activation Compensation: layout, ratio 0 / ratio 1 limits, monotone error, batch invariance.

w4a4_linear computes the factored form (quads.quant.factored); the fp32 emulation over K + |S|
(rac_gemm_operands) is its reference, within the fp32 accumulation bound."""

import pytest
import torch
import torch.nn.functional as F

from quads.formats import nvfp4
from quads.quant import StaticChannelSelector, qat_linear, rac_channels, w4a4_linear
from quads.quant.rac import rac_operands, select_dynamic
from quads.quant.w4a4 import rac_gemm_operands

RATIOS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)


def _acts(kind: str, t=64, k=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(t, k, generator=g)
    if kind == "student_t":
        chi2 = torch.randn(3, t, k, generator=g).square().mean(0)  # Student-t with 3 degrees of freedom
        return 0.5 * torch.randn(t, k, generator=g) / chi2.sqrt()
    x = torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:6]] *= 40.0  # outlier channels
    return x


@pytest.mark.parametrize(
    "k, ratio, n",
    [(64, 0.0, 0), (64, 0.5, 32), (64, 0.1, 16), (64, 0.125, 16), (256, 0.3, 80), (256, 0.28, 64),
     (256, 0.2813, 80), (48, 1.0, 48), (16, 0.01, 16), (4096, 0.5, 2048)],
)  # fmt: skip
def test_rac_channels_rounds_to_nearest_multiple_of_16(k, ratio, n):
    assert rac_channels(k, ratio) == n


def _fp32_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gamma_(K+2) * |a| @ |b|.T: how far an fp32 evaluation of ``a @ b.T`` (any summation order, plus the
    global-scale products of the factored form) may be from the exact value."""
    k = a.shape[-1] + 2
    return k * 2.0**-24 / (1 - k * 2.0**-24) * (a.double().abs() @ b.double().abs().T)


def test_ratio_zero_is_plain_w4a4():
    x, w = _acts("normal"), torch.randn(48, 256)
    y0 = w4a4_linear(x, w, rac_ratio=0.0)
    q, wq = nvfp4.quantize(x), nvfp4.qdq(w)
    units = nvfp4.dequantize(nvfp4.NVFP4Tensor(q.codes, q.scales, torch.ones(()), q.shape, q.dtype))
    assert torch.equal(y0, F.linear(units, wq) * q.global_scale)  # the factored form: g * (U @ Wq.T)
    plain = F.linear(nvfp4.qdq(x), wq)  # the fp32 emulation
    assert ((y0.double() - plain.double()).abs() <= 2 * _fp32_bound(nvfp4.qdq(x), wq)).all()
    qat = qat_linear(x, w, quantize_acts=True)
    assert ((y0.double() - qat.double()).abs() <= 2 * _fp32_bound(nvfp4.qdq(x), wq)).all()


@pytest.mark.parametrize("act_scale", ["tensor", "token"])
@pytest.mark.parametrize("ratio", [0.125, 0.5, 1.0])
def test_concatenated_gemm_equals_two_term_formula(ratio, act_scale):
    x, w = _acts("student_t", t=24), torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    y = w4a4_linear(x, w, rac_ratio=ratio, act_scale=act_scale)
    per_token = act_scale == "token"
    xq = nvfp4.qdq(x, per_token=per_token)
    r = x - xq
    n = rac_channels(256, ratio)
    s = torch.argsort(r.square().sum(0), descending=True, stable=True)[:n]
    rq = nvfp4.qdq(r[:, s], per_token=per_token)
    wq = nvfp4.qdq(w)
    a, b = torch.cat([xq, rq], 1), torch.cat([wq, wq[:, s]], 1)
    concat = a @ b.T  # the fp32 emulation: one GEMM over K + |S|; the implementation is its factored form
    assert ((y.double() - concat.double()).abs() <= 2 * _fp32_bound(a, b)).all()
    two_term = xq.double() @ wq.double().T + rq.double() @ wq[:, s].double().T
    torch.testing.assert_close(y.double(), two_term, rtol=1e-5, atol=1e-4)
    eff = xq.index_add(1, s, rq)  # duplicating weight columns == adding the residual to those channels
    torch.testing.assert_close(y.double(), eff.double() @ wq.double().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["normal", "student_t", "outliers"])
@pytest.mark.parametrize("act_scale", ["tensor", "token"])
def test_error_non_increasing_in_ratio(kind, act_scale):
    x = _acts(kind)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ nvfp4.qdq(w).double().T  # the trainer's X @ QDQ(W).T in fp64
    errs = []
    for ratio in RATIOS:
        y = w4a4_linear(x, w, rac_ratio=ratio, act_scale=act_scale).double()
        errs.append(((y - ref).norm() / ref.norm()).item())
    msg = f"{kind}/{act_scale}: rel errors {dict(zip(RATIOS, [f'{e:.2e}' for e in errs]))}"
    assert all(b <= a for a, b in zip(errs, errs[1:])), msg
    assert errs[-1] < errs[0] / 4, msg


def test_static_selection_is_batch_invariant():
    k = 128
    w = torch.randn(32, k, generator=torch.Generator().manual_seed(2))
    order = torch.randperm(k, generator=torch.Generator().manual_seed(5))
    a, b = _acts("outliers", t=8, k=k, seed=1), _acts("student_t", t=8, k=k, seed=2)
    batch1 = torch.cat([a, b])
    batch2 = torch.cat([a, 10 * torch.randn(8, k)])  # same first 8 tokens, different batch-mates
    kw = dict(rac_ratio=0.5, selection="static", act_scale="token", static_channels=order)
    y1, y2 = w4a4_linear(batch1, w, **kw), w4a4_linear(batch2, w, **kw)
    torch.testing.assert_close(y1[:8], y2[:8], rtol=0, atol=1e-6)
    op1 = rac_operands(batch1, n=64, selection="static", act_scale="token", static_order=order)
    op2 = rac_operands(batch2, n=64, selection="static", act_scale="token", static_order=order)
    assert torch.equal(op1[0][:8], op2[0][:8]) and torch.equal(op1[1][:8], op2[1][:8])  # bitwise operands
    # dynamic selection depends on the batch-mates
    d1 = rac_operands(batch1, n=64, selection="dynamic", act_scale="token")[2]
    d2 = rac_operands(batch2, n=64, selection="dynamic", act_scale="token")[2]
    assert not torch.equal(d1, d2)


def test_dynamic_selection_picks_largest_residuals():
    r = torch.zeros(4, 64)
    r[:, 10] = 3.0
    r[:, 50] = 2.0
    r[:, 7] = 1.0
    assert select_dynamic(r, 3).tolist() == [10, 50, 7]
    assert select_dynamic(r, 5).tolist() == [10, 50, 7, 0, 1]  # ties: lower channel first


def test_static_selector_calibrates_and_refreshes():
    sel = StaticChannelSelector(groups=2, k=32)
    r = torch.zeros(5, 32)
    r[:, 3], r[:, 20] = 1.0, 2.0
    sel.observe(1, r)
    assert sel.channels(1, 2).tolist() == [0, 1]  # frozen until refresh
    prior = torch.arange(64.0).reshape(2, 32)
    assert sel.refresh(prior=prior) == 2
    assert sel.channels(1, 2).tolist() == [20, 3]
    assert sel.channels(0, 2).tolist() == [31, 30]  # no data: the prior's order
    assert sel.count.sum() == 0 and sel.sq_sum.abs().sum() == 0
    sel.observing = False
    sel.observe(0, r)
    assert sel.count.sum() == 0


def test_w_q_argument_is_used_as_is():
    x, w = _acts("normal", t=8, k=64), torch.randn(16, 64)
    wq = nvfp4.qdq(w.bfloat16())
    y = w4a4_linear(x, w, rac_ratio=0.25, w_q=wq)
    a, b = rac_gemm_operands(*rac_operands(x, n=16), wq)
    assert ((y.double() - (a @ b.T).double()).abs() <= 2 * _fp32_bound(a, b)).all()
    y_master = rac_gemm_operands(*rac_operands(x, n=16), nvfp4.qdq(w))
    assert not ((y.double() - (y_master[0] @ y_master[1].T).double()).abs() <= 2 * _fp32_bound(a, b)).all()
