"""Triton kernels against their references: bit-exact quantizers, GEMMs within summation-order tolerance.

Without a GPU the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set below
before any kernel module is imported; Triton reads it when a kernel is decorated) at tiny sizes.
With a GPU the same checks run compiled, plus the ``gpu``-marked real-size checks.
"""

import json
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install quads[kernels])")
tl = pytest.importorskip("triton.language")

from quads.formats import nvfp4  # noqa: E402
from quads.kernels import dispatch, nvfp4_quant, tuning  # noqa: E402
from quads.prototype.kernels import gemm, linear, rac  # noqa: E402
from quads.quant.rac import rac_operands  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA and not isinstance(
    nvfp4_quant._nvfp4_quantize_kernel, triton.runtime.interpreter.InterpretedFunction
):
    pytest.skip("kernel modules were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="real-size kernel checks need a CUDA GPU (sm_90); none here")


def _same_q(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor, what: str) -> None:
    assert torch.equal(a.codes, b.codes), f"{what}: codes differ at {(a.codes != b.codes).sum()} bytes"
    sa, sb = a.scales.view(torch.uint8), b.scales.view(torch.uint8)
    assert sa.shape == sb.shape and torch.equal(sa, sb), f"{what}: scales differ at {(sa != sb).sum()}"
    assert a.global_scale.shape == b.global_scale.shape, (
        f"{what}: {a.global_scale.shape} vs {b.global_scale.shape}"
    )
    assert torch.equal(a.global_scale, b.global_scale), f"{what}: global scales differ"


def _awkward(shape, seed=0, dtype=torch.bfloat16):
    """Random data over 10 decades, with zeros, -0.0, a NaN, an Inf, exact E2M1 ties and a zero block."""
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(shape, generator=g) * torch.logspace(-5, 3, k)
    flat = x.view(-1, k)
    flat[0, :16] = 0.0
    flat[0, 16] = -0.0
    flat[-1, 17:23] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5]) * 100
    flat[-1, 23] = 6.0 * 100  # sets the block amax so the ties above stay ties
    if flat.shape[0] > 2:
        flat[1, 3] = float("nan")
        flat[2, 5] = float("-inf")
    return x.to(dtype).to(DEV)


