"""NVFP4 compatibility modes: other libraries' NVFP4 quantizers, reproduced byte for byte.

Each mode re-does one library's arithmetic, op for op in the same dtypes, so that codes, E4M3
block scales and the global scale equal what that library writes (tests/test_nvfp4_compat.py
checks it against the installed libraries). ``NVFP4Tensor.global_scale`` is always our S_dec
(fp32 decode factor, ``x ~= e2m1 * s * S_dec``); ``global_scale_native`` returns the scale in the
form the library stores. Compatibility modes take fp32 / bf16 / fp16 inputs and 1x16 blocks only.

| mode | library function reproduced | global scale stored | block scale | zero / underflowing block |
|---|---|---|---|---|
| ``torchao`` | ``nvfp4_quantize(x, 16, per_tensor_scale=amax/2688)`` (NVFP4Tensor.to_nvfp4, dynamic per-tensor scale) | decode ``amax/2688`` | ``e4m3(clamp((bamax/6)/S_dec, 2^-6, 448))`` | clamped up to 2^-6 (no subnormal scales) |
| ``modelopt`` | ``NVFP4QTensor.quantize(x, 16)`` (the export path) | decode ``amax/2688`` | ``e4m3(clamp(bamax/(6*S_dec), 2^-9, 448))`` | zero -> 1.0, underflow -> 2^-9 |
| ``vllm`` | ``ref_nvfp4_quant(x, S_enc, 16)`` (``nvfp4_emulation_utils``; vLLM is not installed, transcribed) | encode ``2688/amax`` | ``e4m3(clamp(S_enc*(bamax*(1/6)), +-448))`` | subnormal kept, 0 kept |
| ``compressed_tensors`` | ``generate_gparam`` + ``calculate_qparams`` (TENSOR_GROUP NVFP4 preset) + ``quantize_and_pack_fp4`` | encode ``2688/amax`` | ``e4m3(clamp(gs*(bamax/6 in x's dtype), +-448))`` | 0 -> 0.125 |

Element step: torchao ``x * ((1/S_dec)/s)``; modelopt ``x / (s*S_dec)``; vLLM
``x * 1/(s * 1/S_enc)`` (1e8 guard: a zero scale gives a 1e-8 multiplier, not Inf); compressed-tensors
``x / (s/gs)``. All round E2M1 to nearest even with the same ties as the canonical mode.

Special values, as each library does them (so do not rely on them for anything but comparison):

- ``-0.0``: torchao and the canonical mode give code 0x8; modelopt and compressed-tensors give 0x0
  (sign taken from ``x < 0`` / ``sign(x)``); vLLM gives 0x0 (``sign(-0.0) = 0``). A negative value that
  rounds to zero gets 0x8 in every mode.
- all-zero tensor: the global scale degenerates. torchao and modelopt (``amax/2688 = 0``) give NaN
  block scales; vLLM (``2688/0 = Inf``) gives NaN scales; compressed-tensors replaces Inf by 1.0 and
  gives the 0.125 zero-block scale with zero codes.
- NaN: torchao, modelopt, vLLM propagate it into the global amax (``torch.max``), so the whole tensor
  gets NaN scales; compressed-tensors replaces a NaN global scale by 1.0 but its block scale is NaN.
  NaN codes follow each library's cast: torchao's integer rounding trick gives a payload-dependent
  code (0x3 for 0x7FC00000, 0xC for the 0xFFFFFFFF NaN that ``torch.max`` returns), modelopt's
  ``searchsorted`` gives 0x7, the others give 0x0 / 0x8 by the NaN's sign bit. Since they depend on
  NaN payloads, the reproduction uses the same reductions as each library (``torch.max`` vs ``amax``).
"""

from __future__ import annotations

import torch

from quads.formats.constants import (
    F4_E2M1_MAX,
    F8E4M3_DTYPE,
    F8E4M3_MAX,
    F8E4M3_MIN_NORMAL,
    F8E4M3_MIN_SUBNORMAL,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_ENCODE_NUMERATOR,
)
from quads.formats.nvfp4 import NVFP4Tensor, check_amax, check_input, e2m1_round, pack

