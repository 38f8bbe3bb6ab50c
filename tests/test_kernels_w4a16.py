"""The W4A16 GEMMs over the packed NVFP4 layout (``quads.kernels.w4a16``) against their references.

Layout round trip byte for byte, decoded weights bit for bit against ``nvfp4.dequantize(q, bf16)``,
GEMMs within fp32 summation-order tolerance of ``x @ dequantize(q, bf16).T``. Without a GPU the
kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by conftest.py) at tiny sizes;
the ``gpu`` tests repeat them at the benchmark's sizes on CUDA. Last, the rollout layers: W4A16 on the
kernel path gives the reference path's result, and follows a weight refresh in place.
"""

import dataclasses
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install quads[kernels])")
import triton.language as tl  # noqa: E402

from quads.formats import nvfp4  # noqa: E402
from quads.kernels import dispatch, tuning, w4a16  # noqa: E402
from quads.kernels._common import interpreted, interpreter_on  # noqa: E402
from quads.model import moe  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA and not interpreter_on():
    pytest.skip("kernel modules were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

gpu = pytest.mark.skipif(not HAS_CUDA, reason="real-size kernel checks need a CUDA GPU (sm_90); none here")

# as tests/test_kernels.py: fp32 accumulation of the same exact products in another order, then one
# BF16 rounding of the output; 1e-5 relative (Frobenius) on the fp32 sums. The outputs here are BF16,
# so a sum that lands next to a BF16 rounding boundary may round to the neighbouring BF16 value: the
# comparison is of the fp32-accumulated outputs before that rounding where possible (out_fp32 below),
# and of the BF16 outputs with one BF16 ulp (2**-8 relative) per element otherwise.
GEMM_RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _bf16_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """BF16 outputs of two fp32 sums that differ by summation order: equal up to one BF16 ulp each."""
    a, b = a.double(), b.double()
    tol = b.abs() * 2.0**-7 + 1e-30 + b.abs().amax() * 1e-5
    bad = (a - b).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ by more than 1 bf16 ulp; max rel " \
        f"{float(((a - b).abs() / b.abs().clamp_min(1e-30)).max()):.2e}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal BF16 bit patterns, NaN where the other is NaN (a NaN's payload and sign are not the format's)."""
    nan = b.isnan()
    return a.shape == b.shape and torch.equal(a.isnan(), nan) and torch.equal(
        a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def _weight(shape, seed=0, experts_amax=False):
    """NVFP4 weight with scales over 5 decades (subnormal E4M3 scales included) and every E2M1 code."""
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 2, k)
    if len(shape) == 3:
        amax = w.abs().amax(dim=(-2, -1), keepdim=True) * (torch.rand(shape[0], 1, 1, generator=g) + 0.5)
        return nvfp4.quantize(w.bfloat16().to(DEV), amax=amax.to(DEV))
    return nvfp4.quantize(w.bfloat16().to(DEV))


def _x(m, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).bfloat16().to(DEV)


# ------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("shape", [(48, 256), (16, 80), (3, 32, 208), (2, 8, 64)], ids=str)
def test_layout_round_trip_byte_exact(shape):
    q = _weight(shape)
    p = w4a16.pack(q)
    assert p.codes.dtype == torch.int32 and p.scales.dtype == torch.int32
    assert p.codes.shape[-3:] == (-(-shape[-1] // 64), shape[-2], 8)
    back = w4a16.unpack(p)
    assert torch.equal(back.codes, q.codes)
    assert torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8))
    assert back.global_scale.shape == q.global_scale.shape
    assert torch.equal(back.global_scale, q.global_scale)
    assert (back.shape, back.dtype, back.tile, back.mode) == (q.shape, q.dtype, q.tile, q.mode)
    # the same layout in freshly allocated tensors (default strides, as a store that loads copy into keeps)
    fresh = dataclasses.replace(p, codes=torch.empty(p.codes.shape, dtype=torch.int32, device=DEV).copy_(p.codes),
                                scales=torch.empty(p.scales.shape, dtype=torch.int32, device=DEV).copy_(p.scales))
    assert torch.equal(w4a16.unpack(fresh).codes, q.codes)
    assert torch.equal(w4a16.unpack(fresh).scales.view(torch.uint8), q.scales.view(torch.uint8))


@pytest.mark.parametrize("shape", [(48, 256), (16, 80), (3, 32, 208)], ids=str)
def test_decoded_weights_bit_exact(shape):
    q = _weight(shape)
    q.scales.view(torch.uint8)[..., 1, 2] = 0x7F  # a NaN block scale decodes to NaN, as the reference
    want = nvfp4.dequantize(q, torch.bfloat16)
    got = w4a16.dequantize(w4a16.pack(q))
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    got = w4a16.dequantize_bf16(w4a16.pack(q))  # the kernels' decode, stored
    assert got.isnan().any() and _same_bits(got, want)


def test_pack_refuses_what_it_cannot_hold():
    q = nvfp4.quantize(torch.randn(4, 32, 64).bfloat16(), per_token=True)
    with pytest.raises(ValueError, match="one global scale per weight"):
        w4a16.pack(q)
    q = nvfp4.quantize(torch.randn(32, 64).bfloat16())
    q.scales = nvfp4.swizzle_scales(q.scales)
    with pytest.raises(ValueError, match="linear scales"):
        w4a16.pack(q)


@pytest.mark.parametrize("kernel", [None, "gemv"])
def test_kernel_decode_bit_exact(kernel):
    """The kernel's decode, isolated: x = identity rows, so y = the decoded weight's columns exactly
    (each output is one product x_k * w_k plus exact zeros; a -0.0 weight sums to +0.0). 128 rows:
    cuBLAS over ``dequantize_bf16`` by default, the GEMV kernel's FMAs in 8 M tiles (2 K tiles) when asked."""
    q = _weight((32, 128))
    y = w4a16.gemm(torch.eye(128, dtype=torch.bfloat16, device=DEV), w4a16.pack(q), kernel=kernel)
    want = nvfp4.dequantize(q, torch.bfloat16).T + 0.0
    assert torch.equal(y.view(torch.int16), want.contiguous().view(torch.int16))


def _every_code_and_scale(global_scale_bits: int, nan_scales: bool = False) -> nvfp4.NVFP4Tensor:
    """[254, 16]: row r has the r-th finite E4M3 scale byte and the 16 E2M1 codes in order ([256, 16] with
    ``nan_scales``: the NaN bytes 0x7F / 0xFF too). ``global_scale_bits``: the fp32 global scale's bits, as an
    unsigned 32-bit number."""
    b = torch.arange(256, dtype=torch.int32)
    b = (b if nan_scales else b[(b & 0x7F) != 0x7F]).to(torch.uint8)
    c = torch.arange(16, dtype=torch.uint8)
    codes = (c[0::2] | (c[1::2] << 4)).expand(len(b), 8).contiguous()
    bits = global_scale_bits - (1 << 32) if global_scale_bits >= 1 << 31 else global_scale_bits
    g = torch.tensor([bits], dtype=torch.int32).view(torch.float32).reshape(())
    return nvfp4.NVFP4Tensor(codes=codes.to(DEV), scales=b[:, None].view(torch.float8_e4m3fn).to(DEV),
                             global_scale=g.to(DEV), shape=torch.Size((len(b), 16)), dtype=torch.bfloat16)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's fp32 inf, wanted
@pytest.mark.parametrize("gbits", [0x3A07CB7C, 0x3F800000, 0x7E7FFFFF, 0x00012345],
                         ids=["g=5.18e-4", "g=1", "g=8.5e37", "g=1.0e-40"])  # fmt: skip
def test_kernel_decode_every_code_and_scale(gbits):
    """Every (E2M1 code, finite E4M3 scale) pair under a global scale where the order of the two fp32
    products matters: ``e2m1 * (s * g)`` rounds differently from the reference's ``(e2m1 * s) * g`` for
    180 of these 4064 weights after the BF16 cast, so only the reference's order passes. Two more global
    scales take the products out of the normal range: 8.5e37 (1760 of them overflow to inf, and both
    other orders of the products differ from the reference in about 200 places) and a subnormal one
    (1792 subnormal products)."""
    q = _every_code_and_scale(gbits)
    want = nvfp4.dequantize(q, torch.bfloat16)
    p = w4a16.pack(q)
    assert torch.equal(w4a16.dequantize(p).view(torch.int16), want.view(torch.int16))
    assert torch.equal(w4a16.dequantize_bf16(p).view(torch.int16), want.view(torch.int16))
    if want.isinf().any() or ((want != 0) & (want.abs() < 2.0**-126)).any():
        return  # no GEMM check here: the identity's zeros times inf are NaN, matmuls may flush subnormals
    for kernel in ("tiled", "gemv"):
        y = w4a16.gemm(torch.eye(16, dtype=torch.bfloat16, device=DEV), p, kernel=kernel)
        assert torch.equal(y.view(torch.int16), (want.T.contiguous() + 0.0).view(torch.int16)), kernel


def _prmt_reference(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` in its generic mode, as the ISA describes it: the 8 bytes {b, a} numbered from a's
    low byte; byte j of the result is byte ``sel[4j+2:4j]``, or its msb copied to all 8 bits when
    ``sel`` bit 4j+3 is set (as an unsigned 32-bit value)."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for j in range(4):
        nib = (sel >> 4 * j) & 0xF
        byte = (src >> 8 * (nib & 7)) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * j
    return out


@triton.jit
def _prmt_kernel(a_ptr, b_ptr, sel_ptr, out_ptr, INTERP: tl.constexpr):
    i = tl.arange(0, 64)
    tl.store(out_ptr + i, w4a16._prmt(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(sel_ptr + i), INTERP))


def test_prmt_is_the_ptx_byte_permute():
    """The decode's byte permute: on the GPU the ``prmt.b32`` instruction, under the interpreter its
    emulation by shifts; both against the ISA's definition, on random words and selectors (replicate
    bits included) and on the decode's constant selectors."""
    assert _prmt_reference(0x33221100, 0x77665544, 0x5140) == 0x55114400
    assert _prmt_reference(0x00008000, 0, 0x0098) == 0x0000FF00  # msbs of a's bytes 0 and 1, replicated
    g = torch.Generator().manual_seed(0)
    a, b, sel = (torch.randint(-(2**31), 2**31, (64,), generator=g).to(torch.int32) for _ in range(3))
    sel[:4] = torch.tensor([0x6420, 0x7531, 0x5140, 0x7362], dtype=torch.int32)
    out = torch.empty(64, dtype=torch.int32, device=DEV)
    _prmt_kernel[(1,)](a.to(DEV), b.to(DEV), sel.to(DEV), out, INTERP=interpreted(out))
    want = [_prmt_reference(x, y, s) for x, y, s in zip(a.tolist(), b.tolist(), sel.tolist())]
    assert [v & 0xFFFFFFFF for v in out.cpu().tolist()] == want


# --------------------------------------------------------------------------------------------- GEMMs


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 64, 256, {}),
        (5, 80, 160, {"split_k": 2, "block_k": 64}),  # N, K not multiples of the tiles; split-K
        (17, 48, 384, {"block_n": 16, "block_k": 128, "split_k": 3}),  # M past one tile; uneven split
        (70, 32, 128, {"fused_max_m": 100}),  # the fused kernel's "large" bucket
        (70, 32, 128, {}),  # above w4a16_dispatch.dense: cuBLAS over dequantize_bf16
    ],
    ids=str,
)
def test_gemm_matches_reference(m, n, k, cfg):
    q = _weight((n, k))
    p = w4a16.pack(q)
    x = _x(m, k)
    got = w4a16.gemm(x, p, **cfg)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    want = w4a16.gemm_reference(x, p)
    _bf16_close(got, want, f"W4A16 M={m} N={n} K={k} {cfg}")
    # the contract: x @ dequantize(q, bf16).T in fp32
    exact = x.double() @ nvfp4.dequantize(q, torch.bfloat16).double().T
    assert _rel(got, exact) < 2.0**-8, f"vs fp64: {_rel(got, exact):.2e}"


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 64, 256, {}),
        (3, 80, 160, {"block_k": 64, "split_k": 2}),  # N, K not multiples of the tiles; split-K
        (8, 48, 208, {"block_n": 32, "block_k": 128, "split_k": 3}),  # uneven split, K past the last tile
        (16, 32, 144, {"block_n": 16}),
        (19, 32, 64, {"block_n": 32}),  # two M tiles of 16
    ],
    ids=str,
)
def test_gemv_matches_reference(m, n, k, cfg):
    """The GEMV kernel (fp32 FMAs over the same decoded weights): within fp32 summation order of
    ``gemm_reference``, the bound of the tiled kernel's test."""
    q = _weight((n, k))
    p = w4a16.pack(q)
    x = _x(m, k)
    got = w4a16.gemm(x, p, kernel="gemv", **cfg)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _bf16_close(got, w4a16.gemm_reference(x, p), f"W4A16 GEMV M={m} N={n} K={k} {cfg}")
    exact = x.double() @ nvfp4.dequantize(q, torch.bfloat16).double().T
    assert _rel(got, exact) < 2.0**-8, f"vs fp64: {_rel(got, exact):.2e}"


def test_gemv_takes_activations_at_any_address():
    """x one element past an aligned address (the kernel reads it in 8-byte words): the same result as
    aligned."""
    p = w4a16.pack(_weight((32, 128)))
    x = _x(2, 128)
    buf = torch.empty(2 * 128 + 1, dtype=torch.bfloat16, device=DEV)
    shifted = buf[1:].view(2, 128)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 and shifted.is_contiguous()
    want = w4a16.gemm(x, p, kernel="gemv")
    assert torch.equal(w4a16.gemm(shifted, p, kernel="gemv").view(torch.int16), want.view(torch.int16))


def test_gemm_dispatches_small_m_to_the_gemv_kernel(monkeypatch):
    """``gemm`` and the custom op ``quads::w4a16_gemm`` take the GEMV kernel at up to
    ``w4a16_dispatch.dense.gemv_max_m`` rows and the tiled kernel above; an unknown kernel is refused; the CUDA
    kernel's rows fall through where it cannot run."""
    limit = tuning.config("w4a16_dispatch", "dense")["gemv_max_m"]
    calls = []
    gemv = w4a16._gemv
    monkeypatch.setattr(w4a16, "_gemv", lambda x, w, **kw: calls.append(x.shape[0]) or gemv(x, w, **kw))
    p = w4a16.pack(_weight((32, 64)))
    for m in (1, limit, limit + 1):
        w4a16.linear_op(_x(m, 64), p)
    assert calls == [1, limit]
    with pytest.raises(ValueError, match="kernel must be"):
        w4a16.gemm(_x(1, 64), p, kernel="mma")
    # the CUDA kernel's rows (cuda_max_m) fall through to the next choice where it cannot run (N = 48: no multiple
    # of the dense config's 32 features per block; without a GPU nothing runs it); asked for, an error
    real = tuning.config
    monkeypatch.setattr(tuning, "config", lambda kernel, case, **kw: {**real(kernel, case, **kw), "cuda_max_m": 16}
                        if (kernel, case) == ("w4a16_dispatch", "dense") else real(kernel, case, **kw))  # fmt: skip
    calls.clear()
    p48 = w4a16.pack(_weight((48, 64)))
    w4a16.linear_op(_x(1, 64), p48)
    assert calls == [1]
    with pytest.raises(ValueError, match="kernel='cuda'"):
        w4a16.gemm(_x(1, 64), p48, kernel="cuda")
    # a weight shape's own entries win over the defaults: w4a16_dispatch.n48_k64_dense's cuda_max_m, the config
    # w4a16_grouped_cuda.n48_k64_dense
    table = {**tuning.table(), "w4a16_dispatch": {**tuning.table()["w4a16_dispatch"],
                                                  "n48_k64_dense": {"cuda_max_m": 8, "gemv_max_m": 0, "fused_max_m": 64}},
             "w4a16_grouped_cuda": {**tuning.table()["w4a16_grouped_cuda"],
                                    "n48_k64_dense": {"ng": 1, "nt": 1, "warps": 4, "ksplit": 1}}}  # fmt: skip
    monkeypatch.setattr(tuning, "table", lambda: table)
    seen = []
    monkeypatch.setattr(w4a16, "_cuda_gemm", lambda x, w, ends, case, required=None: seen.append(case))
    calls.clear()
    w4a16.linear_op(_x(1, 64), p48)  # the shape's cuda_max_m 8 asks the CUDA kernel, which (here) declines
    w4a16.linear_op(_x(1, 64), p)  # N = 32: the defaults (cuda_max_m 16 from the patched config above)
    assert seen == ["n48_k64_dense", "dense"] and calls == [1]  # gemv_max_m 0 for N = 48: the tiled kernel


@pytest.mark.parametrize("kernel", ["gemv", "tiled"])
def test_gemm_split_k_is_deterministic_and_nan_reaches_its_column(kernel):
    """4 splits of 2 K tiles each; a NaN block scale of row 3 makes column 3 NaN, and only it."""
    q = _weight((32, 512))
    q.scales.view(torch.uint8)[3, 2] = 0x7F
    p = w4a16.pack(q)
    x = _x(3, 512)
    a = w4a16.gemm(x, p, split_k=4, block_k=64, kernel=kernel)
    b = w4a16.gemm(x, p, split_k=4, block_k=64, kernel=kernel)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert a[:, 3].isnan().all() and not a[:, :3].isnan().any() and not a[:, 4:].isnan().any()


def _routes(t, k, e, seed=0, masked=0, skip=()):
    """top-k ids of t tokens over e experts (``skip`` never chosen, ``masked`` slots set to E), sorted
    on the device as the engine's decode step does (``moe.static_routes``)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([i for i in range(e) if i not in skip])
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    if masked:
        ids.view(-1)[torch.randperm(t * k, generator=g)[:masked]] = e
    return moe.static_routes(ids.to(DEV), e)


@pytest.mark.parametrize("t,e,n,k,masked", [(5, 6, 48, 256, 3), (9, 4, 32, 80, 0)], ids=str)
def test_grouped_gemm_matches_reference(t, e, n, k, masked):
    q = _weight((e, n, k), experts_amax=True)
    p = w4a16.pack(q)
    routes = _routes(t, 2, e, masked=masked, skip=(1,))  # expert 1 gets no rows
    x = _x(t * 2, k)
    got = w4a16.grouped_gemm(x, p, routes.ends, block_m=16)
    want = w4a16.grouped_gemm_reference(x, p, routes.ends)
    _bf16_close(got, want, f"grouped T={t} E={e} N={n} K={k}")
    split = w4a16.grouped_gemm(x, p, routes.ends, block_k=64, split_k=3)  # uneven split of the K tiles
    _bf16_close(split, want, "grouped split-K")
    assert (split[int(routes.ends[-1]):] == 0).all()
    # above w4a16_dispatch.grouped: torch._grouped_mm over dequantize_bf16, masked rows zeroed too
    _bf16_close(w4a16.grouped_gemm(x, p, routes.ends, fused_max_rows_per_expert=0), want, "grouped, dequant path")
    valid = int(routes.ends[-1])
    assert valid == t * 2 - masked
    assert (got[valid:] == 0).all(), "rows of masked slots must be zeros"
    # as the product path's BF16 grouped GEMM (moe.grouped_mm over the dequantized stack)
    ref = moe.grouped_mm(x, nvfp4.dequantize(q, torch.bfloat16), routes)
    _bf16_close(got, ref, "vs moe.grouped_mm")
    # rows gathered by the kernel (the engine's tokens, each slot's token): the product of x[rows], bit for bit,
    # on both the single-pass and split-K launches, and through the dequant path (which gathers first)
    tokens = _x(t, k)
    rows = routes.order // 2
    for kw in (dict(block_m=16), dict(block_k=64, split_k=3), dict(fused_max_rows_per_expert=0)):
        want_rows = w4a16.grouped_gemm(tokens[rows], p, routes.ends, **kw)
        assert torch.equal(w4a16.grouped_gemm(tokens, p, routes.ends, rows=rows, **kw), want_rows), kw
    _bf16_close(w4a16.grouped_gemm_reference(tokens, p, routes.ends, rows=rows), want_rows, "reference, rows")
    with pytest.raises(ValueError, match="rows must be int64"):
        w4a16.grouped_gemm(tokens, p, routes.ends, rows=rows.int())


def test_grouped_gemm_row_scale_is_eager_product_bit_for_bit():
    """``row_scale``: each output row times its scale with eager PyTorch's bits (``y * s[:, None]`` in BF16), in the
    kernel's epilogue (split-K 1), after the split-K sum, and on the dequant path; the masked rows' zeros are
    multiplied too (a NaN scale there gives NaN, as eager); a scale of the wrong dtype or length is refused."""
    t, e, n, k = 7, 4, 48, 128
    p = w4a16.pack(_weight((e, n, k), experts_amax=True))
    routes = _routes(t, 2, e, masked=3)
    x = _x(t * 2, k)
    g = torch.Generator().manual_seed(3)
    scale = torch.rand(t * 2, generator=g).to(DEV, torch.bfloat16)
    valid = int(routes.ends[-1])
    scale[valid + 1] = float("nan")
    for kw in (dict(block_m=16, split_k=1), dict(block_k=64, split_k=2), dict(fused_max_rows_per_expert=0)):
        y = w4a16.grouped_gemm(x, p, routes.ends, **kw)
        got = w4a16.grouped_gemm(x, p, routes.ends, row_scale=scale, **kw)
        assert _same_bits(got, y * scale[:, None]), kw
        assert got[valid + 1].isnan().all() and (got[valid] == 0).all(), kw
    tokens = _x(t, k)
    rows = routes.order // 2
    want = w4a16.grouped_gemm(tokens, p, routes.ends, rows=rows, block_m=16) * scale[:, None]
    assert _same_bits(w4a16.grouped_gemm(tokens, p, routes.ends, rows=rows, block_m=16, row_scale=scale), want)
    with pytest.raises(ValueError, match="row_scale must be"):
        w4a16.grouped_gemm(x, p, routes.ends, row_scale=scale.float())
    with pytest.raises(ValueError, match="row_scale must be"):
        w4a16.grouped_gemm(x, p, routes.ends, row_scale=scale[:-1])


def test_a_single_weight_is_a_one_expert_stack():
    """``W4A16Weight.as_stack``: views of the single weight's tensors whose grouped GEMM over ``ends = [M]``
    is the dense GEMM (to fp32 summation order) and whose unpacked stack is the canonical weight, byte for byte."""
    q = _weight((48, 208))
    p = w4a16.pack(q)
    s = p.as_stack()
    assert s.experts == 1 and s.codes.data_ptr() == p.codes.data_ptr() and s.as_stack() is s
    x = _x(5, 208)
    _bf16_close(w4a16.grouped_gemm(x, s, torch.tensor([5], dtype=torch.int32, device=DEV)),
                w4a16.gemm_reference(x, p), "one-expert stack")
    u = w4a16.unpack(s)
    assert torch.equal(u.codes[0], q.codes) and torch.equal(u.scales[0].view(torch.uint8), q.scales.view(torch.uint8))


def test_grouped_gemm_max_registers_changes_no_bit():
    """``max_registers`` (PTX .maxnreg) is a launch option: the same bits under a cap (on the GPU, where the
    cap is applied; the interpreter has no registers), and a clear error outside PTX's range."""
    q = _weight((3, 32, 128), experts_amax=True)
    p = w4a16.pack(q)
    ends = torch.tensor([20, 20, 37], dtype=torch.int32, device=DEV)
    x = _x(40, 128)
    want = w4a16.grouped_gemm(x, p, ends, block_m=16)
    assert torch.equal(w4a16.grouped_gemm(x, p, ends, block_m=16, max_registers=128), want)
    with pytest.raises(ValueError, match="max_registers"):
        w4a16.grouped_gemm(x, p, ends, max_registers=16)


def test_sub_k_decodes_the_k_tile_in_parts():
    """``sub_k`` 64 at block_k 128 / 256: each K tile decoded and multiplied 64 columns at a time, the same
    product to fp32 summation order (K = 208: whole and partial K tiles, a part wholly past K); a sub_k
    that is no multiple of 64 dividing block_k is refused."""
    k = 208
    q = _weight((3, 32, k), experts_amax=True)
    p = w4a16.pack(q)
    ends = torch.tensor([20, 20, 37], dtype=torch.int32, device=DEV)
    x = _x(40, k)
    want = w4a16.grouped_gemm_reference(x, p, ends)
    for bk in (128, 256):
        _bf16_close(w4a16.grouped_gemm(x, p, ends, block_m=16, block_k=bk, sub_k=64), want, f"sub_k 64, block_k {bk}")
    with pytest.raises(ValueError, match="sub_k"):
        w4a16.grouped_gemm(x, p, ends, block_k=128, sub_k=96)
    # the dense tiled kernel shares the K tile (``_k_tile``)
    qd = _weight((48, k))
    pd, xd = w4a16.pack(qd), _x(5, k)
    _bf16_close(w4a16.gemm(xd, pd, kernel="tiled", block_k=256, sub_k=64), w4a16.gemm_reference(xd, pd), "dense sub_k")
    with pytest.raises(ValueError, match="sub_k"):
        w4a16.gemm(xd, pd, kernel="tiled", block_k=128, sub_k=96)


def test_grouped_gemm_rows_past_one_tile_and_empty_batch():
    q = _weight((3, 32, 128), experts_amax=True)
    p = w4a16.pack(q)
    ends = torch.tensor([20, 20, 37], dtype=torch.int32, device=DEV)  # 20 rows: two M tiles of 16
    x = _x(40, 128)
    got = w4a16.grouped_gemm(x, p, ends, block_m=16)
    want = w4a16.grouped_gemm_reference(x, p, ends)
    _bf16_close(got, want, "grouped, 2 M tiles")
    assert (got[37:] == 0).all()
    assert w4a16.grouped_block_m(40, 3) == 32
    _bf16_close(w4a16.grouped_gemm(x, p, ends), want, "grouped, block_m from the row count")
    a = w4a16.grouped_gemm(x, p, ends, split_k=2, block_k=64)  # split-K: partials summed in a fixed order
    _bf16_close(a, want, "grouped, split-K")
    assert (a[37:] == 0).all() and torch.equal(a, w4a16.grouped_gemm(x, p, ends, split_k=2, block_k=64))
    empty = w4a16.grouped_gemm(x[:0], p, torch.zeros(3, dtype=torch.int32, device=DEV))
    assert empty.shape == (0, 32)


def test_bad_inputs_say_what_to_do():
    p = w4a16.pack(_weight((32, 64)))
    with pytest.raises(ValueError, match="bfloat16"):
        w4a16.gemm(_x(2, 64).float(), p)
    with pytest.raises(ValueError, match="K=64"):
        w4a16.gemm(_x(2, 128), p)
    with pytest.raises(ValueError, match="expert stack"):
        w4a16.grouped_gemm(_x(2, 64), p, torch.zeros(1, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="multiple of 64"):
        w4a16.gemm(_x(2, 64), p, block_k=32)


def test_tuning_table_has_the_w4a16_cases():
    dense = {"block_n", "block_k", "split_k", "num_warps", "num_stages"}
    for case in ("m1", "m4", "m16", "m32", "m64", "large"):
        assert dense <= set(tuning.config("w4a16_gemm", case)) <= dense | {"sub_k"}
    grouped = tuning.table()["w4a16_grouped_gemm"]
    assert {"decode", "prefill"} <= set(grouped)
    for case in grouped:  # decode, prefill and the shape entries n{N}_k{K}_<decode or prefill>
        assert case in ("decode", "prefill") or case.rsplit("_", 1)[-1] in ("decode", "prefill")
        assert set(tuning.config("w4a16_grouped_gemm", case)) == {"block_m", "block_n", "block_k", "split_k", "num_warps",
                                                                  "num_stages", "max_registers", "sub_k", "backend"}  # fmt: skip
        assert tuning.config("w4a16_grouped_gemm", case)["backend"] in ("triton", "cuda")
    for case in tuning.table()["w4a16_grouped_cuda"]:
        assert set(tuning.config("w4a16_grouped_cuda", case)) == {"ng", "nt", "warps", "ksplit"}
    # the shape entries: Qwen3-30B-A3B's gate_up decode (run 30: the CUDA kernel at split-K 4), the 1b's prefill
    # shapes (run 58: 128x128x64 tiles); other shapes and cases fall back to the defaults
    assert w4a16.grouped_case(64, 128, 1536, 2048) == "n1536_k2048_decode"
    assert w4a16.grouped_case(1024, 64, 512, 1024) == "decode"
    assert w4a16.grouped_case(1025 * 16, 64, 512, 1024) == "n512_k1024_prefill"
    assert w4a16.grouped_case(1025 * 16, 64, 1024, 256) == "n1024_k256_prefill"
    assert w4a16.grouped_case(1025 * 16, 64, 768, 512) == "prefill"
    assert w4a16.grouped_case(128 * 17, 128, 1536, 2048) == "prefill"
    assert set(tuning.config("w4a16_gemv", "small")) == {"block_n", "block_k", "split_k", "num_warps", "num_stages"}
    for case in tuning.table()["w4a16_dispatch"]:
        if case == "dense" or case.endswith("_dense"):  # the default and the shape entries (run 35: the CUDA kernel at 28672 x 4096)
            assert set(tuning.config("w4a16_dispatch", case)) == {"cuda_max_m", "gemv_max_m", "fused_max_m"}
    assert set(tuning.config("w4a16_dispatch", "grouped")) == {"fused_max_rows_per_expert"}
    assert [w4a16.m_bucket(m) for m in (1, 2, 16, 33, 64, 65)] == ["m1", "m4", "m16", "m64", "m64", "large"]


# ------------------------------------------------------------------------------------------- layers


def _rollout_layers(kernels: str):
    from quads.quant.layers import QuantizedExperts, QuantizedLinear
    from quads.quant.recipe import LinearSpec

    torch.manual_seed(0)
    spec = LinearSpec.of(weight="nvfp4", act="none")
    lin = torch.nn.Linear(128, 48, bias=True).bfloat16().to(DEV)
    ex = moe.MoEExperts(4, 64, 32).bfloat16().to(DEV)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    with dispatch.kernels(kernels):
        ql = QuantizedLinear(lin, spec, side="rollout", weight_dtype=torch.bfloat16)
        qe = QuantizedExperts(ex, spec, side="rollout", weight_dtype=torch.bfloat16)
    return lin, ql, qe


def test_rollout_layers_on_the_kernel_path(reference_quantizer):
    """QuantizedLinear / QuantizedExperts (rollout, W4A16): the kernel path keeps only the packed
    weight and gives the reference path's result; a refresh after a master update changes the packed
    tensors in place and the output follows."""
    lin, ql, qe = _rollout_layers("triton")
    st = ql.stores["weight"]
    assert st.kernel is not None and st.w_q is None, "the kernel path keeps no BF16 copy"
    _, rl, rex = _rollout_layers("reference")
    assert rex.stores["gate_up_proj"].kernel is None and rex.stores["gate_up_proj"].w_q is not None
    x = _x(6, 128)
    with dispatch.kernels("triton"):
        y = ql(x)
    with dispatch.kernels("reference"):
        y_ref = rl(x)
    _bf16_close(y, y_ref, "QuantizedLinear kernel vs reference")
    with dispatch.kernels("reference"):  # the typed switch turns the kernel off; same operand, same bits
        assert torch.equal(ql(x), y_ref)
    # the operand weight sync fingerprints: decoded from the packed bytes, the reference's bits
    assert torch.equal(st.get().view(torch.int16), rl.stores["weight"].get().view(torch.int16))

    h = _x(5, 64)
    ids = torch.tensor([[0, 2], [2, 3], [0, 3], [3, 4], [2, 0]], device=DEV)  # 4 = a masked slot
    wts = torch.rand(5, 2, device=DEV).bfloat16()
    with dispatch.kernels("triton"):
        ye = qe.forward_static(h, ids, wts)
        ye_eager = qe(h, ids, wts)
    with dispatch.kernels("reference"):
        ye_ref = rex.forward_static(h, ids, wts)
    _bf16_close(ye, ye_ref, "QuantizedExperts.forward_static kernel vs reference")
    assert torch.equal(ye, ye_eager)

    # refresh after a master update: same tensors, new values, output follows
    codes_ptr = st.kernel.codes.data_ptr()
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    with dispatch.kernels("triton"):
        ql.refresh()
        y2 = ql(x)
    assert st.kernel.codes.data_ptr() == codes_ptr, "refresh must copy into the captured tensors"
    with dispatch.kernels("reference"):
        rl.weight.data.copy_(lin.weight)
        rl.refresh()
        y2_ref = rl(x)
    _bf16_close(y2, y2_ref, "after refresh")
    assert not torch.equal(y2, y)


def test_packed_weights_by_spec(reference_quantizer):
    """Which rollout specs keep only the packed weight on the kernel path: W4A16 and canonical W4A4(+RAC);
    not the mismatch amplifier (its GEMM forms the amplified weight from the dense QDQ(W)), not FP32 weights,
    not the trainer side."""
    from quads.quant.layers import QuantizedLinear
    from quads.quant.recipe import LinearSpec

    lin = torch.nn.Linear(64, 32, bias=False).bfloat16().to(DEV)
    cases = [(LinearSpec.of(weight="nvfp4"), "rollout", torch.bfloat16, True),
             (LinearSpec.of(weight="nvfp4", act="nvfp4"), "rollout", torch.bfloat16, True),
             (LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, act_scale="token"), "rollout", torch.bfloat16,
              True),
             (LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, error_scale=2.0), "rollout", torch.bfloat16,
              False),
             (LinearSpec.of(weight="nvfp4", error_scale=0.5), "rollout", torch.bfloat16, False),
             (LinearSpec.of(weight="nvfp4", act="nvfp4", nvfp4_mode="torchao"), "rollout", torch.bfloat16, False),
             (LinearSpec.of(weight="nvfp4", act="nvfp4"), "rollout", torch.float32, False),
             (LinearSpec.of(weight="nvfp4", act="nvfp4"), "trainer", torch.bfloat16, False)]
    with dispatch.kernels("triton"):
        for spec, side, wdt, want in cases:
            st = QuantizedLinear(lin, spec, side=side, weight_dtype=wdt).stores["weight"]
            st.get()
            assert (st.kernel is not None and st.w_q is None) == want, (spec.describe(), side, wdt)
    with dispatch.kernels("reference"):
        st = QuantizedLinear(lin, cases[1][0], side="rollout", weight_dtype=torch.bfloat16).stores["weight"]
        assert st.kernel is None and st.w_q is not None


@pytest.mark.parametrize("rollout", ["w4a16", "w4a4+rac50-static"])
def test_weight_sync_verifies_the_packed_weights(rollout, reference_quantizer):
    """sync_weights into a rollout model on the kernel path (W4A16, and W4A4+RAC whose factored GEMM
    reads the packed weight too): the fingerprints (taken of the weight decoded from the packed bytes)
    match the trainer's QDQ weights, the packed tensors are updated in place (a captured graph reads
    them), and a corrupted packed byte is caught."""
    from quads.model import ModelConfig, MoEForCausalLM
    from quads.quant.apply import quantize_model
    from quads.quant.layers import refresh_stale
    from quads.quant.recipe import LinearSpec, Recipe
    from quads.quant.sync import LocalWeights, ReplicaTarget, WeightSync, WeightSyncError, sync_weights

    class NoRequantize(ReplicaTarget):  # verifies what is stored, without re-quantizing first
        def commit(self, source):
            return 0

    cfg = dict(vocab_size=64, hidden_size=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, n_experts=4,
               top_k=2, moe_intermediate_size=32, max_seq_len=32, dtype="bfloat16")
    rspec = LinearSpec.of(weight="nvfp4") if rollout == "w4a16" else LinearSpec.of(
        weight="nvfp4", act="nvfp4", rac_ratio=0.5, rac_selection="static")
    recipe = Recipe(rollout, trainer=LinearSpec.of(weight="nvfp4"), rollout=rspec)
    with dispatch.kernels("triton"):
        torch.manual_seed(0)
        trainer = MoEForCausalLM(ModelConfig(**cfg)).to(DEV)
        quantize_model(trainer, recipe, side="trainer", verbose=False)
        with dispatch.kernels("reference"):  # the trainer's QDQ(W): the Triton refresh's bits (tests/test_kernels.py)
            refresh_stale(trainer)
        torch.manual_seed(1)
        rollout = MoEForCausalLM(ModelConfig(**cfg)).to(DEV)
        quantize_model(rollout, recipe, side="rollout", verbose=False)
        stores = [st for m in rollout.modules() if hasattr(m, "stores") for st in m.stores.values()]
        assert stores and all(st.kernel is not None and st.w_q is None for st in stores)
        ptrs = [t.data_ptr() for st in stores for t in st.kernel.tensors()]
        before = stores[0].get()
        report = sync_weights(trainer, rollout)
        assert report.ok and report.n_checked == len(stores)
        assert [t.data_ptr() for st in stores for t in st.kernel.tensors()] == ptrs
        assert not torch.equal(stores[0].get(), before)
        assert WeightSync(LocalWeights(trainer), NoRequantize(rollout)).run().ok
        stores[0].kernel.codes.view(-1)[0] ^= 0x10  # one code in the packed layout
        with pytest.raises(WeightSyncError):
            WeightSync(LocalWeights(trainer), NoRequantize(rollout)).run()


# ------------------------------------------------------------------------------------------ real size


@gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 1024])
@pytest.mark.parametrize("n,k", [(8192, 8192), (28672, 4096), (3072, 1024)], ids=str)
def test_gpu_gemm_real_size(m, n, k):
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).bfloat16())
    p = w4a16.pack(q)
    x = torch.randn(m, k, device="cuda").bfloat16()
    _bf16_close(w4a16.gemm(x, p), w4a16.gemm_reference(x, p), f"W4A16 M={m} N={n} K={k}")
    ref = x @ nvfp4.dequantize(q, torch.bfloat16).T  # cuBLAS BF16 over the dequantized weight
    assert _rel(w4a16.gemm(x, p), ref) < 2.0**-8


@gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("n,k", [(8192, 8192), (28672, 4096), (3072, 1008)], ids=str)
def test_gpu_gemv_real_size(m, n, k):
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).bfloat16())
    p = w4a16.pack(q)
    x = torch.randn(m, k, device="cuda").bfloat16()
    got = w4a16.gemm(x, p, kernel="gemv")
    _bf16_close(got, w4a16.gemm_reference(x, p), f"W4A16 GEMV M={m} N={n} K={k}")
    assert torch.equal(got.view(torch.int16), w4a16.gemm(x, p, kernel="gemv").view(torch.int16))  # deterministic
    assert _rel(got, x @ nvfp4.dequantize(q, torch.bfloat16).T) < 2.0**-8


@gpu
def test_gpu_decoded_weights_bit_exact_real_size():
    q = nvfp4.quantize(torch.randn(64, 512, 1024, device="cuda").bfloat16(), amax=torch.rand(64, 1, 1, device="cuda"))
    p = w4a16.pack(q)
    assert torch.equal(w4a16.dequantize(p).view(torch.int16), nvfp4.dequantize(q, torch.bfloat16).view(torch.int16))
    eye = torch.eye(1024, dtype=torch.bfloat16, device="cuda")
    ends = torch.full((64,), 0, dtype=torch.int32, device="cuda")
    ends[3:] = 1024  # expert 3 gets all 1024 identity rows: its decoded weight, exactly
    y = w4a16.grouped_gemm(eye, p, ends)
    want = nvfp4.dequantize(q, torch.bfloat16)[3].T.contiguous() + 0.0  # -0.0 weights sum to +0.0
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@gpu
@pytest.mark.parametrize("tokens,e,n,k,topk", [(1, 128, 1536, 2048, 8), (16, 128, 1536, 2048, 8),
                                               (64, 128, 1536, 2048, 8), (128, 64, 512, 1024, 8),
                                               (128, 64, 1024, 256, 8)], ids=str)  # fmt: skip
def test_gpu_grouped_real_size(tokens, e, n, k, topk):
    w = (torch.randn(e, n, k, device="cuda") * 0.02).bfloat16()
    q = nvfp4.quantize(w, amax=w.float().abs().amax(dim=(-2, -1), keepdim=True))
    p = w4a16.pack(q)
    ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(tokens)])
    ids.view(-1)[: tokens // 4] = e  # some masked slots
    routes = moe.static_routes(ids, e)
    x = torch.randn(tokens * topk, k, device="cuda").bfloat16()
    got = w4a16.grouped_gemm(x, p, routes.ends)
    _bf16_close(got, w4a16.grouped_gemm_reference(x, p, routes.ends), f"grouped T={tokens} E={e} N={n} K={k}")
    ref = moe.grouped_mm(x, nvfp4.dequantize(q, torch.bfloat16), routes)
    assert _rel(got, ref) < 2.0**-8
    hidden = torch.randn(tokens, k, device="cuda").bfloat16()  # the rows gathered by the kernel: the same bits
    rows = routes.order // topk
    assert torch.equal(w4a16.grouped_gemm(hidden, p, routes.ends, rows=rows),
                       w4a16.grouped_gemm(hidden[rows], p, routes.ends))


@gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_grouped_gemm_in_a_cuda_graph_follows_refreshed_weights(backend):
    """Also for the CUDA kernel (quads.kernels.w4a16_cuda, tests/test_kernels_w4a16_cuda.py) where it can run."""
    if backend == "cuda":
        from quads.kernels import w4a16_cuda

        if not w4a16_cuda.available():
            pytest.skip("the CUDA kernel needs compute capability >= 8.9 and nvcc")
    e, n, k = 64, 512, 1024
    q = nvfp4.quantize(torch.randn(e, n, k, device="cuda").bfloat16(), amax=torch.rand(e, 1, 1, device="cuda"))
    p = w4a16.pack(q)
    routes = moe.static_routes(torch.randint(0, e, (128, 8), device="cuda"), e)
    x = torch.randn(1024, k, device="cuda").bfloat16()
    w4a16.grouped_gemm(x, p, routes.ends, backend=backend)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = w4a16.grouped_gemm(x, p, routes.ends, backend=backend)
    q2 = nvfp4.quantize(torch.randn(e, n, k, device="cuda").bfloat16(), amax=torch.rand(e, 1, 1, device="cuda"))
    assert p.copy_(w4a16.pack(q2))
    g.replay()
    _bf16_close(y, w4a16.grouped_gemm_reference(x, w4a16.pack(q2), routes.ends), "graph replay after refresh")


def test_cuda_rows_per_pass_follows_the_rows_per_expert():
    """The CUDA kernel's pass size (pure Python, no GPU): 32 rows at the 1b decode's 1,024 rows over 64 experts,
    8 at Qwen3-30B-A3B's 512 over 128 (run 28's fastest for each), only compiled instantiations."""
    from quads.kernels import w4a16_cuda

    assert w4a16_cuda.rows_per_pass(1024, 64, 2, 4, 1) == 4
    assert w4a16_cuda.rows_per_pass(512, 128, 2, 4, 1) == 1
    assert w4a16_cuda.rows_per_pass(8, 128, 2, 4, 1) == 1
    assert w4a16_cuda.rows_per_pass(10**6, 64, 2, 4, 1) == 4  # the most compiled
    assert w4a16_cuda.rows_per_pass(1024, 64, 1, 4, 4) == 4 and w4a16_cuda.rows_per_pass(64, 64, 1, 4, 4) == 4
    for c in w4a16_cuda.CONFIGS:
        assert (c[0], w4a16_cuda.rows_per_pass(300, 16, c[0], c[2], c[3]), c[2], c[3]) in w4a16_cuda.CONFIGS
