"""FP8 E4M3 reference (quads.formats.fp8): exact casts and scales, error bounds, _scaled_mm convention."""

import math

import pytest
import torch

from quads.formats import fp8
from quads.formats.constants import F8E4M3_DTYPE, F8E4M3_MAX

E4M3_HALF_ULP_REL = 2.0**-4  # 3 mantissa bits: RNE error <= 2^-4 of the value (normals)
E4M3_HALF_MIN_SUB = 2.0**-10  # subnormal step 2^-9: RNE error <= 2^-10 (in units of the scale)


def _f8(vals):
    return torch.tensor(vals, dtype=torch.float32).to(F8E4M3_DTYPE).float()


# ---------------------------------------------------------------- exact


@pytest.mark.parametrize(
    "x, expected",
    [
        (448.0, 448.0),
        (460.0, 448.0),  # RNE to 448 anyway
        (470.0, 448.0),  # torch's plain cast gives NaN here (> 464); the saturating cast clamps
        (1e30, 448.0),
        (-1e30, -448.0),
        (math.inf, 448.0),
        (-math.inf, -448.0),
        (2.0**-6, 2.0**-6),  # min normal
        (2.0**-9, 2.0**-9),  # min subnormal
        (2.0**-10, 0.0),  # tie between 0 and 2^-9 -> even (0)
        (3 * 2.0**-10, 2.0**-8),  # tie between 2^-9 (odd) and 2^-8 (even) -> 2^-8
        (1.0625, 1.0),  # tie between 1 and 1.125 -> 1 (even mantissa)
        (1.1875, 1.25),  # tie between 1.125 and 1.25 -> 1.25
    ],
    ids=lambda v: repr(v),
)
def test_saturating_cast_exact(x, expected):
    got = fp8.saturating_cast(torch.tensor([x])).float()
    assert torch.equal(got, torch.tensor([expected])), (x, got.item(), expected)


def test_saturating_cast_keeps_nan_and_signed_zero():
    got = fp8.saturating_cast(torch.tensor([math.nan, -0.0, 0.0]))
    assert torch.isnan(got.float()[0])
    assert got.view(torch.uint8)[1].item() == 0x80 and got.view(torch.uint8)[2].item() == 0x00


def test_tensor_scale_exact():
    # amax 896 -> scale 896/448 = 2 exactly; 896/2 = 448, 3/2 = 1.5, -1/2 = -0.5 all exact in E4M3.
    x = torch.tensor([[896.0, 3.0], [-1.0, 0.0]])
    q = fp8.quantize(x)
    assert q.scale.shape == torch.Size([]) and q.scale.item() == 2.0
    assert torch.equal(q.data.float(), torch.tensor([[448.0, 1.5], [-0.5, 0.0]]))
    assert torch.equal(fp8.dequantize(q), x)


def test_row_scales_exact():
    # row 0: amax 448 -> scale 1; row 1: amax 4.375 -> scale 4.375/448 = 2^-6 * 0.625 (exact in fp32);
    # row 2 all zero -> scale 1.0 (documented), data zeros.
    x = torch.tensor([[448.0, -224.0, 1.0, 0.5], [4.375, 0.0, -4.375, 1.0], [0.0, 0.0, -0.0, 0.0]])
    q = fp8.quantize(x, granularity="row")
    assert q.scale.shape == (3, 1)
    assert torch.equal(q.scale.squeeze(1), torch.tensor([1.0, 4.375 / 448.0, 1.0]))
    assert torch.equal(q.data.float()[0], torch.tensor([448.0, -224.0, 1.0, 0.5]))
    assert q.data.float()[1, 0].item() == 448.0 and q.data.float()[1, 2].item() == -448.0
    # 1 / (4.375/448) = 102.4 -> E4M3 grid near 102.4 has step 8 (64..128): 104 (RNE of 102.4)
    assert q.data.float()[1, 3].item() == 104.0
    assert torch.equal(q.data.view(torch.uint8)[2], torch.tensor([0, 0, 0x80, 0], dtype=torch.uint8))