QUANT_CASES = {
    "tensor": dict(),
    "token": dict(per_token=True),
    "amax": dict(amax=7.5),
    "tile16": dict(tile=(16, 16)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(QUANT_CASES), ids=lambda c: c)
def test_quantize_bit_exact(case, dtype):
    x = _awkward((32, 96), seed=1, dtype=dtype)
    kw = QUANT_CASES[case]
    _same_q(nvfp4_quant.nvfp4_quantize(x, **kw), nvfp4.quantize(x, **kw), f"{case} {dtype}")


@pytest.mark.parametrize(
    "kw",
    [
        dict(per_token=True, block_k=64),  # rows longer than one tile: the looping kernel
        dict(per_token=True, tile=(16, 16)),  # per token with 16x16 tiles: the looping kernel
        dict(per_token=True, block_m=2, num_warps=2),  # whole rows in one tile, 2 rows per program
        dict(amax=3.0, block_m=4, block_k=64),  # 2D grid of tiles (several K tiles per row)
        dict(block_m=8, block_k=128),  # per tensor: row_amax pass, then the 2D grid
    ],
    ids=str,
)
def test_quantize_launch_configs_bit_exact(kw):
    """Every kernel / config the launcher can pick gives the reference's bits (K = 400: 25 blocks, a
    partial last K tile for every block_k above; 20 rows: several row tiles, a partial last one for
    block_m 8; 16x16 tiles need whole row tiles: 32 rows, two of them)."""
    x = _awkward((32 if "tile" in kw else 20, 400), seed=4)
    ref_kw = {k: v for k, v in kw.items() if k not in ("block_m", "block_k", "num_warps")}
    _same_q(nvfp4_quant.nvfp4_quantize(x, **kw), nvfp4.quantize(x, **ref_kw), str(kw))


@pytest.mark.parametrize("kw", [dict(per_token=True), dict(), dict(per_token=True, block_k=64)], ids=str)
def test_quantize_nan_rows_and_blocks(kw):
    """A row of NaNs (amax 0 in the reference, not NaN), a block of NaNs, and a NaN beside finite values."""
    x = _awkward((8, 128), seed=6)
    x[3] = float("nan")
    x[5, 32:48] = float("nan")
    x[6, 70] = float("nan")
    ref_kw = {k: v for k, v in kw.items() if k != "block_k"}
    _same_q(nvfp4_quant.nvfp4_quantize(x, **kw), nvfp4.quantize(x, **ref_kw), f"NaN rows {kw}")


def test_row_amax_configs():
    x = _awkward((9, 400), seed=5, dtype=torch.float32)
    ref = nvfp4.nan_ignoring_amax(x, dim=-1)
    for bm, bk, nw in ((1, 128, 1), (4, 64, 2), (2, 512, 4)):
        a = nvfp4_quant.row_amax(x, block_m=bm, block_k=bk, num_warps=nw)
        assert torch.equal(a, ref.reshape(a.shape)), (bm, bk, nw)


def test_quantize_per_expert_amax_and_swizzle():
    w = _awkward((3, 32, 64), seed=2, dtype=torch.float32)
    amax = nvfp4.nan_ignoring_amax(w, dim=None).expand(3, 1, 1) * torch.tensor(
        [1.0, 0.5, 2.0], device=DEV
    ).view(3, 1, 1)
    a = nvfp4_quant.nvfp4_quantize(w, amax=amax, tile=(16, 16))
    _same_q(a, nvfp4.quantize(w, amax=amax, tile=(16, 16)), "per-expert amax, 16x16")
    s = nvfp4_quant.nvfp4_quantize(w, amax=amax, tile=(16, 16), scale_layout="swizzled")
    ref = nvfp4.swizzle_scales(a.scales)
    assert torch.equal(s.scales.view(torch.uint8), ref.view(torch.uint8)), "swizzled scales differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dequantize_bit_exact(dtype):
    q = nvfp4.quantize(_awkward((16, 64), seed=3, dtype=torch.float32), per_token=True)
    a, b = nvfp4_quant.nvfp4_dequantize(q, dtype), nvfp4.dequantize(q, dtype)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (
        f"dequantize {dtype}"
    )


@pytest.mark.parametrize("act_scale", ["tensor", "token"])
@pytest.mark.parametrize(
    "t,k,n,cfg",
    [(1, 64, 32, None), (37, 96, 48, None), (37, 96, 48, ((8, 64, 2, 4), (4, 32, 2))), (40, 160, 64, ((16, 256, 4, 2), (2, 64, 1)))],
    ids=lambda v: str(v),
)  # fmt: skip
def test_rac_quantize_bit_exact(t, k, n, cfg, act_scale):
    g = torch.Generator().manual_seed(t * k)
    x = (torch.randn(t, k, generator=g) * torch.rand(k, generator=g) * 4).bfloat16().to(DEV)
    p2, p4 = cfg or (None, None)
    a = rac.rac_quantize(
        x, n, act_scale=act_scale, scatter=True, splits=None if cfg else 2, pass2=p2, pass4=p4
    )
    b = rac.rac_quantize_reference(x, n, act_scale=act_scale, scatter=True)
    _same_q(a.x, b.x, "RAC X")
    assert torch.equal(a.channels, b.channels), f"RAC channels differ: {a.channels} vs {b.channels}"
    _same_q(a.residual, b.residual, "RAC residual")
    assert torch.equal(a.scattered, b.scattered), "scattered residual operand differs"
    xq, rq, s = rac_operands(x, n=n, act_scale=act_scale)  # the quant layers' reference
    assert torch.equal(nvfp4.dequantize(a.x), xq) and torch.equal(a.channels, s)
    assert torch.equal(nvfp4.dequantize(a.residual), rq)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# fp32 accumulation of exact products in another order: |err| <= K * 2**-24 * sum|terms| in the worst
# case, typically sqrt(K) * 2**-24 relative; 1e-5 relative (Frobenius) leaves a wide margin at K <= 8192
# and still catches any wrong code, scale or index (those give errors of order 1e-2 or more).
GEMM_RTOL = 1e-5


def test_tuning_table_has_every_case():
    """Each launcher finds its launch configs in tuning.json (a missing entry is a clear error)."""
    for case in ("row_amax", "per_token", "amax_known", "tile16"):
        assert set(tuning.config("nvfp4_quantize", case)) == {"block_m", "block_k", "num_warps"}
    for case in ("row_amax", "qdq", "tile16"):
        assert set(tuning.config("weight_qdq", case)) == {"block_m", "block_k", "num_warps"}
    assert set(tuning.config("rac_quantize", "pass2")) == {"block_m", "block_k", "num_warps", "target_programs"}
    assert set(tuning.config("rac_quantize", "pass4")) == {"block_m", "block_s", "num_warps"}
    assert set(tuning.config("group_units", "decode")) == {"block_m", "block_k", "cols", "num_warps"}
    for case in ("sort", "k1024_sort", "k256_sort"):  # rac_units reads every key of its case
        assert set(tuning.config("rac_select", case)) == {"sort_run", "select_warps", "select_rows", "split_runs",
                                                          "select_backend", "cuda_warps"}
    with pytest.raises(ValueError, match="no launch config w4a16_gemm.m3"):
        tuning.config("w4a16_gemm", "m3")


@pytest.mark.parametrize("act_scale", ["tensor", "token"])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_w4a4_rac_linear_matches_quant_reference(ratio, act_scale):
    t, n, k = 7, 48, 128
    x = torch.randn(t, k).bfloat16().to(DEV)
    w = torch.randn(n, k).to(DEV)
    wq = nvfp4.quantize(w)
    from quads.quant.rac import rac_channels
    from quads.quant.w4a4 import w4a4_linear as quant_w4a4

    with dispatch.kernels("triton"):
        y = linear.w4a4_linear(x, wq, rac_channels=rac_channels(k, ratio), act_scale=act_scale)
    with dispatch.kernels("reference"):
        y_ref = linear.w4a4_linear(x, wq, rac_channels=rac_channels(k, ratio), act_scale=act_scale)
        y_quant = quant_w4a4(x, w, rac_ratio=ratio, act_scale=act_scale)
    assert torch.equal(y.float().isnan(), y_ref.float().isnan())
    # bf16 outputs: the two paths may round differently by one bf16 ulp (2**-8 relative)
    assert _rel(y, y_ref) < 4e-3, (
        f"W4A4 ratio={ratio} {act_scale}: {_rel(y, y_ref):.2e} vs the kernel reference"
    )
    assert _rel(y, y_quant) < 4e-3, f"W4A4 ratio={ratio} {act_scale}: {_rel(y, y_quant):.2e} vs quant.w4a4"


def test_dispatch_switch():
    x = torch.randn(4, 32)
    with dispatch.kernels("reference"):
        assert dispatch.backend() == "reference" and not dispatch.use_triton(x)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with dispatch.kernels("fast"):
            pass
    with dispatch.kernels("auto"):
        assert dispatch.use_triton(x) == (x.is_cuda and dispatch.HAS_TRITON)
        q = dispatch.nvfp4_quantize(x.to(DEV), per_token=True)
    _same_q(q, nvfp4.quantize(x.to(DEV), per_token=True), "dispatch auto")


def test_weight_stack_quantize_skips_the_amax_check_it_does_not_need(monkeypatch):
    """An expert stack's amax comes from ``nan_ignoring_amax`` (never NaN or negative), so the Triton path
    does not check it (the check's two device reads are host syncs in every QAT step); a caller's amax is
    still checked; the bits are the reference's."""
    from quads.quant import ops

    seen = []
    real = nvfp4.check_amax
    monkeypatch.setattr(nvfp4, "check_amax", lambda *a, **k: seen.append(k.get("validate", True)) or real(*a, **k))
    w = torch.randn(3, 32, 64).to(DEV)
    with dispatch.kernels("triton"):
        q = ops.nvfp4_quantize_weight(w)
        with pytest.raises(ValueError, match="amax must be"):
            dispatch.nvfp4_quantize(w[0], amax=float("nan"))
    assert seen == [False, True]
    with dispatch.kernels("reference"):
        _same_q(q, ops.nvfp4_quantize_weight(w), "expert stack")


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal shape, dtype and bits (NaN payloads included)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    ia, ib = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    assert torch.equal(ia, ib), f"{what}: {(ia != ib).sum()} bytes differ"


def _same_values(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal shape, dtype, NaN positions and the bits of every other element (a NaN block's NaNs may carry
    another payload: the reference multiplies a NaN scale, the kernel decodes one)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    nan = b.isnan()
    assert torch.equal(a.isnan(), nan), f"{what}: NaN at {(a.isnan() != nan).sum()} other places"
    _same_bits(a[~nan], b[~nan], what)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("shape", [(5, 32, 48), (40, 32)], ids=lambda s: "x".join(map(str, s)))
def test_slice_amax_ignores_nan_counts_inf(backend, shape):
    """``dispatch.slice_amax`` (every expert's global amax, for a group of same-shape weights at once): one
    value per expert (a 2-D weight: one), NaN ignored, Inf counted, all-zero and all-NaN experts 0; the
    Triton row pass equals the reference."""
    ws = [_awkward(shape, seed=4 + i, dtype=torch.float32) * 10.0 ** (3 * i) for i in range(3)]
    if len(shape) == 3:
        ws[0][3], ws[0][4], ws[2][1, 7, 9] = 0.0, float("nan"), float("inf")
    else:
        ws[1].zero_()
    with dispatch.kernels(backend):
        a = dispatch.slice_amax(ws)
    e = shape[0] if len(shape) == 3 else 1
    want = torch.stack([torch.stack([w.view(e, -1)[i].nan_to_num(nan=0.0, posinf=float("inf"), neginf=float("inf"))
                                     .abs().max() for i in range(e)]) for w in ws]).float()
    assert a.shape == (3, e) and a.dtype == torch.float32
    _same_bits(a, want, f"{backend} slice amax")
    if len(shape) == 3:
        assert a[0, 3] == 0 and a[0, 4] == 0 and a[2, 1] == float("inf")
    else:
        assert a[1, 0] == 0


QAT_CASES = {  # (shapes of the weights in one call, master dtype, operand dtype, tile)
    "stacks": (((3, 16, 64),) * 3, torch.float32, torch.bfloat16, (1, 16)),
    "two-shapes": (((2, 16, 64), (2, 32, 32), (2, 16, 64)), torch.float32, torch.bfloat16, (1, 16)),
    "tile16": (((2, 32, 48),) * 2, torch.float32, torch.bfloat16, (16, 16)),
    "linears-fp16": (((48, 32),) * 2, torch.float32, torch.float16, (1, 16)),
    "bf16-masters": (((2, 16, 32),) * 2, torch.bfloat16, torch.bfloat16, (1, 16)),
    "fp32-operands": (((2, 16, 32),) * 2, torch.float32, torch.float32, (1, 16)),
}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", list(QAT_CASES), ids=lambda c: c)
def test_qat_weights_equal_the_per_weight_refresh(case, backend):
    """``ops.qat_weights`` (the trainer's QAT cache refresh: on the Triton backend one grouped amax and one
    fused quantize-dequantize launch per weight shape, on the reference the fused ``nvfp4.qdq`` expert by
    expert) gives every weight bit for bit the operand of ``ops.quantize_weight``, the per-weight refresh
    and the rollout's quantize-dequantize: weights of very different magnitudes (own global scale per
    weight and expert), NaN, Inf, bf16 rounding ties of the fp32 masters and all-zero experts among them."""
    from quads.quant import ops
    from quads.quant.recipe import LinearSpec

    shapes, master, dtype, tile = QAT_CASES[case]
    spec = LinearSpec.of(weight="nvfp4", weight_tile=list(tile))
    ws = [_awkward(s, seed=10 + i, dtype=torch.float32) * 10.0 ** (2 * i - 3) for i, s in enumerate(shapes)]
    ws[0].view(-1)[40:44] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130])  # RNE ties, fp32 subnormal
    if len(shapes[-1]) == 3:
        ws[-1][0] = 0.0
    ws = [w.to(master) for w in ws]
    with dispatch.kernels(backend):
        got = ops.qat_weights(ws, spec, dtype)
        want = [ops.quantize_weight(w, spec, dtype)[0] for w in ws]
    assert len(got) == len(ws)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _same_bits(g, w, f"{case} {backend} weight {i}")
    if backend == "triton":  # and the reference's values (NaN payloads aside)
        with dispatch.kernels("reference"):
            ref = ops.qat_weights(ws, spec, dtype)
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            _same_values(g, r, f"{case} weight {i}: Triton vs reference")


