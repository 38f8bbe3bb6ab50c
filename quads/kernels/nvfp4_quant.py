"""NVFP4 quantize / dequantize kernels (Triton), bit-exact with ``quads.formats.nvfp4`` (mode ``te``).

Passes (x viewed as rows ``[M, K]``, leading dims flattened):

- per token (``per_token=True``, no ``amax``): ONE kernel. For K <= ``QUANT_ROW_MAX_K`` each program
  loads ``BLOCK_M`` whole rows into registers once (``_nvfp4_quantize_tile_kernel``), takes the row
  amax and quantizes from the registers; longer rows (or 16x16 tiles) use the looping kernel, which
  sweeps K for the amax and again (from L2) to quantize. Either way x crosses HBM once.
- per tensor / per group (``amax`` given, e.g. ``[E, 1, 1]`` per expert, or measured): the
  ``_row_amax_kernel`` pass writes one NaN-ignoring amax per row, torch reduces rows to the group
  amax (exact: a max is order-free), then the one-tile kernel, on a 2D grid of [BLOCK_M, BLOCK_K]
  tiles, reads one amax per row (row stride 0 for a single global amax). x crosses HBM twice; the amax pass is the price of a per-tensor scale
  measured on the fly (give ``amax`` to skip it).

Per block of 16 (1x16) or 16x16 tile the kernel does exactly the reference's fp32 operations in the
reference's order: ``S_enc = fmin(2688 / amax, FLT_MAX)`` (1 for amax 0), ``S_dec = 1 / S_enc``,
``s = e4m3(min(bamax * (S_enc * fp32(1/6)), 448))``, ``enc = fmin(1 / (float(s) * S_dec), FLT_MAX)``,
``code = e2m1_rne(x * enc)`` with the sign of x. Outputs: packed codes ``[M, K/2]`` (low nibble =
even element), e4m3 scales ``[M, K/16]`` (linear) or in the 128x4 swizzled layout of DESIGN.md
section 3 (``scale_layout="swizzled"``: a flat buffer of ``ceil(M/128)*128 * ceil(K/64)*4`` bytes,
zero padded), and S_dec per row.
"""

from __future__ import annotations

import torch

from quads.formats import nvfp4
from quads.formats.constants import (
    F4_E2M1_MAX,
    F8E4M3_DTYPE,
    F8E4M3_MAX,
    FLT_MAX,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_ENCODE_NUMERATOR,
    SWIZZLE_COLS,
    SWIZZLE_ROWS,
)
from quads.kernels import tuning
from quads.kernels._common import EXACT, HAS_TRITON