MODES = ("torchao", "vllm", "modelopt", "compressed_tensors")
GLOBAL_SCALE_FORM = {"torchao": "decode", "modelopt": "decode", "vllm": "encode", "compressed_tensors": "encode"}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_CT_ZERO_SCALE = 0.125  # compressed-tensors _get_dtype_eps(float8_e4m3fn): replaces zero block scales
_MODELOPT_ZERO_SCALE = 1.0  # modelopt: per_block_scale[per_block_scale == 0] = 1.0
_VLLM_RECIPROCAL_GUARD = 1e8  # vLLM get_reciprocal: 1 / (t + (t == 0) * 1e8)
_MODELOPT_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_MODELOPT_ODD_BOUNDS = (0.75, 1.75, 3.5)  # searchsorted ties that round up


def _validate(x: torch.Tensor, mode: str, tile: tuple[int, int]) -> None:
    check_input(x, tile, "te" if mode not in MODES else mode)
    if mode not in MODES:
        raise ValueError(f"unknown NVFP4 compatibility mode {mode!r}; valid: {', '.join(MODES)} (or 'te' in nvfp4)")
    if tuple(tile) != (1, NVFP4_BLOCK):
        raise ValueError(f"mode {mode!r} supports 1x16 blocks only, got tile {tile!r}; use mode='te' for 16x16 tiles")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"mode {mode!r} takes float32 / bfloat16 / float16 inputs, got {x.dtype}; cast it first")


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def _as_block_param(g: torch.Tensor) -> torch.Tensor:
    """A global scale [] or [..., 1] -> broadcastable against [..., G, 16]."""
    return g if g.dim() == 0 else g.unsqueeze(-1)


# ---------------------------------------------------------------- global scales