@pytest.mark.parametrize("chunk", [1, 2 * 32 * 64, 2**18], ids=lambda c: f"chunk{c}")
def test_qat_weights_reference_chunks_equal(chunk, monkeypatch):
    """The CPU refresh's expert chunks (one expert: amax measured by ``qdq``; several: one amax each) give
    ``quantize_weight``'s bits whatever the chunk size, a NaN expert and an all-zero one included."""
    from quads.quant import ops
    from quads.quant.recipe import LinearSpec

    monkeypatch.setattr(ops, "QDQ_CHUNK_ELEMENTS", chunk)
    spec = LinearSpec.of(weight="nvfp4")
    w = _awkward((5, 32, 64), seed=3, dtype=torch.float32).cpu()
    w[2], w[4, 1, 1] = 0.0, float("nan")
    with dispatch.kernels("reference"):
        _same_bits(ops.qat_weights([w], spec, torch.bfloat16)[0], ops.quantize_weight(w, spec, torch.bfloat16)[0],
                   f"chunk {chunk}")


@pytest.mark.parametrize("kw", [dict(block_m=1, block_k=16), dict(block_m=8, block_k=32, num_warps=2),
                                dict(block_m=16, block_k=1024)], ids=str)
def test_weight_qdq_launch_configs_bit_exact(kw):
    """The grouped kernels give the reference's bits under any launch config (row / K tiles crossing
    expert boundaries, a K tile wider than K)."""
    from quads.kernels import weight_qdq

    ws = [_awkward((3, 12, 48), seed=i, dtype=torch.float32) for i in range(2)]
    amax = weight_qdq.group_amax(ws)
    _same_bits(weight_qdq.group_row_amax(ws, **kw), weight_qdq.group_row_amax_reference(ws), f"row amax {kw}")
    got = weight_qdq.nvfp4_qdq_group(ws, amax.bfloat16().float(), torch.bfloat16, **kw)
    _same_values(got, weight_qdq.nvfp4_qdq_group_reference(ws, amax.bfloat16().float(), torch.bfloat16), f"qdq {kw}")