def test_block_1x128_scales_exact():
    x = torch.zeros(2, 256)
    x[0, 5] = -896.0  # block (0, 0): amax 896 -> scale 2
    x[0, 200] = 7.0  # block (0, 1): amax 7 -> scale 7/448 = 1/64
    x[1, 130] = 448.0  # block (1, 1): scale 1; block (1, 0) all zero -> scale 1.0
    q = fp8.quantize(x, granularity="block", block=(1, 128))
    assert q.scale.shape == (2, 2)
    assert torch.equal(q.scale, torch.tensor([[2.0, 1.0 / 64], [1.0, 1.0]]))
    assert q.data.float()[0, 5].item() == -448.0 and q.data.float()[0, 200].item() == 448.0
    assert torch.equal(fp8.dequantize(q), x)


def test_block_128x128_scales_exact():
    x = torch.zeros(256, 128)
    x[3, 7] = 44.8  # tile (0, 0): amax 44.8 -> scale 0.1 (fp32 of 44.8/448)
    x[200, 100] = -0.875  # tile (1, 0)
    q = fp8.quantize(x, granularity="block", block=(128, 128))
    assert q.scale.shape == (2, 1)
    assert torch.equal(q.scale, torch.tensor([[44.8 / 448.0], [0.875 / 448.0]], dtype=torch.float32))
    assert q.data.float()[3, 7].item() == 448.0 and q.data.float()[200, 100].item() == -448.0


def test_nonfinite_policy():
    # NaN -> NaN, +-Inf -> +-448, and neither enters the amax: the finite values keep their scale.
    x = torch.tensor([[math.nan, 2.0, -1.0, 0.5], [math.inf, -math.inf, 0.0, 0.0]])
    q = fp8.quantize(x, granularity="row")
    assert torch.equal(q.scale.squeeze(1), torch.tensor([2.0 / 448.0, 1.0]))
    assert torch.isnan(q.data.float()[0, 0])
    assert torch.equal(q.data.float()[1], torch.tensor([448.0, -448.0, 0.0, 0.0]))
    dq = fp8.dequantize(q)
    assert torch.equal(dq[0, 1:], x[0, 1:])


# ---------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    "granularity, block, shape",
    [
        ("tensor", (1, 128), (5, 64)),
        ("row", (1, 128), (3, 7, 128)),
        ("block", (1, 128), (3, 7, 256)),
        ("block", (128, 128), (256, 384)),
    ],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_round_trip_error_bound(granularity, block, shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))).to(dtype)
    q = fp8.quantize(x, granularity=granularity, block=block)
    dq = fp8.dequantize(q, torch.float64)
    x64 = x.double()
    s = fp8._expand_scale(q.scale.double(), q.shape, granularity, q.block)
    if granularity == "block":
        s = (fp8._group_view(torch.ones_like(x64), *q.block) * s).reshape(x64.shape)
    s = torch.broadcast_to(s, x64.shape)
    bound = torch.maximum(E4M3_HALF_ULP_REL * x64.abs(), E4M3_HALF_MIN_SUB * s) * (1 + 2.0**-20)
    err = (dq - x64).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{granularity} {block} {shape} {dtype}: error exceeds half an E4M3 step by {worst}"
    assert q.scale.dtype == torch.float32 and torch.isfinite(q.scale).all()
    assert q.data.float().abs().max().item() <= F8E4M3_MAX


def test_qdq_returns_input_dtype():
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert fp8.qdq(x, granularity="row").dtype == torch.bfloat16


# ---------------------------------------------------------------- _scaled_mm convention


def _dequantize_fp64(q):
    s = q.scale.double()
    if q.granularity == "block":
        br, bc = q.block
        s = s.repeat_interleave(bc, dim=-1)
        s = s.repeat_interleave(br, dim=-2) if br > 1 else s
    return q.data.double() * s


