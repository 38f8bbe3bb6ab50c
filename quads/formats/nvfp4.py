"""NVFP4: E2M1 values, one E4M3 scale per 16 elements, one FP32 scale per tensor (or per token).

Pure-PyTorch reference. Canonical mode (``mode="te"``) follows TransformerEngine's kernel arithmetic
exactly, all in IEEE fp32 with round-to-nearest-even, in this order (see DESIGN.md section 3):

1. ``amax = max|x|`` over the tensor (``per_token=True``: over the last dim, one per row);
   NaN is ignored by the max (CUDA ``fmaxf`` semantics).
2. ``S_enc = 2688 / amax`` (2688 = 448 * 6), ``fminf(S_enc, FLT_MAX)``; 1.0 when amax == 0 or S_enc == 0.
   ``S_dec = 1 / S_enc`` is what ``NVFP4Tensor.global_scale`` stores.
3. per 16-element block along K: ``s = e4m3(clamp(bamax * (S_enc * fp32(1/6)), -448, 448))``,
   RNE, E4M3 subnormals kept.
4. ``enc = fminf(1 / (float(s) * S_dec), FLT_MAX)``; ``y = clamp(x * enc, -6, 6)``; E2M1 RNE
   (ties: .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). The sign bit is kept, so a
   negative value that rounds to zero (and -0.0) encodes as -0 (code 0x8).
5. dequantize: ``(e2m1 * float(s)) * S_dec`` in fp32; ``e2m1 * s`` is exact.

Layouts: ``codes`` uint8 ``[..., K/2]``, element 2i in the low nibble, 2i+1 in the high nibble
(``torch.float4_e2m1fn_x2`` order). ``scales`` float8_e4m3fn ``[..., K/16]``; with 16x16 tiles
(``tile=(16, 16)``, weights ``[..., N, K]``) one scale per tile, stored expanded per row
(``[..., N, K/16]``, rows of a tile repeat it) so every consumer reads scales the same way.
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
)

MODES = ("te", "torchao", "vllm", "modelopt", "compressed_tensors")
TILES = ((1, 16), (16, 16))

# RNE thresholds on |y| for the E2M1 grid: code = number of thresholds passed. Where the lower
# neighbour's code is even a tie rounds down (strict >), where it is odd a tie rounds up (>=).
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


def _check_input(x: torch.Tensor, tile: tuple[int, int], mode: str) -> None:
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


def _nan_ignoring_amax(a: torch.Tensor, dim: int | None) -> torch.Tensor:
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a.abs())
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=True)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = fminf(2688 / amax, FLT_MAX), 1.0 where amax == 0 or S_enc == 0 (fp32)."""
    amax = amax.float()
    s_enc = torch.fmin(NVFP4_GLOBAL_ENCODE_NUMERATOR / amax, torch.tensor(FLT_MAX))
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """fp32 values already clamped to [-6, 6] -> 4-bit codes (uint8, sign in bit 3), RNE."""
    mag = y.abs()
    code = torch.zeros_like(y, dtype=torch.uint8)
    for t, inclusive in _E2M1_THRESHOLDS:
        code += (mag >= t if inclusive else mag > t).to(torch.uint8)
    sign = torch.signbit(y).to(torch.uint8) << 3
    return code | sign


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, one per element) -> fp32 values."""
    grid = torch.tensor(F4_E2M1_GRID, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


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


def _block_amax(xf: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Per-block amax, [..., K/16] (16x16 tiles: the tile amax repeated over its 16 rows)."""
    bam = _nan_ignoring_amax(_blocks(xf), dim=-1).squeeze(-1)  # [..., N, K/16]
    if tuple(tile) == (16, 16):
        n = bam.shape[-2]
        t = bam.reshape(*bam.shape[:-2], n // NVFP4_BLOCK, NVFP4_BLOCK, bam.shape[-1]).amax(dim=-2, keepdim=True)
        bam = t.expand(*t.shape[:-3], n // NVFP4_BLOCK, NVFP4_BLOCK, bam.shape[-1]).reshape(bam.shape)
    return bam


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
    Compatibility modes other than ``te`` live in ``quads.formats.nvfp4_compat``.
    """
    _check_input(x, tile, mode)
    if mode != "te":
        from quads.formats import nvfp4_compat

        return nvfp4_compat.quantize(x, mode=mode, tile=tuple(tile), per_token=per_token, amax=amax)
    xf = x.float()
    if amax is None:
        amax_t = _nan_ignoring_amax(xf, dim=-1 if per_token else None)
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
        if per_token and amax_t.dim() == xf.dim() - 1:
            amax_t = amax_t.unsqueeze(-1)
    s_enc = global_encode_scale(amax_t)
    s_dec = 1.0 / s_enc
    if per_token and s_dec.dim() == 0:
        s_dec = s_dec.expand(*xf.shape[:-1], 1).clone()
        s_enc = s_enc.expand(*xf.shape[:-1], 1)
    bamax = _block_amax(xf, tile)  # [..., K/16]
    s_enc_b = s_enc if s_enc.dim() == 0 else s_enc  # [..., 1] broadcasts over blocks
    inv6 = torch.tensor(1.0 / F4_E2M1_MAX, dtype=torch.float32)
    s_fp32 = torch.clamp(bamax * (s_enc_b * inv6), -F8E4M3_MAX, F8E4M3_MAX)
    scales = s_fp32.to(F8E4M3_DTYPE)
    enc = torch.fmin(1.0 / (scales.float() * s_dec), torch.tensor(FLT_MAX))  # [..., K/16]
    y = _blocks(xf) * enc.unsqueeze(-1)
    y = torch.clamp(y, -F4_E2M1_MAX, F4_E2M1_MAX)
    codes = e2m1_round(y).reshape(xf.shape)
    return NVFP4Tensor(
        codes=pack(codes),
        scales=scales,
        global_scale=s_dec,
        shape=x.shape,
        dtype=x.dtype,
        tile=tuple(tile),
        mode=mode,
    )


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(e2m1 * float(s)) * S_dec`` in fp32, then cast to ``dtype``."""
    vals = e2m1_values(unpack(q.codes))  # [..., K]
    blk = _blocks(vals) * q.scales.float().unsqueeze(-1)
    out = blk.reshape(vals.shape) * q.global_scale.float()
    return out.to(dtype)


def qdq(
    x: torch.Tensor,
    *,
    mode: str = "te",
    tile: tuple[int, int] = (1, 16),
    per_token: bool = False,
    amax: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Quantize then dequantize, returned in ``x``'s dtype."""
    return dequantize(quantize(x, mode=mode, tile=tile, per_token=per_token, amax=amax), x.dtype)