def test_weight_qdq_misaligned_views_are_copied():
    """Weights that start off a 16-byte boundary (views into a larger tensor) are quantized from aligned
    copies (the kernels mark their addresses 16-byte aligned): the reference's bits all the same."""
    from quads.kernels import weight_qdq

    base = torch.randn(2 * 2 * 16 * 32 + 1).to(DEV)
    ws = [base[1 + i * 1024 : 1 + (i + 1) * 1024].view(2, 16, 32) for i in range(2)]  # 4 bytes off
    assert all(w.data_ptr() % 16 for w in ws)
    amax = weight_qdq.group_amax(ws)
    _same_bits(amax, weight_qdq.group_row_amax_reference(ws).view(2, 2, 16).amax(-1), "misaligned amax")
    got = weight_qdq.nvfp4_qdq_group(ws, amax, torch.bfloat16)
    _same_values(got, weight_qdq.nvfp4_qdq_group_reference(ws, amax, torch.bfloat16), "misaligned qdq")
    with pytest.raises(ValueError, match="16-byte aligned"):
        weight_qdq.address_table(ws)


def test_weight_qdq_rejects_mixed_groups_and_bad_amax():
    from quads.kernels import weight_qdq

    a, b = torch.randn(2, 16, 32).to(DEV), torch.randn(2, 32, 16).to(DEV)
    with pytest.raises(ValueError, match="group them by"):
        weight_qdq.nvfp4_qdq_group([a, b], torch.ones(2, 2, device=DEV), torch.bfloat16)
    with pytest.raises(ValueError, match=r"amax must be fp32 \[G, E\] = \[1, 2\]"):
        weight_qdq.nvfp4_qdq_group([a], torch.ones(2, device=DEV), torch.bfloat16)
    with pytest.raises(ValueError, match="16x16 tiles need block_m"):
        weight_qdq.nvfp4_qdq_group([a], torch.ones(1, 2, device=DEV), torch.bfloat16, (16, 16), block_m=8)