@pytest.mark.parametrize(
    "ga, gb",
    [(("tensor", (1, 128)), ("tensor", (1, 128))), (("row", (1, 128)), ("row", (1, 128))),
     (("block", (1, 128)), ("block", (128, 128))), (("block", (1, 128)), ("block", (1, 128)))],
    ids=lambda v: f"{v[0]}{v[1] if v[0] == 'block' else ''}",
)
def test_scaled_mm_convention(ga, gb):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(48, 256, generator=g), torch.randn(128, 256, generator=g)
    a = fp8.quantize(x, granularity=ga[0], block=ga[1])
    b = fp8.quantize(w, granularity=gb[0], block=gb[1])
    # exact dequantization in fp64 (E4M3 value * fp32 scale has <= 28 significant bits)
    ref = _dequantize_fp64(a) @ _dequantize_fp64(b).T
    got = fp8.scaled_mm_reference(a, b, torch.float64)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    got32 = fp8.scaled_mm_reference(a, b, torch.float32)
    torch.testing.assert_close(got32.double(), ref, rtol=1e-5, atol=1e-4)
    if ga[0] != "block":
        # the literal _scaled_mm formula with scale_a [M, 1] / scale_b [1, N] (or scalars)
        sa = a.scale if a.scale.dim() == 0 else a.scale  # [M, 1]
        sb = b.scale.t() if b.scale.dim() else b.scale  # [1, N]
        literal = (a.data.double() @ b.data.double().T) * sa.double() * sb.double()
        torch.testing.assert_close(literal, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["tensor", "row", "block"])
def test_scaled_mm_on_gpu_matches_reference(gran):
    """The documented call ``_scaled_mm(a.data, b.data.t(), a.scale, b.scale.t())`` computes ``a @ b.T``.

    Hopper's FP8 MMA accumulates with fewer bits than fp32 (seen here: ~4e-4 relative on K=512),
    so the bound is 2^-8 of the sum of |terms|; a wrong scale convention would be off by orders of
    magnitude. For blocks, cuBLAS wants the activation scale outer-dim-major.
    """
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores (sm89+) for torch._scaled_mm")
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(256, 512, generator=g).cuda(), torch.randn(384, 512, generator=g).cuda()
    if gran == "block":
        a = fp8.quantize(x, granularity="block", block=(1, 128))
        b = fp8.quantize(w, granularity="block", block=(128, 128))
        scale_a = a.scale.t().contiguous().t()  # [M, K/128], outer-dim-major
    else:
        a, b = fp8.quantize(x, granularity=gran), fp8.quantize(w, granularity=gran)
        scale_a = a.scale
    out = torch._scaled_mm(a.data, b.data.t(), scale_a=scale_a, scale_b=b.scale.t(), out_dtype=torch.float32)
    ref = fp8.scaled_mm_reference(a, b, torch.float32)
    abs_a = fp8.FP8Tensor(a.data.float().abs().to(a.data.dtype), a.scale, a.shape, a.dtype, a.granularity, a.block)
    abs_b = fp8.FP8Tensor(b.data.float().abs().to(b.data.dtype), b.scale, b.shape, b.dtype, b.granularity, b.block)
    bound = fp8.scaled_mm_reference(abs_a, abs_b, torch.float32) * 2.0**-8
    worst = ((out - ref).abs() - bound).max().item()
    assert worst <= 0, f"{gran}: _scaled_mm differs from the reference by more than 2^-8 of sum|terms| ({worst})"


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "x, kwargs, match",
    [
        (torch.ones(4, 128, dtype=torch.int32), {}, "floating-point.*int32"),
        (torch.ones(4, 128, dtype=torch.complex64), {}, "floating-point.*complex64"),
        (torch.ones(0, 128), {}, "non-empty"),
        (torch.ones(4, 100), {"granularity": "block"}, "multiple of 128.*pad K"),
        (torch.ones(100, 128), {"granularity": "block", "block": (128, 128)}, "N a multiple of 128"),
        (torch.ones(4, 128), {"granularity": "channel"}, "unknown FP8 granularity 'channel'"),
        (torch.ones(4, 128), {"granularity": "block", "block": (0, 128)}, "positive ints"),
    ],
    ids=["int", "complex", "empty", "K", "N", "granularity", "block"],
)
def test_bad_input(x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8.quantize(x, **kwargs)
