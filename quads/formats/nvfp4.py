"""NVFP4: E2M1 values, one E4M3 scale per 16 elements, one FP32 scale per tensor (or per token).

Pure-PyTorch reference. Canonical mode (``mode="te"``) follows TransformerEngine's NVFP4 cast
kernels (``quantize_transpose_nvfp4``: ``compute_global_encode_scaling_factor_FP4``,
``compute_decoding_scaling_factor``, ``compute_scaling_coefficient<float>``, then
``cvt.rn.satfinite.e2m1x2.f32``) exactly, all in IEEE fp32 with round-to-nearest-even, in this
order (DESIGN.md section 3). The input is first cast to fp32 (exact for bf16/fp16):

1. ``amax = max|x|`` over the tensor (``per_token=True``: over the last dim, one per row);
   NaN is ignored by the max (CUDA ``fmaxf`` semantics), +-Inf counts.
2. ``S_enc = 2688 / amax`` (2688 = 448 * 6), ``fminf(S_enc, FLT_MAX)``; 1.0 when amax == 0 or S_enc == 0
   (so also when amax is Inf). ``S_dec = 1 / S_enc`` is what ``NVFP4Tensor.global_scale`` stores.
3. per 16-element block along K: ``s = e4m3(clamp(bamax * (S_enc * fp32(1/6)), -448, 448))``,
   RNE, E4M3 subnormals kept (a block whose scale underflows gets s = 0).
4. ``enc = fminf(1 / (float(s) * S_dec), FLT_MAX)``; ``y = clamp(x * enc, -6, 6)``; E2M1 RNE
   (ties: .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). The sign bit is kept, so a
   negative value that rounds to zero (and -0.0) encodes as -0 (code 0x8). In a block with s = 0,
   enc = FLT_MAX, so nonzero elements get codes +-6 (as the kernel does); they dequantize to 0.
5. dequantize: ``(e2m1 * float(s)) * S_dec`` in fp32; ``e2m1 * s`` is exact.

Non-finite policy (deliberate, tested):

- **NaN is loud and local.** It does not enter any amax (as in the kernels), the codes of the other
  elements of its block are what the kernel computes, the NaN element itself gets code 0x0, and
  the block scale is stored as E4M3 NaN (0x7F), so the *whole block* dequantizes to NaN (with 16x16
  tiles, the whole tile). Other blocks are unaffected. E2M1 has no NaN code and what the hardware
  cvt makes of a NaN cannot be reproduced on a CPU, so we choose the behaviour that cannot hide a
  NaN from training (a NaN weight or activation shows up as NaN in the GEMM output).
- **+-Inf follows the kernel arithmetic.** An Inf makes the amax Inf, so S_enc falls back to 1.0
  (step 2); its block gets s = 448 and the Inf itself code +-6: it dequantizes to +-2688
  (saturation). Small blocks of the same tensor may then underflow, as they would in TE.
- A caller-supplied ``amax`` must be >= 0 and not NaN (``ValueError`` otherwise).

Layouts: ``codes`` uint8 ``[..., K/2]``, element 2i in the low nibble, 2i+1 in the high nibble
(``torch.float4_e2m1fn_x2`` order). ``scales`` float8_e4m3fn ``[..., K/16]``; with 16x16 tiles
(``tile=(16, 16)``, weights ``[..., N, K]``) one scale per tile, stored expanded per row
(``[..., N, K/16]``, rows of a tile repeat it) so every consumer reads scales the same way.
``swizzle_scales`` gives the Blackwell (tcgen05 / cuBLASLt) 128x4-tile layout of a scale matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quads.formats.constants import (
    F4_E2M1_GRID,
    F4_E2M1_MAX,
    F8E4M3_DTYPE,
    F8E4M3_MAX,
    FLT_MAX,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_ENCODE_NUMERATOR,
    SWIZZLE_COLS,
    SWIZZLE_ROWS,
)

MODES = ("te", "torchao", "vllm", "modelopt", "compressed_tensors")
TILES = ((1, 16), (16, 16))

# RNE thresholds on |y| for the E2M1 grid: code = number of thresholds passed. Where the lower neighbour's
# code is even a tie rounds down (strict >), where it is odd a tie rounds up (>=). ``e2m1_rne`` computes this rule.
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@dataclass
class NVFP4Tensor:
    """A quantized tensor. ``global_scale`` is the FP32 *decode* scale S_dec (scalar, or ``[..., 1]``)."""

    codes: torch.Tensor  # uint8 [..., K/2]
    scales: torch.Tensor  # float8_e4m3fn [..., K/16]
    global_scale: torch.Tensor  # float32 [] or [..., 1]
    shape: torch.Size
    dtype: torch.dtype
    tile: tuple[int, int] = (1, 16)
    mode: str = "te"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def check_input(x: torch.Tensor, tile: tuple[int, int], mode: str) -> None:
    """Validate a quantizer input; ``ValueError`` naming what came and what to do."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"nvfp4.quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.is_complex():
        raise ValueError(f"nvfp4.quantize expects a real floating-point tensor, got dtype {x.dtype}; cast it first")
    if mode not in MODES:
        raise ValueError(f"unknown NVFP4 mode {mode!r}; valid modes: {', '.join(MODES)}")
    if tuple(tile) not in TILES:
        raise ValueError(f"unknown tile {tile!r}; valid tiles: (1, 16) for activations/weights, (16, 16) for weights")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"nvfp4.quantize needs a non-empty tensor with at least one dim, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(
            f"the last dim (K) must be a multiple of {NVFP4_BLOCK} for NVFP4 blocks, got shape {tuple(x.shape)}; "
            "pad K or keep this layer in BF16"
        )
    if tuple(tile) == (16, 16) and (x.dim() < 2 or x.shape[-2] % NVFP4_BLOCK):
        raise ValueError(
            f"16x16 tiles need a [..., N, K] tensor with N a multiple of 16, got shape {tuple(x.shape)}; "
            "use tile=(1, 16)"
        )