def test_qat_weights_other_specs_are_quantize_weight():
    """Compatibility NVFP4 modes and FP8 weights: ``quantize_weight``'s operand, one call each."""
    from quads.quant import ops
    from quads.quant.recipe import LinearSpec

    ws = [torch.randn(2, 16, 32), torch.randn(2, 32, 16)]
    for spec in (LinearSpec.of(weight="nvfp4", nvfp4_mode="torchao"), LinearSpec.of(weight="fp8")):
        for g, w in zip(ops.qat_weights(ws, spec, torch.bfloat16), ws, strict=True):
            _same_bits(g, ops.quantize_weight(w, spec, torch.bfloat16)[0], spec.describe())


def test_set_backend_is_the_default_and_blocks_override_it():
    """``set_backend`` (from ``TrainConfig.kernels``) is the process's backend; ``kernels()`` wins inside."""
    assert dispatch.backend() == "auto"
    try:
        dispatch.set_backend("reference")
        assert dispatch.backend() == "reference" and not dispatch.use_triton(torch.randn(2, 16).to(DEV))
        with dispatch.kernels("triton"):
            assert dispatch.backend() == "triton"
        assert dispatch.backend() == "reference"
        with pytest.raises(ValueError, match="unknown kernel backend 'fast'"):
            dispatch.set_backend("fast")
    finally:
        dispatch.set_backend("auto")


