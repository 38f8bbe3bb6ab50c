"""FP8 E4M3 (max 448) with FP32 *decode* scales: per tensor, per row, or per block.

Pure-PyTorch reference, all arithmetic IEEE fp32:

1. ``amax = max|x|`` over the scaling group (the tensor, one row, or one block), over **finite**
   values only: NaN and +-Inf do not enter the amax (policy below).
2. ``scale = amax / 448`` (fp32); ``scale = 1.0`` where ``amax == 0`` (an all-zero, or all
   non-finite, group), so that zeros stay exact zeros and no division by zero happens.
3. ``data = e4m3(clamp(x / scale, -448, 448))``: a saturating cast, round to nearest even
   (``torch``'s fp32 -> float8_e4m3fn cast), E4M3 subnormals kept, -0.0 kept.
4. dequantize: ``float(data) * scale`` in fp32, then cast.

Granularities (``x`` is ``[..., K]``, weights ``[N, K]``, activations ``[..., T, K]`` or ``[T, K]``):

- ``"tensor"``: one scale, ``scale.shape == []``.
- ``"row"``: one scale per row, ``scale.shape == [..., 1]`` (per-token activations, or
  per-output-channel weights ``[N, K] -> [N, 1]``).
- ``"block"``: DeepSeek-V3 style. ``block=(1, 128)`` (activations): ``scale [..., K/128]``;
  ``block=(128, 128)`` (weights ``[..., N, K]``): ``scale [..., N/128, K/128]``. Any ``(r, c)`` works;
  the covered dims must be multiples of the block (a ``ValueError`` says so otherwise: pad, or use
  ``"row"``).

Non-finite policy (deliberate): NaN stays NaN (E4M3 has a NaN code, 0x7F/0xFF), +-Inf saturates to
+-448 (so it dequantizes to +-448 * scale), and neither changes the scale of its group. This keeps
one bad element from zeroing (Inf in the amax) or poisoning (NaN in the amax) its whole group.

``torch._scaled_mm`` convention (out = (A @ B) * scale_a * scale_b, scales are decode factors, B
column-major). For ``y = x @ w.T`` with ``a = quantize(x2d, ...)`` ``[M, K]`` and
``b = quantize(w, ...)`` ``[N, K]``::

    torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale, scale_b=b.scale.t(), out_dtype=torch.bfloat16)

- tensor x tensor: ``a.scale`` and ``b.scale`` are 0-dim fp32 (``.t()`` of a 0-dim tensor is itself).
- row x row: ``a.scale [M, 1]``, ``b.scale.t() [1, N]`` (both contiguous).
- block (1, 128) x block (128, 128): ``a.scale [M, K/128]``, ``b.scale.t() [K/128, N/128]``; cuBLAS
  wants both outer-dim-major: pass ``a.scale.t().contiguous().t()`` and ``b.scale.t()`` as is
  (checked on an H200 with torch 2.11).
``scaled_mm_reference`` below computes the same product in fp32 on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quads.formats.constants import F8E4M3_DTYPE, F8E4M3_MAX, FP8_ACT_BLOCK

GRANULARITIES = ("tensor", "row", "block")


@dataclass
class FP8Tensor:
    """An FP8 E4M3 tensor with FP32 decode scales: ``x ~= float(data) * scale`` (broadcast per group)."""

    data: torch.Tensor  # float8_e4m3fn, same shape as the input
    scale: torch.Tensor  # float32: [] (tensor), [..., 1] (row), [..., R/r, K/c] or [..., K/c] (block)
    shape: torch.Size
    dtype: torch.dtype  # the input's dtype (what ``dequantize`` returns by default)
    granularity: str = "tensor"
    block: tuple[int, int] = (1, FP8_ACT_BLOCK)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype)


def _check_input(x: torch.Tensor, granularity: str, block: tuple[int, int]) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fp8.quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.is_complex():
        raise ValueError(f"fp8.quantize expects a real floating-point tensor, got dtype {x.dtype}; cast it first")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown FP8 granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if x.numel() == 0:
        raise ValueError(f"fp8.quantize needs a non-empty tensor, got shape {tuple(x.shape)}")
    if granularity == "tensor":
        return (1, 1)
    if x.dim() == 0:
        raise ValueError(f"granularity {granularity!r} needs at least one dim, got a 0-dim tensor; use 'tensor'")
    if granularity == "row":
        return (1, 1)
    try:
        br, bc = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"block must be a pair of positive ints like (1, 128) or (128, 128), got {block!r}") from None
    if br < 1 or bc < 1:
        raise ValueError(f"block must be a pair of positive ints like (1, 128) or (128, 128), got {block!r}")
    k = x.shape[-1]
    if k % bc:
        raise ValueError(
            f"block {block} needs the last dim (K) to be a multiple of {bc}, got shape {tuple(x.shape)}; "
            "pad K or use granularity='row'"
        )
    if br > 1 and (x.dim() < 2 or x.shape[-2] % br):
        raise ValueError(
            f"block {block} needs a [..., N, K] tensor with N a multiple of {br}, got shape {tuple(x.shape)}; "
            "pad N, use block=(1, 128), or use granularity='row'"
        )
    return (br, bc)


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and +-Inf replaced by 0: what the amax sees."""
    a = x.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def _group_view(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[..., R, K] -> [..., R/br, br, K/bc, bc] (br == 1: [..., K] -> [..., K/bc, bc])."""
    if br == 1:
        return x.reshape(*x.shape[:-1], x.shape[-1] // bc, bc)
    r, k = x.shape[-2], x.shape[-1]
    return x.reshape(*x.shape[:-2], r // br, br, k // bc, bc)


def _expand_scale(scale: torch.Tensor, shape: torch.Size, granularity: str, block: tuple[int, int]) -> torch.Tensor:
    """Broadcastable per-element view of the scale for ``shape`` (grouped layout for blocks)."""
    if granularity != "block":
        return scale
    br, _ = block
    if br == 1:
        return scale.unsqueeze(-1)  # [..., K/bc, 1]
    return scale.unsqueeze(-1).unsqueeze(-3)  # [..., R/br, 1, K/bc, 1]


def compute_scale(amax: torch.Tensor) -> torch.Tensor:
    """Decode scale ``amax / 448`` in fp32; 1.0 where ``amax == 0``."""
    amax = amax.float()
    s = amax / F8E4M3_MAX
    return torch.where(amax == 0, torch.ones_like(s), s)


def saturating_cast(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, RNE, finite values beyond +-448 (and +-Inf) clamp to +-448, NaN stays NaN."""
    return torch.clamp(y.float(), -F8E4M3_MAX, F8E4M3_MAX).to(F8E4M3_DTYPE)


def quantize(
    x: torch.Tensor, *, granularity: str = "tensor", block: tuple[int, int] = (1, FP8_ACT_BLOCK)
) -> FP8Tensor:
    """Quantize ``x`` to FP8 E4M3 with FP32 decode scales (see the module docstring)."""
    br, bc = _check_input(x, granularity, block)
    xf = x.float()
    a = _finite_abs(xf)
    if granularity == "tensor":
        amax = a.amax()
    elif granularity == "row":
        amax = a.amax(dim=-1, keepdim=True)
    elif br == 1:
        amax = _group_view(a, 1, bc).amax(dim=-1)  # [..., K/bc]
    else:
        amax = _group_view(a, br, bc).amax(dim=(-3, -1))  # [..., R/br, K/bc]
    scale = compute_scale(amax)
    if granularity == "block":
        y = _group_view(xf, br, bc) / _expand_scale(scale, xf.shape, granularity, (br, bc))
        y = y.reshape(xf.shape)
    else:
        y = xf / scale
    return FP8Tensor(
        data=saturating_cast(y),
        scale=scale,
        shape=x.shape,
        dtype=x.dtype,
        granularity=granularity,
        block=(br, bc) if granularity == "block" else (1, FP8_ACT_BLOCK),
    )


def dequantize(q: FP8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``float(data) * scale`` in fp32, then cast to ``dtype`` (default: the input's dtype)."""
    d = q.data.float()
    if q.granularity == "block":
        br, bc = q.block
        out = (_group_view(d, br, bc) * _expand_scale(q.scale, d.shape, "block", q.block)).reshape(d.shape)
    else:
        out = d * q.scale
    return out.to(q.dtype if dtype is None else dtype)


def qdq(
    x: torch.Tensor, *, granularity: str = "tensor", block: tuple[int, int] = (1, FP8_ACT_BLOCK)
) -> torch.Tensor:
    """Quantize then dequantize, returned in ``x``'s dtype."""
    return dequantize(quantize(x, granularity=granularity, block=block), x.dtype)


def scaled_mm_reference(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 reference of ``torch._scaled_mm(a.data, b.data.t(), a.scale, b.scale.t())`` = ``a @ b.T``.

    ``a`` is ``[M, K]``, ``b`` is ``[N, K]``. Tensor/row scales factor out of the K sum:
    ``(float(a.data) @ float(b.data).T) * scale_a * scale_b``. Block scales are applied per K block
    (each partial product of one 128-wide K slice is scaled, then summed), as the kernels do.
    """
    if a.data.dim() != 2 or b.data.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_mm_reference needs a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32  # fp64 only for exact tests
    ad, bd = a.data.to(acc), b.data.to(acc)
    if a.granularity != "block" and b.granularity != "block":
        sa = (a.scale if a.scale.dim() == 0 else a.scale.reshape(-1, 1)).to(acc)  # [] or [M, 1]
        sb = (b.scale if b.scale.dim() == 0 else b.scale.reshape(1, -1)).to(acc)  # [] or [1, N]
        return ((ad @ bd.T) * sa * sb).to(out_dtype)
    if a.granularity != "block" or b.granularity != "block" or a.block[1] != b.block[1] or a.block[0] != 1:
        raise ValueError(
            "scaled_mm_reference mixes block scales only as a: block (1, c) with b: block (r, c), "
            f"got a: {a.granularity} {a.block}, b: {b.granularity} {b.block}"
        )
    c = a.block[1]
    m, k = ad.shape
    n = bd.shape[0]
    nb = k // c
    sa = a.scale.to(acc)  # [M, K/c]
    sb = (b.scale if b.block[0] == 1 else b.scale.repeat_interleave(b.block[0], dim=0)).to(acc)  # [N, K/c]
    partial = torch.einsum("mjc,njc->jmn", ad.reshape(m, nb, c), bd.reshape(n, nb, c))  # [K/c, M, N]
    out = (partial * sa.T.unsqueeze(-1) * sb.T.unsqueeze(1)).sum(0)
    return out.to(out_dtype)