INV6 = float(torch.tensor(1.0 / F4_E2M1_MAX, dtype=torch.float32))  # fp32(1/6), as the reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import (
        cast_out,
        e2m1_code_bits,
        e2m1_times_scale,
        e4m3_rne,
        e4m3_to_f32,
        unpack_codes,
    )

    @triton.jit
    def rows_absmax(row_ptrs, rmask, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """max |x[r, :K]| of each row r (``row_ptrs[r]`` its first element, ``rmask`` the live rows), NaN
        ignored (CUDA fmaxf semantics, as the reference); [BLOCK_M] fp32."""
        acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (cols[None, :] < K)
            x = tl.load(row_ptrs[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)))
        return tl.max(acc, axis=1)

    @triton.jit
    def _row_amax_kernel(x_ptr, out_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[r] = max |x[r, :]|, NaN ignored (CUDA fmaxf semantics, as the reference)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        tl.store(out_ptr + rows, rows_absmax(x_ptr + rows * stride_xm, rmask, K, BLOCK_M, BLOCK_K), mask=rmask)

    @triton.jit
    def _global_scales(amax):
        """amax (fp32) -> (S_enc, S_dec) exactly as ``nvfp4.global_encode_scale``."""
        s_enc = tl.minimum(
            tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), 3.4028234663852886e38
        )
        s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        s_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
        return s_enc, s_dec

    @triton.jit
    def _max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _quantize_tile(x, s_enc, s_dec, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TILE16: tl.constexpr,
                       ROW_AMAX: tl.constexpr = False):  # fmt: skip
        """x [BLOCK_M, BLOCK_K] fp32, S_enc/S_dec [BLOCK_M] -> (packed [BM, BK/2] int32, scale bytes
        [BM, BK/16] int32 (0x7F for NaN blocks), float(s) [BM, BK/16], codes [BM, BK/16, 16] int32, S_dec).

        ROW_AMAX (whole rows in the tile): S_enc / S_dec are ignored and computed from the row amax,
        taken as the max of the block maxima. Block maxima: ``tl.max`` is NaN-ignoring (``max.f32``, CUDA
        ``fmaxf``; a block of NaNs only gives NaN, mapped to 0 as the reference's amax does), and a
        NaN-propagating max flags the blocks that hold a NaN: 2 ops per element for both."""
        NB: tl.constexpr = BLOCK_K // 16
        x3 = tl.reshape(x, (BLOCK_M, NB, 16))
        a3 = tl.abs(x3)
        bamax = tl.max(a3, axis=2)  # [BM, NB]
        bamax = tl.where(bamax != bamax, 0.0, bamax)
        bn = tl.reduce(a3, 2, _max_nan)
        bnan = (bn != bn).to(tl.int32)  # [BM, NB] 1 where the block holds a NaN
        if ROW_AMAX:
            s_enc, s_dec = _global_scales(tl.max(bamax, axis=1))
        if TILE16:
            t = tl.max(tl.reshape(bamax, (BLOCK_M // 16, 16, NB)), axis=1)  # [BM/16, NB]
            bamax = tl.reshape(tl.broadcast_to(t[:, None, :], (BLOCK_M // 16, 16, NB)), (BLOCK_M, NB))
            tn = tl.max(tl.reshape(bnan, (BLOCK_M // 16, 16, NB)), axis=1)
            bnan = tl.reshape(tl.broadcast_to(tn[:, None, :], (BLOCK_M // 16, 16, NB)), (BLOCK_M, NB))
        v = bamax * (s_enc[:, None] * 0.16666667163372040)  # fp32(1/6) == INV6
        v = tl.minimum(v, 448.0)  # F8E4M3_MAX; v >= 0 and never NaN
        s_val, s_byte = e4m3_rne(v)
        enc = tl.minimum(
            tl.math.div_rn(tl.full(s_val.shape, 1.0, tl.float32), s_val * s_dec[:, None]),
            3.4028234663852886e38,
        )
        y = x3 * enc[:, :, None]
        # NaN policy of the reference: a NaN element gets code 0x0, its block (tile) scale E4M3 NaN 0x7F
        codes = e2m1_code_bits(y, x3)  # NaN -> 0
        codes = tl.reshape(codes, (BLOCK_M, BLOCK_K // 2, 2))
        lo, hi = tl.split(codes)
        s_byte = tl.where(bnan != 0, 0x7F, s_byte)
        return lo | (hi << 4), s_byte, s_val, tl.reshape(codes, (BLOCK_M, NB, 16)), s_dec

    @triton.jit
    def _units_tile(x, s_enc, s_dec, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """x ``[BLOCK_M, BLOCK_K]`` fp32 with its rows' global scales -> (packed codes, E4M3 scale bytes,
        ``u = e2m1 * s`` fp32 ``[BLOCK_M, BLOCK_K]``), the canonical NVFP4 cast of ``_quantize_tile``."""
        packed, s_byte, _, c3, _ = _quantize_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K, False)
        s16 = e4m3_to_f32(s_byte) * 16384.0  # the stored scale (NaN for a NaN block, as the reference)
        return packed, s_byte, tl.reshape(e2m1_times_scale(c3, s16[:, :, None]), (BLOCK_M, BLOCK_K))

    @triton.jit
    def _store_units(u_ptr, r_ptr, x, u, s_dec, rows, ch, m, stride_um, K, RESIDUAL: tl.constexpr):
        """``u`` at ``u[rows, ch]`` in the output's dtype; with RESIDUAL ``r = x - u * S_dec`` (fp32, no FMA)."""
        tl.store(u_ptr + rows[:, None] * stride_um + ch, cast_out(u, u_ptr), mask=m)
        if RESIDUAL:
            tl.store(r_ptr + rows[:, None] * K + ch, x - u * s_dec[:, None], mask=m)

    @triton.jit
    def _store_codes_scales(codes_ptr, scales_ptr, packed, s_byte, rows, rmask, k0, K, R, Rp, Cp,
                            SWIZZLE: tl.constexpr, BLOCK_K: tl.constexpr):
        """Store one [rows, k0:k0+BLOCK_K] tile: packed codes [rows, BLOCK_K/2] and E4M3 scale bytes
        [rows, BLOCK_K/16], linear or in the 128x4 swizzled layout (``nvfp4.swizzle_scales``)."""
        pcols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        pm = rmask[:, None] & (pcols[None, :] < K // 2)
        tl.store(codes_ptr + rows[:, None] * (K // 2) + pcols[None, :], packed.to(tl.uint8), mask=pm)
        scols = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        sm = rmask[:, None] & (scols[None, :] < K // 16)
        if SWIZZLE:
            r = rows[:, None] % R  # row inside its [R, K/16] scale matrix; matrix index rows // R
            c = scols[None, :]
            off = ((r // 128) * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            off += (rows[:, None] // R) * (Rp * Cp)
        else:
            off = rows[:, None] * (K // 16) + scols[None, :]
        tl.store(scales_ptr + off, s_byte.to(tl.uint8), mask=sm)

    @triton.jit
    def _nvfp4_quantize_kernel(
        x_ptr, amax_ptr, codes_ptr, scales_ptr, sdec_ptr,
        M, K, stride_xm, stride_amax, R, Rp, Cp,
        PER_ROW_AMAX: tl.constexpr, TILE16: tl.constexpr, SWIZZLE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        if PER_ROW_AMAX:
            acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                m = rmask[:, None] & (cols[None, :] < K)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(
                    tl.float32
                )
                acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)))
            amax = tl.max(acc, axis=1)
        else:
            amax = tl.load(amax_ptr + rows * stride_amax, mask=rmask, other=0.0)
        s_enc, s_dec = _global_scales(amax)
        tl.store(sdec_ptr + rows, s_dec, mask=rmask)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (cols[None, :] < K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
            packed, s_byte, _, _, _ = _quantize_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K, TILE16)
            _store_codes_scales(codes_ptr, scales_ptr, packed, s_byte, rows, rmask, k0, K, R, Rp, Cp,
                                SWIZZLE, BLOCK_K)

    @triton.jit
    def _nvfp4_quantize_tile_kernel(
        x_ptr, amax_ptr, codes_ptr, scales_ptr, sdec_ptr,
        M, K, stride_xm, stride_amax, R, Rp, Cp,
        PER_ROW_AMAX: tl.constexpr, TILE16: tl.constexpr, SWIZZLE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One [BLOCK_M, BLOCK_K] tile per program, grid (row tiles, K tiles), no loop: the whole tile is
        loaded by one wide load (many 16-byte loads in flight per thread), quantized and stored.
        PER_ROW_AMAX needs BLOCK_K >= K (whole rows): the row amax comes from the registers, so x
        crosses HBM exactly once."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        k0 = pid_k * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if PER_ROW_AMAX:
            amax = tl.max(tl.abs(x), axis=1)  # NaN-ignoring (max.f32); only an all-NaN row gives NaN
            amax = tl.where(amax != amax, 0.0, amax)
        else:
            amax = tl.load(amax_ptr + rows * stride_amax, mask=rmask, other=0.0)
        s_enc, s_dec = _global_scales(amax)
        packed, s_byte, _, _, _ = _quantize_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K, TILE16)
        if pid_k == 0:
            tl.store(sdec_ptr + rows, s_dec, mask=rmask)
        _store_codes_scales(codes_ptr, scales_ptr, packed, s_byte, rows, rmask, k0, K, R, Rp, Cp, SWIZZLE, BLOCK_K)

    @triton.jit
    def _nvfp4_dequantize_kernel(
        codes_ptr, scales_ptr, sdec_ptr, out_ptr, M, K, stride_sdec,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out = (e2m1 * float(s)) * S_dec in fp32, cast to out's dtype (the reference's order)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        rmask = rows < M
        pcols = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        p = tl.load(
            codes_ptr + rows[:, None] * (K // 2) + pcols[None, :],
            mask=rmask[:, None] & (pcols[None, :] < K // 2),
            other=0,
        )
        c = unpack_codes(p, BLOCK_M, BLOCK_K)
        scols = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        s = tl.load(
            scales_ptr + rows[:, None] * (K // 16) + scols[None, :],
            mask=rmask[:, None] & (scols[None, :] < K // 16),
            other=0,
        )
        s = e4m3_to_f32(s)
        s16 = tl.reshape(
            tl.broadcast_to((s * 16384.0)[:, :, None], (BLOCK_M, BLOCK_K // 16, 16)), (BLOCK_M, BLOCK_K)
        )
        g = tl.load(sdec_ptr + rows * stride_sdec, mask=rmask, other=0.0)
        out = e2m1_times_scale(c, s16) * g[:, None]
        tl.store(
            out_ptr + rows[:, None] * K + cols[None, :],
            cast_out(out, out_ptr),
            mask=rmask[:, None] & (cols[None, :] < K),
        )


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use quads.formats.nvfp4 (or kernel backend 'reference')")


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# Per token, rows up to this length are held whole in one tile (registers); longer ones loop over K.
QUANT_ROW_MAX_K = 16384


def row_amax(
    x: torch.Tensor, *, block_m: int | None = None, block_k: int | None = None, num_warps: int | None = None
) -> torch.Tensor:
    """NaN-ignoring amax of every row of ``x`` [..., K] -> fp32 ``[...]`` (Triton)."""
    _require_triton()
    x2 = _rows_view(x)
    m, k = x2.shape
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    cfg = tuning.config("nvfp4_quantize", "row_amax")
    bm, bk = block_m or cfg["block_m"], min(block_k or cfg["block_k"], triton.next_power_of_2(k))
    _row_amax_kernel[(triton.cdiv(m, bm),)](
        x2, out, m, k, x2.stride(0), BLOCK_M=bm, BLOCK_K=bk, num_warps=num_warps or cfg["num_warps"], **EXACT
    )
    return out.reshape(x.shape[:-1])


def _reference_global_shape(x: torch.Tensor, per_token: bool, amax: torch.Tensor | None) -> tuple[int, ...]:
    lead = tuple(x.shape[:-1])
    if amax is None:
        return lead + (1,) if per_token else ()
    if per_token and amax.dim() == x.dim() - 1:
        amax = amax.unsqueeze(-1)
    if per_token and amax.dim() == 0:
        return lead + (1,)
    return tuple(amax.shape)


def swizzled_scale_shape(rows: int, blocks: int) -> tuple[int, int]:
    """Padded ``(rows, K/16)`` of the 128x4 swizzled scale layout."""
    return (triton_cdiv(rows, SWIZZLE_ROWS) * SWIZZLE_ROWS, triton_cdiv(blocks, SWIZZLE_COLS) * SWIZZLE_COLS)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    tile: tuple[int, int] = (1, 16),
    per_token: bool = False,
    amax: torch.Tensor | float | None = None,
    scale_layout: str = "linear",
    block_m: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> nvfp4.NVFP4Tensor:
    """Triton twin of ``nvfp4.quantize(x, mode="te", ...)`` (same arguments, same bits).

    ``scale_layout="swizzled"``: ``scales`` is ``nvfp4.swizzle_scales`` of the linear scales, i.e. for
    x ``[..., R, K]`` a zero-padded ``[..., Rp * Cp]`` float8 buffer (``swizzled_scale_shape(R, K/16)``).
    """
    _require_triton()
    nvfp4.check_input(x, tile, "te")
    if scale_layout not in ("linear", "swizzled"):
        raise ValueError(f"scale_layout must be 'linear' or 'swizzled', got {scale_layout!r}")
    x2 = _rows_view(x)
    m, k = x2.shape
    tile16 = tuple(tile) == (16, 16)
    dev = x.device
    amax_t = None if amax is None else torch.as_tensor(amax, dtype=torch.float32, device=dev)
    out_gshape = _reference_global_shape(x, per_token, amax_t)
    per_row = per_token and amax_t is None
    if per_row:
        amax_rows, stride_amax = x2.new_empty(1, dtype=torch.float32), 0
    else:
        if amax_t is None:
            amax_t = row_amax(x2).amax()
        elif per_token and amax_t.dim() == x.dim() - 1:
            amax_t = amax_t.unsqueeze(-1)
        if amax_t.numel() == 1:
            amax_rows, stride_amax = amax_t.reshape(1).contiguous(), 0
        else:
            amax_rows = amax_t.expand(*x.shape[:-1], 1).reshape(m).contiguous()
            stride_amax = 1
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=dev)
    r_mat = x.shape[-2] if x.dim() >= 2 else 1  # swizzling is per trailing [R, K/16] scale matrix
    n_mat = m // r_mat
    if scale_layout == "swizzled":
        rp, cp = swizzled_scale_shape(r_mat, k // NVFP4_BLOCK)
        scales = torch.zeros(n_mat, rp * cp, dtype=torch.uint8, device=dev)
    else:
        rp, cp = r_mat, k // NVFP4_BLOCK
        scales = torch.empty(m, cp, dtype=torch.uint8, device=dev)
    sdec = torch.empty(m, dtype=torch.float32, device=dev)
    kp = triton.next_power_of_2(k)
    row_cfg = tuning.config("nvfp4_quantize", "per_token")
    row_bk = block_k or row_cfg["block_k"]
    if per_row and (tile16 or kp > QUANT_ROW_MAX_K or (row_bk is not None and row_bk < k)):
        # rows longer than one tile (or the config says so): the looping kernel (row amax sweep, then
        # the quantize sweep, which re-reads the rows from L2)
        bm = block_m or (16 if tile16 else row_cfg["block_m"])
        bk = min(row_bk or 256, kp)
        _nvfp4_quantize_kernel[(triton.cdiv(m, bm),)](
            x2, amax_rows, codes, scales, sdec, m, k, x2.stride(0), stride_amax, r_mat, rp, cp,
            PER_ROW_AMAX=per_row, TILE16=tile16, SWIZZLE=scale_layout == "swizzled",
            BLOCK_M=bm, BLOCK_K=bk, num_warps=num_warps or (4 if tile16 else row_cfg["num_warps"]), **EXACT,
        )  # fmt: skip
    else:
        cfg = row_cfg if per_row else tuning.config("nvfp4_quantize", "tile16" if tile16 else "amax_known")
        bm = block_m or cfg["block_m"]
        bk = kp if per_row else min(block_k or cfg["block_k"], kp)
        if tile16 and bm % 16:
            raise ValueError(f"16x16 tiles need block_m % 16 == 0, got {bm}")
        _nvfp4_quantize_tile_kernel[(triton.cdiv(m, bm), triton.cdiv(k, bk))](
            x2, amax_rows, codes, scales, sdec, m, k, x2.stride(0), stride_amax, r_mat, rp, cp,
            PER_ROW_AMAX=per_row, TILE16=tile16, SWIZZLE=scale_layout == "swizzled",
            BLOCK_M=bm, BLOCK_K=bk, num_warps=num_warps or cfg["num_warps"], **EXACT,
        )  # fmt: skip
    g = sdec.reshape(*x.shape[:-1], 1)
    target = out_gshape
    if len(target) == 0:
        g = g.reshape(-1)[0].clone()
    else:
        for i in range(g.dim()):
            j = i - (g.dim() - len(target))
            if j >= 0 and target[j] == 1 and g.shape[i] != 1:
                g = g.narrow(i, 0, 1)
        g = g.reshape(target).contiguous()
    lead = tuple(x.shape[:-1])
    return nvfp4.NVFP4Tensor(
        codes=codes.reshape(*lead, k // 2),
        scales=(
            scales.reshape(*lead[:-1], -1)
            if scale_layout == "swizzled"
            else scales.reshape(*lead, k // NVFP4_BLOCK)
        ).view(F8E4M3_DTYPE),
        global_scale=g,
        shape=x.shape,
        dtype=x.dtype,
        tile=tuple(tile),
        mode="te",
    )


def nvfp4_dequantize(q: nvfp4.NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton twin of ``nvfp4.dequantize`` (linear scale layout), bit-exact."""
    _require_triton()
    k = q.codes.shape[-1] * 2
    codes = q.codes.reshape(-1, k // 2).contiguous()
    m = codes.shape[0]
    scales = q.scales.reshape(m, k // NVFP4_BLOCK).contiguous().view(torch.uint8)
    g = q.global_scale.float()
    if g.numel() == 1:
        sdec, stride = g.reshape(1).contiguous(), 0
    else:
        sdec, stride = g.expand(*q.codes.shape[:-1], 1).reshape(m).contiguous(), 1
    out = torch.empty(m, k, dtype=dtype, device=codes.device)
    bm, bk = 16, min(256, triton.next_power_of_2(k))
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _nvfp4_dequantize_kernel[grid](codes, scales, sdec, out, m, k, stride, BLOCK_M=bm, BLOCK_K=bk, **EXACT)
    return out.reshape(*q.codes.shape[:-1], k)


def swizzle_offsets_reference(rows: int, blocks: int, device=None) -> torch.Tensor:
    """Flat swizzled offset of every linear scale ``(r, c)`` (DESIGN.md section 3), ``[rows, blocks]``."""
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(blocks, device=device)[None, :]
    cp = swizzled_scale_shape(rows, blocks)[1]
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


# Reference twins (same signatures): the canonical pure-PyTorch implementation.
nvfp4_quantize_reference = nvfp4.quantize
nvfp4_dequantize_reference = nvfp4.dequantize

_CONSTANTS_USED = (F8E4M3_MAX, FLT_MAX, NVFP4_GLOBAL_ENCODE_NUMERATOR)  # literals in the kernels above