def test_backend_traces_under_torch_compile_without_a_graph_break():
    """The compiled decode step calls the dispatcher in every quantized layer: reading the backend must not
    break the graph (a ContextVar read made Dynamo skip the whole step), and a ``kernels()`` block must
    still choose the branch a compiled function takes (it recompiles on the change)."""
    torch._dynamo.reset()

    def f(x):
        return x * (2.0 if dispatch.backend() == "reference" else 3.0)

    g = torch.compile(f, fullgraph=True, backend="eager")  # fullgraph: a graph break raises
    x = torch.ones(4)
    with dispatch.kernels("reference"):
        assert g(x).tolist() == [2.0] * 4
    with dispatch.kernels("triton"):
        assert g(x).tolist() == [3.0] * 4
        with dispatch.kernels("reference"):
            assert g(x).tolist() == [2.0] * 4
        assert g(x).tolist() == [3.0] * 4
    assert dispatch.backend() == "auto"


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _first_max(v0, i0, v1, i1):
    take = v1 > v0
    return tl.where(take, v1, v0), tl.where(take, i1, i0)


@triton.jit
def _rows_nan_max(x):
    return tl.reduce(x, 1, _nan_max)


@triton.jit
def _custom_reduce_kernel(x_ptr, max_ptr, sum_ptr, idx_ptr, all_ptr, col_ptr, M: tl.constexpr, N: tl.constexpr):
    r, c = tl.arange(0, M), tl.arange(0, N)
    x = tl.load(x_ptr + r[:, None] * N + c[None, :])
    tl.store(max_ptr + r, _rows_nan_max(x))  # a helper call: the language is patched once per launch
    tl.store(sum_ptr + r, tl.reduce(x, 1, _add))  # fp32 sums: the order of the additions shows in the bits
    _, i = tl.reduce((x, tl.broadcast_to(c[None, :], (M, N))), 1, _first_max)
    tl.store(idx_ptr + r, i)
    tl.store(all_ptr + tl.arange(0, 1)[:, None], tl.reduce(x, None, _nan_max, keep_dims=True))
    tl.store(col_ptr + c[None, :], tl.reduce(x, 0, _add, keep_dims=True))


