"""NVFP4 compatibility modes vs the real libraries, byte for byte (codes, E4M3 block scales, global scale).

Oracles: torchao, nvidia-modelopt, compressed-tensors run on the CPU (``pip install .[oracles]``);
each test skips, saying which, when its library is missing. vLLM is not installed: its mode is
checked against a golden block derived by hand from ``ref_nvfp4_quant``'s arithmetic.
"""

import sys
import types

import pytest
import torch

from quads.formats import nvfp4, nvfp4_compat

NAN = float("nan")

# ---------------------------------------------------------------- oracles (calls into the libraries)


def _torchao_oracle():
    mod = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason="torchao is the torchao-mode oracle")

    def run(x):
        pts = mod.per_tensor_amax_to_scale(torch.max(torch.abs(x)))  # NVFP4Tensor's dynamic per-tensor scale
        scales, data = mod.nvfp4_quantize(x.contiguous(), 16, pts)
        return data.view(torch.uint8), scales, pts

    return run


def _modelopt_oracle():
    # modelopt.torch imports `requests` for dataset downloads only; the quantizer does not need it.
    sys.modules.setdefault("requests", types.ModuleType("requests"))
    mod = pytest.importorskip(
        "modelopt.torch.quantization.qtensor.nvfp4_tensor", reason="nvidia-modelopt is the modelopt-mode oracle"
    )

    def run(x):
        qt, scales, wsf2 = mod.NVFP4QTensor.quantize(x.clone(), 16)
        return qt._quantized_data, scales, wsf2

    return run


def _ct_oracle():
    helpers = pytest.importorskip(
        "compressed_tensors.quantization.utils.helpers", reason="compressed-tensors is the compressed_tensors-mode oracle"
    )
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization.quant_scheme import NVFP4

    def run(x):
        x2 = x.reshape(-1, x.shape[-1])
        gs = helpers.generate_gparam(*torch.aminmax(x2))
        scale, _ = helpers.compute_dynamic_scales_and_zp(x2, NVFP4["weights"], module=None, global_scale=gs)
        packed = quantize_and_pack_fp4(x2, scale, global_scale=gs)
        return packed, scale.to(torch.float8_e4m3fn), gs

    return run


ORACLES = {"torchao": _torchao_oracle, "modelopt": _modelopt_oracle, "compressed_tensors": _ct_oracle}


def _assert_same(mode, x, oracle):
    data, scales, gs = oracle(x)
    q = nvfp4_compat.quantize(x, mode=mode)
    tag = f"{mode} {x.dtype} {tuple(x.shape)}"
    assert torch.equal(q.codes, data.reshape(q.codes.shape)), f"{tag}: codes differ"
    assert torch.equal(q.scales.view(torch.uint8), scales.reshape(q.scales.shape).view(torch.uint8)), (
        f"{tag}: block scales differ"
    )
    native = nvfp4_compat.global_scale_native(x, mode=mode)
    assert torch.equal(native.reshape(-1).view(torch.int32), gs.float().reshape(-1).view(torch.int32)), (
        f"{tag}: global scale differs ({native} vs {gs})"
    )


