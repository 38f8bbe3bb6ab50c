"""The fast canonical NVFP4 path (``e2m1_rne``, ``quantize``, fused ``qdq``) against a step-by-step
reference: the threshold-comparison E2M1 rounding and the cast written out as DESIGN.md section 3
states it. Bit-exact over ties, subnormals, saturation, +-0, Inf and NaN."""

import pytest
import torch

from quads.formats import nvfp4
from quads.formats.constants import F4_E2M1_MAX, F8E4M3_DTYPE, F8E4M3_MAX, FLT_MAX

NAN = float("nan")
INF = float("inf")
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ------------------------------------------------------------------------------------ the reference


def ref_e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Codes by counting the RNE thresholds passed (``nvfp4._E2M1_THRESHOLDS``); NaN -> 0 | sign."""
    mag = y.abs()
    code = torch.zeros_like(y, dtype=torch.uint8)
    for t, inclusive in nvfp4._E2M1_THRESHOLDS:
        code += (mag >= t if inclusive else mag > t).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def ref_quantize(x, tile=(1, 16), per_token=False, amax=None):
    """The canonical cast step by step (nvfp4's module docstring), with the threshold rounding."""
    xf = x.float()
    nan = torch.isnan(xf)
    mag = xf.abs().masked_fill(nan, 0.0)
    blocks = lambda t: t.reshape(*t.shape[:-1], t.shape[-1] // 16, 16)  # noqa: E731
    bamax = blocks(mag).amax(dim=-1)
    if amax is None:
        amax_t = bamax.amax(dim=-1, keepdim=True) if per_token else bamax.amax()
    else:
        amax_t = nvfp4.check_amax(amax, x, per_token)
    s_enc = nvfp4.global_encode_scale(amax_t)
    s_dec = 1.0 / s_enc
    if per_token and s_dec.dim() == 0:
        s_dec, s_enc = s_dec.expand(*xf.shape[:-1], 1).clone(), s_enc.expand(*xf.shape[:-1], 1)
    bamax = nvfp4._tile_reduce(bamax, tile)
    inv6 = torch.tensor(1.0 / F4_E2M1_MAX, dtype=torch.float32)
    scales = torch.clamp(bamax * (s_enc * inv6), -F8E4M3_MAX, F8E4M3_MAX).to(F8E4M3_DTYPE)
    enc = torch.fmin(1.0 / (scales.float() * s_dec), torch.tensor(FLT_MAX))
    y = torch.clamp(blocks(xf) * enc.unsqueeze(-1), -F4_E2M1_MAX, F4_E2M1_MAX)
    codes = ref_e2m1_round(y).reshape(xf.shape)
    codes = torch.where(nan, torch.zeros_like(codes), codes)
    block_nan = nvfp4._tile_reduce(blocks(nan).any(dim=-1).to(torch.uint8), tile).bool()
    scales = torch.where(block_nan, torch.tensor(NAN), scales.float()).to(F8E4M3_DTYPE)
    return codes, scales, s_dec


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, except that any NaN equals any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    iview = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(iview)[~na], b.view(iview)[~nb])


# ------------------------------------------------------------------------------- E2M1 rounding


def _around(values, ulps: int) -> torch.Tensor:
    """Every fp32 within ``ulps`` ulps of each value (non-negative ones)."""
    base = torch.tensor(values, dtype=torch.float32).view(torch.int32)
    offs = torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    bits = (base[:, None] + offs[None, :]).reshape(-1)
    v = bits.view(torch.float32)
    return v[(v >= 0) & torch.isfinite(v)]


def test_e2m1_rne_matches_thresholds_near_every_tie_and_grid_point():
    m = torch.cat([_around(TIES + GRID[1:] + (0.125, 0.375), 4096), torch.linspace(0, 6, 200_001)])
    m = m[m <= F4_E2M1_MAX]
    value, code = nvfp4.e2m1_rne(m)
    want = ref_e2m1_round(m)
    assert torch.equal(code.to(torch.uint8), want)
    assert torch.equal(value, nvfp4.e2m1_values(want))


def test_e2m1_rne_subnormals_and_tiny_values():
    sub = torch.arange(0, 1 << 16, dtype=torch.int32).view(torch.float32)  # fp32 subnormals from +0 up
    tiny = torch.tensor([1.1754944e-38, 2.0**-100, 2.0**-24, 1e-7, 0.2499999, 0.25, 0.2500001])
    m = torch.cat([sub, tiny])
    value, code = nvfp4.e2m1_rne(m)
    assert torch.equal(code.to(torch.uint8), ref_e2m1_round(m))
    assert torch.equal(value, nvfp4.e2m1_values(ref_e2m1_round(m)))


def test_e2m1_round_signed_saturating_and_nan():
    y = torch.cat([_around(TIES + GRID[1:], 64), torch.tensor([0.0, 6.5, 7.0, 1e30, FLT_MAX, INF])])
    y = torch.cat([y, -y, torch.tensor([NAN, -NAN])])
    assert torch.equal(nvfp4.e2m1_round(y), ref_e2m1_round(y))


# ------------------------------------------------------------------------------- whole tensors


def _hard_tensor(seed: int, rows: int = 64, k: int = 64) -> torch.Tensor:
    """Random blocks at scales from subnormal to huge, with exact ties, zeros, -0, Inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-140, 120, (rows, k // 16, 1), generator=g).float())  # per block
    x = (torch.randn(rows, k // 16, 16, generator=g) * scale).reshape(rows, k)
    x[0, :16] = torch.tensor(TIES + (6.0, -0.25, -0.75, -5.0, 0.0, -0.0, 3.0, 1.0, 0.5))  # amax 6: ties stay ties
    x[1, :16] = torch.tensor(TIES + (6.0, 1e-45, -1e-45, 1e-40, 0.0, -0.0, 4.0, 1.0, 0.5)) * 448
    x[2, 16:32] = 0.0
    x[3, 16:32] = -0.0
    x[4, 3] = INF
    x[5, 40] = -INF
    x[6, 7] = NAN
    x[7, 0:16] = 1e-42  # subnormal fp32 inputs
    return x


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("special", ["none", "inf", "nan"])
def test_quantize_and_qdq_match_reference(seed, tile, per_token, special):
    x = _hard_tensor(seed)
    if special != "inf":
        x = torch.nan_to_num(x, nan=NAN, posinf=1.0, neginf=-2.0)
    if special != "nan":
        x = torch.nan_to_num(x, nan=0.5)
    codes, scales, s_dec = ref_quantize(x, tile=tile, per_token=per_token)
    q = nvfp4.quantize(x, tile=tile, per_token=per_token)
    assert torch.equal(nvfp4.unpack(q.codes), codes)
    assert same_bits(q.scales.float(), scales.float())
    assert same_bits(q.global_scale, s_dec)
    ref = nvfp4.dequantize(nvfp4.NVFP4Tensor(nvfp4.pack(codes), scales, s_dec, x.shape, x.dtype, tuple(tile)))
    assert same_bits(nvfp4.qdq(x, tile=tile, per_token=per_token), ref)
    assert same_bits(nvfp4.dequantize(q), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_inputs_and_output_dtype(dtype):
    x = torch.nan_to_num(_hard_tensor(7), nan=0.0, posinf=3.0, neginf=-3.0).clamp(-6e4, 6e4).to(dtype)
    codes, scales, s_dec = ref_quantize(x)
    q = nvfp4.quantize(x)
    assert torch.equal(nvfp4.unpack(q.codes), codes)
    ref = nvfp4.dequantize(nvfp4.NVFP4Tensor(nvfp4.pack(codes), scales, s_dec, x.shape, x.dtype))
    assert same_bits(nvfp4.qdq(x, dtype=torch.float32), ref)
    assert same_bits(nvfp4.qdq(x), ref.to(dtype))


@pytest.mark.parametrize("amax", [0.0, 1e-30, 3.0, 1e30, INF])
def test_caller_amax_matches_reference(amax):
    x = torch.nan_to_num(_hard_tensor(3), nan=0.0, posinf=5.0, neginf=-5.0)
    codes, scales, s_dec = ref_quantize(x, amax=amax)
    q = nvfp4.quantize(x, amax=amax)
    assert torch.equal(nvfp4.unpack(q.codes), codes)
    assert same_bits(q.scales.float(), scales.float())
    ref = nvfp4.dequantize(nvfp4.NVFP4Tensor(nvfp4.pack(codes), scales, s_dec, x.shape, x.dtype))
    assert same_bits(nvfp4.qdq(x, amax=amax), ref)


def test_non_contiguous_and_batched_input():
    x = torch.nan_to_num(_hard_tensor(5, rows=32, k=128), nan=0.0, posinf=1.0, neginf=-1.0)
    xt = x.reshape(2, 16, 128).transpose(0, 1)  # [16, 2, 128], not contiguous
    codes, scales, s_dec = ref_quantize(xt.contiguous(), per_token=True)
    q = nvfp4.quantize(xt, per_token=True)
    assert torch.equal(nvfp4.unpack(q.codes), codes)
    assert same_bits(nvfp4.qdq(xt, per_token=True), nvfp4.qdq(xt.contiguous(), per_token=True))