@pytest.mark.skipif(HAS_CUDA, reason="a check of the tests' Triton interpreter (CPU only)")
def test_vectorized_interpreter_reduce_equals_tritons(monkeypatch):
    """conftest's interpreter shortcuts (``tests/triton_interpreter.py``): ``tl.reduce`` with a custom combine
    function folded over slices gives the bits of Triton's own element-by-element loop (a NaN-propagating max,
    an fp32 sum over eight decades, a (value, index) pair, every axis and keep_dims); the language patched
    once per launch, not again at each helper call, is restored after it."""
    import triton_interpreter
    from triton.runtime import interpreter

    assert interpreter.ReduceOps.generic_reduce is triton_interpreter.vectorized_generic_reduce
    assert interpreter._patch_lang is triton_interpreter.patch_lang_once
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=g) * torch.logspace(-4, 4, 32)
    x[1, 3], x[2, 7], x[5, 0] = float("nan"), float("inf"), float("-inf")
    x[3] = 1.0  # a row of ties: the pair keeps the first index

    def run():
        out = [torch.empty(8), torch.empty(8), torch.empty(8, dtype=torch.int32), torch.empty(1), torch.empty(32)]
        _custom_reduce_kernel[(1,)](x, *out, M=8, N=32)
        return out

    fast = run()
    assert triton_interpreter._launch is None and tl.core.is_builtin(tl.maximum)  # the launch's patch undone
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", triton_interpreter._tritons_generic_reduce)
    monkeypatch.setattr(interpreter, "_patch_lang", triton_interpreter._tritons_patch_lang)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", triton_interpreter._tritons_launch)
    slow = run()
    for a, b in zip(fast, slow):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (a, b)
    assert fast[0].isnan()[1] and fast[2][3].item() == 0


# ------------------------------------------------------------------------- real sizes (GPU only)


@gpu
@pytest.mark.parametrize("shape,kw", [((4096, 8192), {}), ((4096, 8192), {"per_token": True}),
                                      ((2048, 4096), {"tile": (16, 16)})], ids=str)  # fmt: skip
def test_gpu_quantize_real_size(shape, kw):
    x = (torch.randn(shape, device="cuda") * 3).bfloat16()
    _same_q(nvfp4_quant.nvfp4_quantize(x, **kw), nvfp4.quantize(x, **kw), f"{shape} {kw}")


@gpu
@pytest.mark.parametrize("act_scale", ["tensor", "token"])
def test_gpu_rac_real_size(act_scale):
    x = (torch.randn(512, 4096, device="cuda") * torch.rand(4096, device="cuda") * 4).bfloat16()
    a = rac.rac_quantize(x, 2048, act_scale=act_scale, scatter=True)
    b = rac.rac_quantize_reference(x, 2048, act_scale=act_scale, scatter=True)
    _same_q(a.x, b.x, "RAC X")
    assert torch.equal(a.channels, b.channels), "RAC channels differ"
    _same_q(a.residual, b.residual, "RAC residual")
    assert torch.equal(a.scattered, b.scattered)


@gpu
@pytest.mark.parametrize("m", [1, 16, 64, 1024])
@pytest.mark.parametrize("n,k", [(8192, 8192), (28672, 4096)], ids=str)
def test_gpu_gemms_real_size(m, n, k):
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = nvfp4.quantize(torch.randn(n, k, device="cuda").bfloat16())
    xa = nvfp4.quantize(x, per_token=True)
    a = gemm.w4a4_gemm(xa, w, out_dtype=torch.float32)
    b = gemm.w4a4_gemm_reference(xa, w, out_dtype=torch.float32)
    assert _rel(a, b) < GEMM_RTOL, f"W4A4 M={m} N={n} K={k}: {_rel(a, b):.2e}"


def test_tune_space_has_each_grouped_config_once_and_kinds_select_it():
    """The grouped kernel's sweep (8-tuples ending in the register cap and sub_k) has no config twice, covers
    the occupancy configs (sub_k 64, block_k 64, two stages, capped registers), and ``--tune-kinds`` rejects a kind
    that selects nothing before touching a GPU."""
    from quads.bench import _load_bench

    bench = _load_bench()
    moe_cfgs = [c for kind, _, c in bench.tune_space() if kind == "moe"]
    assert len(moe_cfgs) == len(set(moe_cfgs)) and all(len(c) == 8 for c in moe_cfgs)
    assert (64, 64, 4, 2, None, None, 128, None) in moe_cfgs and (64, 128, 4, 3, None, None, None, None) in moe_cfgs
    assert (64, 128, 4, 2, None, None, None, 64) in moe_cfgs
    dense = [(m, c) for kind, m, c in bench.tune_space() if kind == "w4a16"]
    assert len(dense) == len(set(dense)) and all(len(c) == 6 for _, c in dense)
    assert (16, (32, 256, 1, 4, 2, 64)) in dense and (1, (32, 256, 1, 4, 3, None)) in dense
    with pytest.raises(ValueError, match="selects no config"):
        bench.bench_tune([], workers=0, kinds="nope")
    with pytest.raises(ValueError, match="shape groups are 1b and qwen3"):
        bench.bench_tune([], workers=0, kinds="moe", moe_shapes="1b,2b")


