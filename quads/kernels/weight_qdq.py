"""Grouped NVFP4 quantize-dequantize of weights (Triton): the trainer's per-step QAT cache refresh.

``G`` weights of one shape ``[E, N, K]`` (expert stacks, one global scale per expert; a 2-D weight
``[N, K]`` is one expert), each its own tensor (the same stack of every layer), in two kernel launches
for all of them, where ``quads.quant.ops.quantize_weight`` launches about twelve per weight (a dtype
cast, a NaN-ignoring amax in five elementwise ops, a quantize writing codes and scales, a dequantize
reading them back):

1. ``_group_row_amax_kernel``: grid (row tiles, G); each program reads its weight's address from a
   table (int64 ``[G]``, ``int_to_ptr``, as in Triton's grouped-GEMM tutorial) and writes the
   NaN-ignoring amax of its rows, ``[G, E * N]``; torch reduces each expert's rows (exact: a max is
   order-free), ``group_amax``.
2. ``_group_qdq_kernel``: grid (row tiles, K tiles, G); each ``[BLOCK_M, BLOCK_K]`` tile is rounded to
   the operand dtype (RNE, what ``w.to(dtype)`` does before quantizing), quantized with its expert's
   global scale by the same jit function as ``nvfp4_quant``'s quantize kernels, and dequantized in
   registers in ``nvfp4_quant._nvfp4_dequantize_kernel``'s order (``(e2m1 * float(s)) * S_dec``, a NaN
   block's E4M3 NaN scale included): no codes or scales are written. Out ``[G, E, N, K]`` in dtype.

The amax is taken of the masters and rounded to the operand dtype after the max (``amax.to(dtype)``):
RNE is monotone and odd, so ``max|round(w)| == round(max|w|)``, NaN ignored either way. Memory traffic
per element for fp32 masters and BF16 operands: 4 + 4 bytes read and 2 written, against about 50 for
the per-weight chain (100m: ~1.0 GB per refresh instead of ~5.2 GB).

References (same signatures, same bits): ``group_row_amax_reference``, ``nvfp4_qdq_group_reference``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK
from quads.kernels import tuning
from quads.kernels._common import EXACT, HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out, e2m1_times_scale, e4m3_to_f32, f32_to_bf16_rne
    from quads.kernels.nvfp4_quant import _global_scales, _quantize_tile, rows_absmax

    @triton.jit
    def _weight_ptr(x_ptr, table_ptr, g):
        """The base pointer of weight ``g`` (its address from the table, typed like ``x_ptr``), marked
        16-byte aligned (``address_table`` guarantees it) so that the loads can be vectorized."""
        return tl.multiple_of(tl.load(table_ptr + g).to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)

    @triton.jit
    def _round_to(x, out_ptr):
        """fp32 ``x`` rounded (RNE) to the element type of ``out_ptr`` and back to fp32 (exact when x
        already is of that type or narrower)."""
        if out_ptr.dtype.element_ty == tl.bfloat16:
            return f32_to_bf16_rne(x).to(tl.float32)
        elif out_ptr.dtype.element_ty == tl.float16:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _group_row_amax_kernel(x_ptr, table_ptr, out_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[g, r] = max |w_g[r, :]| over the rows ``[M, K]`` of weight g, NaN ignored (CUDA fmaxf)."""
        g = tl.program_id(1)
        src = _weight_ptr(x_ptr, table_ptr, g)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        amax = rows_absmax(src + rows.to(tl.int64) * K, rmask, K, BLOCK_M, BLOCK_K)
        tl.store(out_ptr + g.to(tl.int64) * M + rows, amax, mask=rmask)

    @triton.jit
    def _group_qdq_kernel(
        x_ptr, table_ptr, amax_ptr, out_ptr, M, K, N, E,
        TILE16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[g] = dequantize(quantize(round_to_dtype(w_g))) with expert ``r // N``'s amax, one tile."""
        g = tl.program_id(2)
        src = _weight_ptr(x_ptr, table_ptr, g)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols[None, :] < K)
        r64 = rows.to(tl.int64)
        x = tl.load(src + r64[:, None] * K + cols[None, :], mask=m, other=0.0).to(tl.float32)
        x = _round_to(x, out_ptr)
        amax = tl.load(amax_ptr + g * E + rows // N, mask=rmask, other=0.0)
        s_enc, s_dec = _global_scales(amax)
        _, s_byte, _, codes, s_dec = _quantize_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K, TILE16)
        s16 = e4m3_to_f32(s_byte) * 16384.0  # float(s) * 2**14 (E2M1_F16_SHIFT); NaN for a NaN block
        out = e2m1_times_scale(codes, s16[:, :, None]) * s_dec[:, None, None]  # [BM, BK/16, 16]
        out = tl.reshape(out, (BLOCK_M, BLOCK_K))
        tl.store(out_ptr + (g.to(tl.int64) * M + r64)[:, None] * K + cols[None, :], cast_out(out, out_ptr), mask=m)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use nvfp4_qdq_group_reference (or kernel backend 'reference')")


