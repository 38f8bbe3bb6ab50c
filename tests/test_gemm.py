"""quads.model.gemm: BF16 products on CPUs without a native BF16 GEMM go through FP32 with the numbers
of a BF16 GEMM (FP32 accumulation, one rounding to BF16); the route is forced both ways here, so the
tests do not depend on the CPU's instruction set."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from quads.model import gemm


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(gemm, "native_bf16_gemm", lambda: False)


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|BF16 GEMM - exact| bound: half a BF16 ulp of the result (2^-9 relative) plus the FP32 summation
    error (K * 2^-24 * sum |a||b|), with a factor 2 of slack for the summation-order difference."""
    ad, bd = a.double(), b.double()
    exact = ad @ bd
    k = a.shape[-1]
    return exact, 2 * (exact.abs() * 2.0**-9 + k * 2.0**-24 * (ad.abs() @ bd.abs()))


def test_route_decision(no_native, monkeypatch):
    bf, f32 = torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2)
    assert gemm.fp32_route(bf, bf)
    assert not gemm.fp32_route(f32, f32)
    assert not gemm.fp32_route(bf.double(), bf.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gemm.fp32_route(f32, f32)
        assert not gemm.fp32_route(f32.double(), f32.double())  # autocast leaves fp64 alone
    monkeypatch.setattr(gemm, "native_bf16_gemm", lambda: True)
    assert not gemm.fp32_route(bf, bf)


def test_linear_is_fp32_product_rounded_once(no_native):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g).bfloat16()
    y = gemm.linear(x, w)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (x.float() @ w.float().T).bfloat16())
    exact, tol = _bound(x, w.T)
    assert bool(((y.double() - exact).abs() <= tol).all())
    ref = F.linear(x, w)  # torch's BF16 GEMM (oneDNN or its fallback kernel): the same bound
    assert bool(((ref.double() - exact).abs() <= tol).all())


def test_bmm_and_matmul(no_native):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 9, 32, generator=g).bfloat16()
    b = torch.randn(3, 32, 16, generator=g).bfloat16()
    assert torch.equal(gemm.bmm(a, b), torch.bmm(a.float(), b.float()).bfloat16())
    assert torch.equal(gemm.matmul(a[0], b[0]), (a[0].float() @ b[0].float()).bfloat16())
    af, bf = a.float(), b.float()  # FP32 operands take torch's own op
    assert torch.equal(gemm.bmm(af, bf), torch.bmm(af, bf))


def test_autocast_forward_and_grads_match_torch(no_native):
    """Under CPU autocast: operands rounded to BF16, BF16 output, gradients in each input's dtype that
    agree with torch's BF16 path to within the BF16 GEMM bound."""
    g = torch.Generator().manual_seed(2)
    lin = gemm.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=g))
        lin.bias.copy_(torch.randn(32, generator=g))
    x = torch.randn(20, 64, generator=g, requires_grad=True)
    gy = torch.randn(20, 32, generator=g)
    outs = []
    for route in (True, False):
        x.grad = lin.weight.grad = lin.bias.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = gemm.linear(x, lin.weight, lin.bias, fp32=route)
        (y.float() * gy).sum().backward()
        outs.append((y, x.grad.clone(), lin.weight.grad.clone()))
    (y1, gx1, gw1), (y0, gx0, gw0) = outs
    assert y1.dtype == y0.dtype == torch.bfloat16
    assert gx1.dtype == gx0.dtype == torch.float32 and gw1.dtype == gw0.dtype == torch.float32
    xb, wb, gb = x.detach().bfloat16(), lin.weight.detach().bfloat16(), gy.bfloat16()
    # the bias adds one more BF16 rounding on torch's path: 2 ulps of slack on the forward
    exact, tol = _bound(xb, wb.T)
    exact = exact + lin.bias.detach().bfloat16().double()
    for y in (y1, y0):
        assert bool(((y.double() - exact).abs() <= 2 * tol + exact.abs() * 2.0**-8).all())
    for got in (gx1, gx0):  # dL/dx = gy @ W
        exact, tol = _bound(gb, wb)
        assert bool(((got.double() - exact).abs() <= tol).all())
    for got in (gw1, gw0):  # dL/dW = gy.T @ x
        exact, tol = _bound(gb.T, xb)
        assert bool(((got.double() - exact).abs() <= tol).all())


class _GemmDtypes(TorchDispatchMode):
    """Records the operand dtypes of every GEMM dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["linear", "matmul", "matmul-3d", "bmm"])
def test_backward_under_autocast_keeps_fp32_gemms(no_native, op):
    """A backward run under CPU autocast (as AOTAutograd traces a compiled region's backward) computes
    the FP32 route's gradients with FP32 GEMMs, bit-equal to the backward run outside autocast: on a CPU
    without a native BF16 GEMM, autocast would otherwise send them to the slow BF16 kernel, and the
    compiled step's gradients would differ from the plain step's."""
    g = torch.Generator().manual_seed(3)
    a_shape, b_shape = {"linear": ((2, 5, 32), (24, 32)), "matmul": ((7, 32), (32, 24)),
                        "matmul-3d": ((2, 5, 32), (32, 24)), "bmm": ((3, 5, 32), (3, 32, 24))}[op]
    a0, b0 = torch.randn(*a_shape, generator=g), torch.randn(*b_shape, generator=g)
    fn = {"linear": gemm.linear, "matmul": gemm.matmul, "matmul-3d": gemm.matmul, "bmm": gemm.bmm}[op]
    grads = []
    for inside in (False, True):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(a, b)
            gy = torch.linspace(-1, 1, y.numel()).view(y.shape)
            mode = _GemmDtypes()
            if inside:
                with mode:
                    (y.float() * gy).sum().backward()
        if not inside:
            with mode:
                (y.float() * gy).sum().backward()
        assert mode.seen and all(d == (torch.float32, torch.float32) for d in mode.seen), mode.seen
        grads.append((a.grad, b.grad))
    (ga0, gb0), (ga1, gb1) = grads
    assert ga0.dtype == gb0.dtype == torch.float32
    assert torch.equal(ga0, ga1) and torch.equal(gb0, gb1)
    assert torch.equal(ga0, ga0.bfloat16().float())  # each gradient rounded to BF16 once, as a BF16 GEMM's


def test_fp32_route_refuses_shapes_it_has_no_backward_for(no_native):
    with pytest.raises(ValueError, match="FP32 route multiplies"):
        gemm.bmm(torch.randn(2, 3, 4).bfloat16(), torch.randn(1, 4, 5).bfloat16())
    with pytest.raises(ValueError, match="FP32 route multiplies"):
        gemm.matmul(torch.randn(2, 3, 4).bfloat16(), torch.randn(2, 2, 4, 5).bfloat16())


def test_linear_module_is_an_nn_linear():
    lin = gemm.Linear(16, 8, bias=False)
    assert isinstance(lin, torch.nn.Linear)
    assert list(lin.state_dict()) == ["weight"]
    x = torch.randn(4, 16)
    assert torch.equal(lin(x), F.linear(x, lin.weight))