def test_tune_suite_writes_a_tuning_table_without_touching_the_modules():
    """The benchmark's tune suite turns its timed rows into a table of tuning.json's form (the fastest config
    per case, summed over the shapes); the launchers' own table stays as read from the file."""
    from quads.bench import _load_bench

    bench = _load_bench()
    before = json.dumps(tuning.table(), sort_keys=True)
    fast, slow = (64, 128, 2, 4, 5), (32, 256, 1, 4, 3)
    rows = [{"bench": "tune w4a16", "shape": f"M={m} N={n} K={k}", "cfg": list(c), "us": us}
            for n, k in bench.TUNE_SHAPES for m in (1, 16, 64) for c, us in ((fast, 9.0), (slow, 10.0))]
    moe_fast, moe_slow = (64, 128, 4, 2, None, 32, 128, 64), (32, 256, 8, 3, 2, 16, None, None)
    rows += [{"bench": "tune moe", "shape": sh, "cfg": list(c), "us": us}
             for sh in ("T=1", "T=16", "T=64", "1b gate_up T=128", "1b down T=128")
             for c, us in ((moe_fast, 5.0), (moe_slow, 6.0))]
    rows.append({"bench": "tune rac_pass4", "shape": "16384x8192 token", "cfg": [2, 512, 4], "us": 1.0})
    rows.append({"bench": "tune rac_pass4", "shape": "16384x8192 tensor", "cfg": [2, 512, 4], "us": 1.0})
    table = bench.tuning_from_rows(rows)
    want = dict(zip(("block_n", "block_k", "split_k", "num_warps", "num_stages"), fast))
    assert all(table["w4a16_gemm"][f"m{b}"] == want for b in (1, 4, 16, 32, 64))
    assert not any(key.startswith("n") for key in table["w4a16_gemm"])  # one winner for both shapes
    assert table["rac_quantize"]["pass4"] == {"block_m": 2, "block_s": 512, "num_warps": 4}
    names = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "block_m", "max_registers", "sub_k")
    assert table["w4a16_grouped_gemm"]["decode"] == {**dict(zip(names, moe_fast)),
        "backend": tuning.config("w4a16_grouped_gemm", "decode")["backend"]}  # the backend is the table's, kept
    assert not any(key in table["w4a16_grouped_gemm"] for key in ("n512_k1024_decode", "n1024_k256_decode"))
    assert table["nvfp4_quantize"] == tuning.table()["nvfp4_quantize"]  # not timed: kept
    # a sweep of the 1b shapes alone: the shared decode entry stays the file's, each 1b shape gets its own
    times = {("1b gate_up T=128", moe_fast): 5.0, ("1b gate_up T=128", moe_slow): 6.0,
             ("1b down T=128", moe_fast): 6.0, ("1b down T=128", moe_slow): 5.0}
    rows_1b = [{"bench": "tune moe", "shape": sh, "cfg": list(c), "us": us} for (sh, c), us in times.items()]
    grouped = bench.tuning_from_rows(rows_1b)["w4a16_grouped_gemm"]
    assert grouped["decode"] == tuning.config("w4a16_grouped_gemm", "decode")
    assert grouped["n512_k1024_decode"] == {**dict(zip(names, moe_fast)), "backend": "triton"}
    assert grouped["n1024_k256_decode"] == {**dict(zip(names, moe_slow)), "backend": "triton"}
    assert grouped["n1536_k2048_decode"] == tuning.config("w4a16_grouped_gemm", "n1536_k2048_decode")  # Qwen3's kept
    assert json.dumps(tuning.table(), sort_keys=True) == before