def _check_group(ws: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    """``(E, N, K)`` of a group of same-shape, same-dtype, same-device contiguous weights; ValueError else."""
    if not ws:
        raise ValueError("expected at least one weight, got none")
    w0 = ws[0]
    if w0.dim() not in (2, 3):
        raise ValueError(f"weights must be [N, K] or [E, N, K], got shape {tuple(w0.shape)}")
    for w in ws:
        if (w.shape, w.dtype, w.device) != (w0.shape, w0.dtype, w0.device) or not w.is_contiguous():
            raise ValueError(
                f"a group holds contiguous weights of one shape, dtype and device; got {tuple(w.shape)} {w.dtype} "
                f"{w.device} (contiguous: {w.is_contiguous()}) beside {tuple(w0.shape)} {w0.dtype} {w0.device}; "
                "group them by (shape, dtype, device) first"
            )
    e = w0.shape[0] if w0.dim() == 3 else 1
    return e, w0.shape[-2], w0.shape[-1]


_TABLES: dict[tuple, torch.Tensor] = {}  # (device, addresses) -> int64 address table on that device


def _aligned(ws: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The weights, each 16-byte aligned (the kernels' address hint): a misaligned view (never a
    parameter of its own: allocations are aligned) is replaced by an aligned copy."""
    return [w if w.data_ptr() % 16 == 0 else w.clone() for w in ws]


def address_table(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 ``[G]`` of the weights' data addresses on their device (cached: the masters keep their
    storage from step to step, so the table is built once; a table holds only addresses, so a cached
    one is right whenever its addresses are; on CUDA copied from pinned memory without a host sync).
    The addresses must be 16-byte aligned (``_aligned``)."""
    if any(w.data_ptr() % 16 for w in ws):
        raise ValueError("address_table: every weight must be 16-byte aligned; pass them through _aligned first")
    key = (ws[0].device, tuple(w.data_ptr() for w in ws))
    t = _TABLES.get(key)
    if t is None:
        if len(_TABLES) > 256:
            _TABLES.clear()
        t = torch.tensor(key[1], dtype=torch.int64)
        if t.device != ws[0].device:  # pinned and non-blocking: no host sync (CUDA keeps the pinned block)
            t = t.pin_memory().to(ws[0].device, non_blocking=True)
        _TABLES[key] = t
    return t


def group_row_amax(ws: Sequence[torch.Tensor], *, block_m: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None) -> torch.Tensor:
    """fp32 ``[G, E * N]``: the NaN-ignoring amax of every row of every weight (one launch)."""
    _require_triton()
    e, n, k = _check_group(ws)
    ws = _aligned(ws)
    m = e * n
    out = torch.empty(len(ws), m, dtype=torch.float32, device=ws[0].device)
    cfg = tuning.config("weight_qdq", "row_amax")
    bm, bk = block_m or cfg["block_m"], min(block_k or cfg["block_k"], triton.next_power_of_2(k))
    _group_row_amax_kernel[(triton.cdiv(m, bm), len(ws))](
        ws[0], address_table(ws), out, m, k, BLOCK_M=bm, BLOCK_K=bk, num_warps=num_warps or cfg["num_warps"], **EXACT
    )
    return out


def group_amax(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """fp32 ``[G, E]``: the NaN-ignoring amax of every expert (2-D weight: of the weight) of every weight
    (``group_row_amax``, then a max over each expert's rows)."""
    e, n, _ = _check_group(ws)
    return group_row_amax(ws).view(len(ws), e, n).amax(dim=-1)


def nvfp4_qdq_group(
    ws: Sequence[torch.Tensor],
    amax: torch.Tensor,
    dtype: torch.dtype,
    tile: tuple[int, int] = (1, 16),
    *,
    block_m: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """``[G, *shape]`` in ``dtype``: ``nvfp4.dequantize(nvfp4.quantize(w.to(dtype), amax=amax[g]), dtype)``
    of every weight ``w = ws[g]``, expert e with the global amax ``amax[g, e]`` (fp32 ``[G, E]``, >= 0, not
    NaN, the amax of ``w[e].to(dtype)``), in one launch, bit-exact with the reference."""
    _require_triton()
    e, n, k = _check_group(ws)
    nvfp4.check_input(ws[0], tile, "te")
    if k % NVFP4_BLOCK:
        raise ValueError(f"K must be a multiple of {NVFP4_BLOCK}, got shape {tuple(ws[0].shape)}")
    if amax.shape != (len(ws), e) or amax.dtype != torch.float32:
        raise ValueError(f"amax must be fp32 [G, E] = [{len(ws)}, {e}], got {amax.dtype} {tuple(amax.shape)}")
    tile16 = tuple(tile) == (16, 16)
    ws = _aligned(ws)
    m = e * n
    out = torch.empty(len(ws), *ws[0].shape, dtype=dtype, device=ws[0].device)
    cfg = tuning.config("weight_qdq", "tile16" if tile16 else "qdq")
    bm = block_m or cfg["block_m"]
    if tile16 and bm % 16:
        raise ValueError(f"16x16 tiles need block_m % 16 == 0, got {bm}")
    bk = min(block_k or cfg["block_k"], triton.next_power_of_2(k))
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk), len(ws))
    _group_qdq_kernel[grid](
        ws[0], address_table(ws), amax.contiguous(), out, m, k, n, e,
        TILE16=tile16, BLOCK_M=bm, BLOCK_K=bk, num_warps=num_warps or cfg["num_warps"], **EXACT,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------ the references


def group_row_amax_reference(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """``group_row_amax`` in PyTorch (``nvfp4.nan_ignoring_amax`` of each weight's rows)."""
    _check_group(ws)
    return torch.stack([nvfp4.nan_ignoring_amax(w.float().reshape(-1, w.shape[-1]), dim=-1)[:, 0] for w in ws])


def nvfp4_qdq_group_reference(
    ws: Sequence[torch.Tensor], amax: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int] = (1, 16)
) -> torch.Tensor:
    """``nvfp4_qdq_group`` in PyTorch: the fused ``nvfp4.qdq`` of each weight with its experts' amax."""
    e, _, _ = _check_group(ws)
    shape = (e, 1, 1) if ws[0].dim() == 3 else ()
    return torch.stack([nvfp4.qdq(w.to(dtype), tile=tile, amax=a.reshape(shape), dtype=dtype) for w, a in zip(ws, amax)])