def _make(gen, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if gen == "normal":
        x = torch.randn(shape, generator=g)
    else:  # heavy tails: student-t(2) times a lognormal per element, plus a few outliers
        z = torch.randn(shape, generator=g)
        chi = torch.randn((*shape, 2), generator=g).pow(2).sum(-1)
        x = z / (chi / 2).sqrt() * torch.exp(1.5 * torch.randn(shape, generator=g))
        x.view(-1)[:: max(1, x.numel() // 5)] *= 300.0
    return x.to(dtype)


def _special(dtype):
    """Ties, signed zeros, zero blocks, underflowing blocks and subnormal-scale blocks in one tensor."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7)) * 50
    ties = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    x[0, :16] = ties * 100
    x[1, :16] = 0.0
    x[1, 3] = -0.0
    x[1, 16:32] = torch.linspace(-1e-4, 1e-4, 16)  # underflows to a zero/minimum scale
    x[2, 32:48] = ties * 0.05  # subnormal E4M3 scales
    x[3, 48:64] = -0.0
    x[3, 50] = -1e-3
    return x.to(dtype)


MODES_WITH_ORACLE = list(ORACLES)
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(5, 64), (3, 7, 128), (128, 256)]


# ---------------------------------------------------------------- byte for byte vs the libraries


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gen", ["normal", "heavy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES_WITH_ORACLE)
def test_matches_library(mode, dtype, gen, shape):
    _assert_same(mode, _make(gen, shape, dtype), ORACLES[mode]())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES_WITH_ORACLE)
def test_matches_library_special_values(mode, dtype):
    oracle = ORACLES[mode]()
    _assert_same(mode, _special(dtype), oracle)
    _assert_same(mode, torch.zeros(3, 32, dtype=dtype), oracle)  # all-zero tensor
    x = _make("normal", (4, 32), dtype)
    x[1, 2] = NAN
    _assert_same(mode, x, oracle)  # NaN, including the NaN bit patterns each library produces


@pytest.mark.parametrize("mode", MODES_WITH_ORACLE)
def test_per_token_matches_library_row_by_row(mode):
    oracle = ORACLES[mode]()
    x = _make("heavy", (5, 64), torch.bfloat16) * torch.logspace(-2, 2, 5).unsqueeze(1).to(torch.bfloat16)
    q = nvfp4_compat.quantize(x, mode=mode, per_token=True)
    native = nvfp4_compat.global_scale_native(x, mode=mode, per_token=True)
    assert q.global_scale.shape == (5, 1) and native.shape == (5, 1)
    for r in range(5):
        data, scales, gs = oracle(x[r : r + 1])
        assert torch.equal(q.codes[r], data.reshape(-1)), f"{mode} row {r}: codes differ"
        assert torch.equal(q.scales[r].view(torch.uint8), scales.reshape(-1).view(torch.uint8)), f"{mode} row {r}"
        assert native[r, 0].item() == gs.float().item()


# ---------------------------------------------------------------- vLLM: golden block by hand


def test_vllm_golden_block():
    # amax 2688 -> S_enc = 2688/2688 = 1 (vLLM's global_scale, encode form); S_dec = 1.
    x = torch.zeros(1, 48)
    # A: vec_max 2688 -> scale = 1 * (2688 * fp32(1/6)) = 448.00003 -> clamp 448 (0x7E);
    #    out_scale = 1 / (448 * (1 / 1)) = fp32(1/448): 2688 -> 6 (0x7); 672 -> 1.5 (0x3);
    #    -0.0 -> sign(-0.0) = 0, so +0 (0x0, where te gives 0x8); -0.1 -> -0.0 (0x8).
    x[0, :4] = torch.tensor([2688.0, 672.0, -0.0, -0.1])
    # B: vec_max 2^-12 -> scale e4m3(2^-12/6) = 0 (0x00); out_scale = 1/(0 + 1e8) = 1e-8, so the
    #    elements round to +-0 (0x0 / 0x8), where te's FLT_MAX multiplier saturates them to +-6.
    x[0, 16:18] = torch.tensor([2.0**-12, -(2.0**-13)])
    # C: vec_max 6 -> scale 1.0 (0x38), out_scale 1: ties 0.25 -> 0x0, 0.75 -> 0x2, -2.5 -> 0xC, 5 -> 0x6.
    x[0, 32:37] = torch.tensor([6.0, 0.25, 0.75, -2.5, 5.0])
    q = nvfp4_compat.quantize(x, mode="vllm")
    assert nvfp4_compat.global_scale_native(x, mode="vllm").item() == 1.0 and q.global_scale.item() == 1.0
    assert q.scales.view(torch.uint8).tolist() == [[0x7E, 0x00, 0x38]]
    c = nvfp4.unpack(q.codes)[0]
    assert c[:4].tolist() == [0x7, 0x3, 0x0, 0x8] and not c[4:16].any()
    assert c[16:18].tolist() == [0x0, 0x8] and not c[18:32].any()
    assert c[32:37].tolist() == [0x7, 0x0, 0x2, 0xC, 0x6] and not c[37:].any()
    te = nvfp4.quantize(x)  # the canonical mode differs exactly where documented
    assert nvfp4.unpack(te.codes)[0, 16:18].tolist() == [0x7, 0xF] and nvfp4.unpack(te.codes)[0, 2].item() == 0x8


def test_vllm_matches_te_on_ordinary_blocks():
    # Same formulas up to the block-scale multiplication order; on normal data (no zero-scale blocks,
    # no -0.0) the two agree except where S_enc * (bamax * r) and bamax * (S_enc * r) round apart.
    x = _make("normal", (64, 256), torch.float32, seed=3)
    v, t = nvfp4_compat.quantize(x, mode="vllm"), nvfp4.quantize(x)
    same_scale = (v.scales.view(torch.uint8) == t.scales.view(torch.uint8)).float().mean().item()
    same_code = (v.codes == t.codes).float().mean().item()
    assert same_scale > 0.99 and same_code > 0.99, (same_scale, same_code)


def test_vllm_all_zero_tensor_gives_nan_scales():
    q = nvfp4_compat.quantize(torch.zeros(2, 32), mode="vllm")  # S_enc = 2688/0 = Inf -> scale Inf*0 = NaN
    assert torch.isinf(nvfp4_compat.global_scale_native(torch.zeros(2, 32), mode="vllm"))
    assert (q.scales.view(torch.uint8) & 0x7F == 0x7F).all()
    assert ((nvfp4.unpack(q.codes) & 0x7) == 0).all()


# ---------------------------------------------------------------- global scale forms


@pytest.mark.parametrize("mode", nvfp4_compat.MODES)
def test_global_scale_forms(mode):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5)) * 3
    amax = x.abs().max()
    native = nvfp4_compat.global_scale_native(x, mode=mode)
    q = nvfp4_compat.quantize(x, mode=mode)
    if nvfp4_compat.GLOBAL_SCALE_FORM[mode] == "decode":
        assert native.item() == (amax / 2688.0).item() and q.global_scale.item() == native.item()
    else:
        assert native.item() == (2688.0 / amax).item()
        assert q.global_scale.item() == (1.0 / native).item()  # NVFP4Tensor.global_scale is always S_dec
    explicit = nvfp4_compat.global_scale_native(x, mode=mode, amax=amax)
    assert explicit.item() == native.item()


@pytest.mark.parametrize("mode", nvfp4_compat.MODES)
def test_ops_quantize_dispatches_to_compat(mode):
    """The quant layers' entry picks nvfp4_compat by mode; nvfp4 itself is the canonical mode only."""
    from quads.quant import ops

    x = _make("heavy", (4, 64), torch.bfloat16)
    a, b = ops.nvfp4_quantize(x, mode=mode), nvfp4_compat.quantize(x, mode=mode)
    assert a.mode == mode and torch.equal(a.codes, b.codes) and torch.equal(a.global_scale, b.global_scale)
    assert ops.nvfp4_qdq(x, mode=mode).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=f"mode '{mode}' is a compatibility mode: call quads.formats.nvfp4_compat"):
        nvfp4.quantize(x, mode=mode)
    with pytest.raises(ValueError, match=f"nvfp4.qdq is the canonical .* mode '{mode}' is a compatibility mode"):
        nvfp4.qdq(x, mode=mode)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "x, kwargs, match",
    [
        (torch.ones(32, 32), {"mode": "torchao", "tile": (16, 16)}, "1x16 blocks only.*use mode='te'"),
        (torch.ones(4, 32, dtype=torch.float64), {"mode": "vllm"}, "float32 / bfloat16 / float16.*float64"),
        (torch.ones(4, 32), {"mode": "te"}, "unknown NVFP4 compatibility mode 'te'"),
        (torch.ones(4, 32), {"mode": "fp4"}, "unknown NVFP4 compatibility mode 'fp4'"),
        (torch.ones(4, 32, dtype=torch.int8), {"mode": "modelopt"}, "real floating-point.*int8"),
        (torch.ones(4, 24), {"mode": "compressed_tensors"}, "multiple of 16"),
    ],
    ids=["tile", "fp64", "te", "unknown", "int", "K"],
)
def test_bad_input(x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        nvfp4_compat.quantize(x, **kwargs)