def check_amax(amax: torch.Tensor | float, x: torch.Tensor, per_token: bool, *, validate: bool = True
               ) -> torch.Tensor:
    """A caller-supplied amax as fp32 on x's device, ``[..., 1]`` when per token; rejects NaN / negative
    (``validate=False``: the caller made it with ``nan_ignoring_amax``; no check, no host sync)."""
    a = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    if validate and (bool(torch.isnan(a).any()) or bool((a < 0).any())):
        raise ValueError(f"amax must be >= 0 and not NaN, got {amax!r}; pass max|x| (Inf is allowed)")
    if per_token and a.dim() == x.dim() - 1:
        a = a.unsqueeze(-1)
    return a


def nan_ignoring_amax(a: torch.Tensor, dim: int | tuple[int, ...] | None) -> torch.Tensor:
    """max|a| with NaN treated as 0 (CUDA ``fmaxf``); ``dim`` (one or several) keeps its size-1 dims."""
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a.abs())
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=True)


_nan_ignoring_amax = nan_ignoring_amax


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = fminf(2688 / amax, FLT_MAX), 1.0 where amax == 0 or S_enc == 0 (fp32)."""
    amax = amax.float()
    # a true fp32 division (as TE): torch's `scalar / tensor` is `reciprocal(tensor) * scalar`, 1 ulp off at times
    s_enc = torch.fmin(torch.full_like(amax, NVFP4_GLOBAL_ENCODE_NUMERATOR) / amax, torch.tensor(FLT_MAX, device=amax.device))
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def e2m1_rne(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 magnitudes in [0, 6] -> (E2M1 value, 3-bit code as int32), RNE, by the FP32 adder.

    With ``p = 2^e`` the binade of ``max(m, 1)`` (e = 0, 1, 2) and ``c = 2^(e+22)``, ``m + c`` has an ulp of
    ``2^(e-1)``, the E2M1 step of that binade (0.5 below 2, including the subnormals 0 and 0.5; 1 below 4;
    2 up to 6), so the FP32 add rounds ``m`` to the grid with ties to even, and the bits of ``m + c``
    above those of ``c`` count the steps q. The code is ``q + 2e``. Same results as the threshold
    comparisons of ``e2m1_round`` (tested exhaustively over fp32 values in [0, 6] around every tie).
    A NaN in ``m`` gives an unspecified value and code.
    """
    p_bits = torch.clamp_min(m, 1.0).view(torch.int32) & 0x7F800000  # bits of 2^e
    c_bits = p_bits + (22 << 23)  # bits of 2^(e+22)
    c = c_bits.view(torch.float32)
    s = m + c
    code = s.view(torch.int32) - c_bits
    code += (p_bits >> 22) - 254  # + 2e: (p_bits >> 22) == 254 + 2e
    return s - c, code


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """fp32 values -> 4-bit codes (uint8, sign in bit 3), RNE; |y| > 6 and +-inf give magnitude code 7,
    NaN gives 0 | sign. The rounding is ``e2m1_rne``; ``_E2M1_THRESHOLDS`` state the same rule."""
    y = y.float()
    code = e2m1_rne(torch.nan_to_num(y.abs().clamp_max(F4_E2M1_MAX), nan=0.0))[1]
    code |= (y.view(torch.int32) >> 28) & 0x8
    return code.to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, one per element) -> fp32 values (code 0x8 -> -0.0)."""
    grid = torch.tensor(F4_E2M1_GRID, dtype=torch.float32, device=codes.device)
    lut = torch.cat([grid, -grid])  # code c -> value, 16 entries
    return lut.index_select(0, (codes & 0xF).reshape(-1).int()).reshape(codes.shape)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes -> [..., K/2] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack needs an even last dim, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] 4-bit codes (inverse of ``pack``)."""
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def _tile_reduce(bam: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """[..., N, K/16] per-1x16-block values -> max over each 16x16 tile, repeated over its 16 rows."""
    if tuple(tile) != (16, 16):
        return bam
    n = bam.shape[-2]
    t = bam.reshape(*bam.shape[:-2], n // NVFP4_BLOCK, NVFP4_BLOCK, bam.shape[-1]).amax(dim=-2, keepdim=True)
    return t.expand(*t.shape[:-3], n // NVFP4_BLOCK, NVFP4_BLOCK, bam.shape[-1]).reshape(bam.shape)


def _block_has_nan(xf: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """[..., K/16] bool: the block (or its 16x16 tile) holds a NaN."""
    return _tile_reduce(torch.isnan(_blocks(xf)).any(dim=-1).to(torch.uint8), tile).bool()


def _te_quantize(
    x: torch.Tensor, tile: tuple[int, int], per_token: bool, amax: torch.Tensor | float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Steps 1-4 of the canonical cast: ``(xf, value, code, scales, s_dec, nan)``.

    ``value`` fp32 E2M1 magnitudes and ``code`` their int32 codes (no sign), ``[..., K/16, 16]``;
    ``scales`` E4M3 with the NaN policy applied; ``nan`` the NaN mask of ``x`` (None when it has none).
    """
    xf = x.float()
    mag = xf.abs()
    bamax_1x16 = _blocks(mag).amax(dim=-1)  # [..., K/16]; a NaN in a block propagates to its max
    nan = None
    if bool(torch.isnan(bamax_1x16).any()):  # NaN ignored by every amax (CUDA fmaxf)
        nan = torch.isnan(mag)
        mag = mag.masked_fill(nan, 0.0)
        bamax_1x16 = _blocks(mag).amax(dim=-1)
    if amax is None:
        amax_t = bamax_1x16.amax(dim=-1, keepdim=True) if per_token else bamax_1x16.amax()
    else:
        amax_t = check_amax(amax, x, per_token)
    s_enc = global_encode_scale(amax_t)  # [] or [..., 1]
    s_dec = 1.0 / s_enc
    if per_token and s_dec.dim() == 0:
        s_dec = s_dec.expand(*xf.shape[:-1], 1).clone()
        s_enc = s_enc.expand(*xf.shape[:-1], 1)
    bamax = _tile_reduce(bamax_1x16, tile)  # [..., K/16]
    inv6 = torch.tensor(1.0 / F4_E2M1_MAX, dtype=torch.float32, device=x.device)
    s_fp32 = torch.clamp(bamax * (s_enc * inv6), -F8E4M3_MAX, F8E4M3_MAX)
    scales = s_fp32.to(F8E4M3_DTYPE)
    enc = torch.fmin(1.0 / (scales.float() * s_dec), torch.tensor(FLT_MAX, device=x.device))  # [..., K/16]
    # |clamp(x * enc, -6, 6)|: enc > 0, so |x * enc| == |x| * enc exactly
    m = (_blocks(mag) * enc.unsqueeze(-1)).clamp_max_(F4_E2M1_MAX)
    value, code = e2m1_rne(m)
    if nan is not None:  # NaN policy: E4M3 NaN scale for the block/tile of a NaN
        scales = torch.where(_block_has_nan(xf, tile), torch.tensor(float("nan"), device=x.device), scales.float())
        scales = scales.to(F8E4M3_DTYPE)
    return xf, value, code, scales, s_dec, nan


def _canonical_only(mode: str, op: str) -> None:
    """This module computes the canonical (te) mode only; the compatibility modes live in nvfp4_compat."""
    if mode != "te":
        raise ValueError(
            f"nvfp4.{op} is the canonical (te) quantizer; mode {mode!r} is a compatibility mode: call "
            f"quads.formats.nvfp4_compat.quantize(x, mode={mode!r}) or quads.quant.ops.nvfp4_{op}"
        )


def quantize(
    x: torch.Tensor,
    *,
    mode: str = "te",
    tile: tuple[int, int] = (1, 16),
    per_token: bool = False,
    amax: torch.Tensor | float | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` [..., K] to NVFP4.

    ``per_token``: one global scale per row (amax over the last dim), ``global_scale`` is ``[..., 1]``.
    ``amax``: use this amax instead of measuring it (e.g. a shared scale for a residual, or a
    calibrated static scale); must broadcast against the measured one.
    ``mode`` must be ``te``: the other modes are other libraries' quantizers, in
    ``quads.formats.nvfp4_compat`` (built on this module); ``quads.quant.ops.nvfp4_quantize`` picks
    the module by mode.
    """
    check_input(x, tile, mode)
    _canonical_only(mode, "quantize")
    xf, _, code, scales, s_dec, nan = _te_quantize(x, tile, per_token, amax)
    code = code.reshape(xf.shape)
    code |= (xf.view(torch.int32) >> 28) & 0x8  # the sign bit of x (that of y = x * enc, enc > 0)
    if nan is not None:  # NaN policy: code 0x0 for the NaN element
        code.masked_fill_(nan, 0)
    return NVFP4Tensor(
        codes=pack(code),
        scales=scales,
        global_scale=s_dec,
        shape=x.shape,
        dtype=x.dtype,
        tile=tuple(tile),
        mode=mode,
    )


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(e2m1 * float(s)) * S_dec`` in fp32, then cast to ``dtype`` (the canonical order, for every mode;
    ``nvfp4_compat.dequantize`` reproduces each library's own order)."""
    vals = e2m1_values(unpack(q.codes))  # [..., K]
    blk = _blocks(vals) * q.scales.float().unsqueeze(-1)
    out = blk.reshape(vals.shape) * q.global_scale.float()
    return out.to(dtype)


def scaled_values(
    x: torch.Tensor,
    *,
    tile: tuple[int, int] = (1, 16),
    per_token: bool = False,
    amax: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical mode: ``(u, S_dec)`` with ``u = copysign(e2m1 value, x) * float(s)`` in fp32 ([..., K];
    exact: at most 6 significant bits) and ``S_dec`` the global decode scale, so that
    ``dequantize(quantize(x)) == u * S_dec``; computed without the codes (``qdq`` is this times S_dec;
    the W4A4 GEMM multiplies ``u`` and applies S_dec to its output, ``quads.quant.factored``)."""
    check_input(x, tile, "te")
    xf, value, _, scales, s_dec, _ = _te_quantize(x, tile, per_token, amax)
    blk = value.copysign_(_blocks(xf)) * scales.float().unsqueeze(-1)
    return blk.reshape(xf.shape), s_dec


def qdq(
    x: torch.Tensor,
    *,
    mode: str = "te",
    tile: tuple[int, int] = (1, 16),
    per_token: bool = False,
    amax: torch.Tensor | float | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quantize then dequantize, returned in ``dtype`` (default ``x.dtype``).

    Canonical mode: the same bits as ``dequantize(quantize(x))``, computed without the codes
    (``copysign(e2m1 value, x) * float(s) * S_dec``; a NaN block's NaN scale makes the block NaN).
    """
    dtype = x.dtype if dtype is None else dtype
    check_input(x, tile, mode)
    _canonical_only(mode, "qdq")
    u, s_dec = scaled_values(x, tile=tile, per_token=per_token, amax=amax)
    return (u * s_dec).to(dtype)


# ---------------------------------------------------------------- swizzled scale layout


def _padded(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-cols // SWIZZLE_COLS) * SWIZZLE_COLS


def swizzle_offset(r: int, c: int, cols: int) -> int:
    """Byte offset of scale (r, c) of an [R, cols] scale matrix in the swizzled buffer."""
    cp = _padded(1, cols)[1]
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[..., R, C] block scales -> [..., Rp * Cp] in the 128x4-tile layout of Blackwell block-scaled GEMMs.

    R is padded to a multiple of 128 and C to a multiple of 4 with zeros; scale (r, c) lands at
    ``((r//128)*(Cp//4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4`` (cuBLAS "1D block scaling
    factors layout", torchao ``to_blocked``, TE ``with_gemm_swizzled_scales``). Works on any dtype
    (float8 scales are moved as bytes).
    """
    if scales.dim() < 2:
        raise ValueError(f"swizzle_scales needs [..., R, C] scales, got shape {tuple(scales.shape)}")
    raw = scales.view(torch.uint8) if scales.element_size() == 1 and scales.is_floating_point() else scales
    *lead, r, c = raw.shape
    rp, cp = _padded(r, c)
    padded = raw.new_zeros(*lead, rp, cp)
    padded[..., :r, :c] = raw
    # row = rb*128 + r4*32 + r32, col = cb*4 + c4  ->  order (rb, cb, r32, r4, c4)
    t = padded.reshape(*lead, rp // 128, 4, 32, cp // 4, 4)
    nl = len(lead)
    t = t.permute(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    out = t.reshape(*lead, rp * cp)
    return out.view(scales.dtype) if raw is not scales else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales``: [..., Rp * Cp] -> [..., rows, cols] (padding dropped)."""
    rp, cp = _padded(rows, cols)
    if swizzled.shape[-1] != rp * cp:
        raise ValueError(
            f"a swizzled buffer for {rows}x{cols} scales has {rp * cp} entries (padded to {rp}x{cp}), "
            f"got last dim {swizzled.shape[-1]}"
        )
    raw = swizzled.view(torch.uint8) if swizzled.element_size() == 1 and swizzled.is_floating_point() else swizzled
    lead = raw.shape[:-1]
    nl = len(lead)
    t = raw.reshape(*lead, rp // 128, cp // 4, 32, 4, 4)  # (rb, cb, r32, r4, c4)
    t = t.permute(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)  # (rb, r4, r32, cb, c4)
    out = t.reshape(*lead, rp, cp)[..., :rows, :cols].contiguous()
    return out.view(swizzled.dtype) if raw is not swizzled else out