def _ct_global_scale(x: torch.Tensor, per_token: bool, amax: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors ``generate_gparam``: 2688 / max(|min|, |max|) in the input's dtype, NaN/Inf -> 1."""
    if amax is None:
        if per_token:
            mn, mx = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        else:
            mn, mx = torch.aminmax(x)
        mn = torch.min(mn, torch.zeros_like(mn))
        mx = torch.max(mx, torch.zeros_like(mx))
        mvp = torch.max(torch.abs(mn), torch.abs(mx))
    else:
        mvp = amax
    mvp = torch.clamp(mvp, min=torch.finfo(mvp.dtype).tiny)
    gs = NVFP4_GLOBAL_ENCODE_NUMERATOR / mvp
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def _measure_amax(x: torch.Tensor, mode: str, per_token: bool) -> torch.Tensor:
    """max|x| with the library's own reduction ops (they differ in the NaN they return)."""
    if mode == "modelopt":  # reduce_amax: max(|max x|, |min x|)
        if per_token:
            return torch.maximum(x.amax(dim=-1, keepdim=True).abs(), x.amin(dim=-1, keepdim=True).abs())
        return torch.maximum(torch.abs(torch.max(x)), torch.abs(torch.min(x)))
    return torch.abs(x).amax(dim=-1, keepdim=True) if per_token else torch.max(torch.abs(x))


def global_scale_native(
    x: torch.Tensor, *, mode: str, per_token: bool = False, amax: torch.Tensor | float | None = None
) -> torch.Tensor:
    """The global scale as ``mode``'s library stores it (``GLOBAL_SCALE_FORM[mode]``), fp32 ``[]`` or ``[..., 1]``.

    decode form (torchao ``per_tensor_scale``, modelopt ``weights_scaling_factor_2``): ``amax / 2688``;
    encode form (vLLM ``global_scale``, compressed-tensors ``weight_global_scale``): ``2688 / amax``.
    ``amax`` defaults to ``max|x|`` (per row with ``per_token``), measured as the library does
    (NaN propagates).
    """
    _validate(x, mode, (1, NVFP4_BLOCK))
    a = None if amax is None else check_amax(amax, x, per_token)
    if mode == "compressed_tensors":
        return _ct_global_scale(x, per_token, a)
    if a is None:
        a = _measure_amax(x, mode, per_token).float()
    if GLOBAL_SCALE_FORM[mode] == "decode":
        return a / NVFP4_GLOBAL_ENCODE_NUMERATOR
    return NVFP4_GLOBAL_ENCODE_NUMERATOR / a


# ---------------------------------------------------------------- per-library quantizers
# Each takes x [..., K] and the native global scale, returns (codes uint8 [..., K], scales e4m3 [..., K/16]).


def _torchao_e2m1(y: torch.Tensor) -> torch.Tensor:
    """torchao ``f32_to_f4_unpacked`` on values already clamped to [-6, 6]: RNE, and for NaN its integer
    rounding trick applied to the NaN's bits (0x7FC00000 gives magnitude code 3)."""
    codes = e2m1_round(torch.nan_to_num(y, nan=0.0))
    bits = y.view(torch.int32)
    mag = bits & 0x7FFFFFFF
    odd = (mag >> 22) & 1
    nan_code = ((mag + ((1 - 127) << 23) + ((1 << 21) - 1) + odd) >> 22).to(torch.uint8)  # wraps like torchao
    sign = ((bits >> 28) & 0x8).to(torch.uint8)
    return torch.where(torch.isnan(y), nan_code | sign, codes)


def _torchao(x: torch.Tensor, pts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x.float())  # [..., G, 16]
    block_scale = torch.amax(torch.abs(xb), dim=-1) / F4_E2M1_MAX  # [..., G]
    s8 = torch.clamp(block_scale / pts, min=F8E4M3_MIN_NORMAL, max=F8E4M3_MAX).to(F8E4M3_DTYPE)
    recip = (1.0 / pts) / s8.float()
    y = torch.clamp(xb * recip.unsqueeze(-1), -F4_E2M1_MAX, F4_E2M1_MAX)
    return _torchao_e2m1(y).reshape(x.shape), s8


def _modelopt(x: torch.Tensor, wsf2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x)
    bam = torch.maximum(xb.amax(dim=-1).abs(), xb.amin(dim=-1).abs()).float()  # [..., G] reduce_block_amax
    pbs = bam / (F4_E2M1_MAX * wsf2)
    pbs = torch.where(pbs == 0, torch.full_like(pbs, _MODELOPT_ZERO_SCALE), pbs)
    s8 = pbs.clamp(min=F8E4M3_MIN_SUBNORMAL, max=F8E4M3_MAX).to(F8E4M3_DTYPE)
    y = xb / (s8.to(torch.float32) * wsf2).unsqueeze(-1)  # promotes to fp32
    sign = (y < 0).to(torch.uint8)
    a = y.abs()
    bounds = torch.tensor(_MODELOPT_E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    ordinal = torch.searchsorted(bounds, a.contiguous(), out_int32=True).to(torch.uint8)
    odd = torch.tensor(_MODELOPT_ODD_BOUNDS, dtype=torch.float32, device=x.device)
    tie_up = torch.any(a.unsqueeze(-1) == odd, dim=-1).to(torch.uint8)
    return ((sign << 3) + ordinal + tie_up).reshape(x.shape), s8


def _vllm_reciprocal(t: torch.Tensor) -> torch.Tensor:
    return 1.0 / (t + (t == 0) * _VLLM_RECIPROCAL_GUARD)


def _sign_times_rounded(y: torch.Tensor) -> torch.Tensor:
    """``sign(y) * rne_e2m1(|y|)`` as float values (vLLM / compressed-tensors ``cast_to_fp4``)."""
    a = torch.abs(y)
    r = torch.where(a <= 0.25, 0.0, a)
    for lo, hi, lo_in, hi_in, v in (
        (0.25, 0.75, False, False, 0.5),
        (0.75, 1.25, True, True, 1.0),
        (1.25, 1.75, False, False, 1.5),
        (1.75, 2.5, True, True, 2.0),
        (2.5, 3.5, False, False, 3.0),
        (3.5, 5.0, True, True, 4.0),
    ):
        inside = ((a >= lo) if lo_in else (a > lo)) & ((a <= hi) if hi_in else (a < hi))
        r = torch.where(inside, torch.full_like(a, v), r)
    r = torch.where(a > 5.0, torch.full_like(a, F4_E2M1_MAX), r)
    return r * torch.sign(y)


def _vllm(x: torch.Tensor, s_enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = _as_block_param(s_enc)
    xb = _blocks(x)
    vec_max = torch.abs(xb).amax(dim=-1, keepdim=True).to(torch.float32)  # [..., G, 1]
    scale = g * (vec_max * (1 / F4_E2M1_MAX))
    scale = torch.clamp(scale, max=F8E4M3_MAX, min=-F8E4M3_MAX).to(F8E4M3_DTYPE)
    out_scale = _vllm_reciprocal(scale.to(torch.float32) * _vllm_reciprocal(g))
    y = torch.clamp(xb.to(torch.float32) * out_scale, -F4_E2M1_MAX, F4_E2M1_MAX)
    return e2m1_round(_sign_times_rounded(y)).reshape(x.shape), scale.squeeze(-1)


def _ct_pack_codes(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack_fp4_to_uint8`` index mapping (before nibble packing)."""
    sign = torch.signbit(q).to(torch.uint8)
    m = (q * 2).to(torch.int8).abs_()
    idx = torch.zeros_like(m, dtype=torch.uint8)
    for value, code in ((1, 1), (2, 2), (3, 3), (4, 4), (6, 5), (8, 6)):
        idx = torch.where(m == value, torch.full_like(idx, code), idx)
    idx = torch.where(m >= 12, torch.full_like(idx, 7), idx)
    return idx | (sign << 3)


def _compressed_tensors(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gs1 = gs.reshape(1) if gs.dim() == 0 else gs  # keep it dimensioned: fp32 * bf16 promotes to fp32
    xb = _blocks(x)  # in x's dtype, as calculate_qparams sees it
    mn, mx = xb.amin(dim=-1), xb.amax(dim=-1)
    mn = torch.min(mn, torch.zeros_like(mn))
    mx = torch.max(mx, torch.zeros_like(mx))
    mvp = torch.max(torch.abs(mn), torch.abs(mx))
    half_range = torch.tensor(2 * F4_E2M1_MAX, device=x.device).to(mvp.dtype) / 2
    scales = gs1 * (mvp / half_range)  # fp32
    scales = torch.clamp(scales, -F8E4M3_MAX, F8E4M3_MAX).to(F8E4M3_DTYPE).to(scales.dtype)
    scales = torch.where(scales == 0, torch.tensor(_CT_ZERO_SCALE, dtype=scales.dtype, device=x.device), scales)
    eff = scales.unsqueeze(-1) / _as_block_param(gs1)  # _quantize: scale / global_scale
    lim = torch.tensor(F4_E2M1_MAX, device=x.device)
    q = _sign_times_rounded(torch.clamp(xb / eff, -lim, lim)).to(x.dtype)
    return _ct_pack_codes(q).reshape(x.shape), scales.to(F8E4M3_DTYPE)


_QUANTIZERS = {
    "torchao": _torchao,
    "modelopt": _modelopt,
    "vllm": _vllm,
    "compressed_tensors": _compressed_tensors,
}


def quantize(
    x: torch.Tensor,
    *,
    mode: str,
    tile: tuple[int, int] = (1, NVFP4_BLOCK),
    per_token: bool = False,
    amax: torch.Tensor | float | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` [..., K] as ``mode``'s library does; ``global_scale`` is S_dec (fp32).

    For encode-form libraries S_dec = fp32(1 / S_enc); the stored S_enc is ``global_scale_native``.
    ``per_token`` applies the library's formulas with one global scale per row.
    """
    _validate(x, mode, tile)
    native = global_scale_native(x, mode=mode, per_token=per_token, amax=amax)
    codes, scales = _QUANTIZERS[mode](x, native)
    s_dec = native if GLOBAL_SCALE_FORM[mode] == "decode" else 1.0 / native
    if per_token and s_dec.dim() == 0:
        s_dec = s_dec.expand(*x.shape[:-1], 1).clone()
    return NVFP4Tensor(
        codes=pack(codes),
        scales=scales,
        global_scale=s_dec,
        shape=x.shape,
        dtype=x.dtype,
        tile=(1, NVFP4_BLOCK),
        mode=mode,
    )
