"""Fused RAC quantize (Triton): NVFP4(X), residual channel selection, NVFP4(R[:, S]), in 3 passes.

Matches ``quads.quant.rac.rac_operands`` (dynamic selection) bit for bit on the quantized outputs:
``Xq`` codes/scales/global scale, the selected channels ``S`` (selection order, largest residual
norm first, ties to the lower channel), and ``R[:, S]``'s codes/scales/global scale. For X ``[T, K]``:

1. ``row_amax`` (``nvfp4_quant``): one NaN-ignoring amax per token; torch takes the max for a
   per-tensor scale (a max is exact in any order).
2. ``_rac_quantize_kernel``, grid (K tiles, T splits): quantizes its X tiles (same arithmetic as
   ``nvfp4_quantize``), recomputes ``Xq = (e2m1 * s) * S_dec`` and ``R = X - Xq`` in fp32 registers,
   and reduces over its tokens: ``sum R^2`` in fp64 (the squares of fp32 values are exact in fp64,
   so the fp64 sum differs from any other order by ~T ulp of fp64; the reference's
   ``residual_norms`` sums in fp64 too, so both rank channels the same except on fp64 near-ties) and
   the NaN-ignoring ``max |R|`` per channel. Partials per T split are summed / maxed in torch.
3. torch: ``S = argsort(norms, descending, stable)[:|S|]``; per-tensor residual amax =
   ``max(chmax[S])`` (exact).
4. ``_rac_residual_kernel``, one program per ``BLOCK_M`` tokens: gathers ``X[:, S]`` and the stored
   X code nibbles and block scales of those channels, forms ``R[:, S] = X - (e2m1 * s) * S_dec`` (the
   same Xq bits as pass 2, with no re-quantization), per-token residual amax if asked (a first sweep
   over S), quantizes ``R[:, S]`` in blocks of 16 consecutive selected channels, and
   optionally scatters ``e2m1 * s_r`` as BF16 to ``[T, K]`` (the GEMM's residual operand, see
   ``quads.prototype.kernels.gemm.w4a4_gemm``).

Bytes: X is read 3 times (passes 1, 2 and the gather of 4, which touches most sectors at ratio 0.5)
against once for a plain per-token quantize: the token reduction in front of the selection forces a
second sweep, and the per-tensor amax a third.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quads.formats import nvfp4
from quads.formats.constants import F8E4M3_DTYPE, NVFP4_BLOCK
from quads.kernels import tuning
from quads.kernels._common import EXACT, HAS_TRITON, interpreted
from quads.kernels.nvfp4_quant import row_amax

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import e2m1_times_scale, e4m3_to_f32, e4m3_to_f32_hw
    from quads.kernels.nvfp4_quant import _global_scales, _quantize_tile

    @triton.jit
    def _rac_quantize_kernel(
        x_ptr, amax_ptr, stride_amax, codes_ptr, scales_ptr, sdec_ptr, norm_ptr, chmax_ptr,
        T, K, stride_xm, ROWS_PER_SPLIT, stride_c, stride_s,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_k = tl.program_id(0)
        pid_t = tl.program_id(1)
        NB: tl.constexpr = BLOCK_K // 16
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        cmask = cols < K
        sq = tl.zeros((BLOCK_M, BLOCK_K), tl.float64)  # reduced over the tokens once, after the loop
        mx = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        t_lo = pid_t * ROWS_PER_SPLIT
        t_hi = tl.minimum(t_lo + ROWS_PER_SPLIT, T)
        for t0 in range(t_lo, t_hi, BLOCK_M):
            rows = t0 + tl.arange(0, BLOCK_M)
            rmask = rows < t_hi
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
            amax = tl.load(amax_ptr + rows * stride_amax, mask=rmask, other=0.0)
            s_enc, s_dec = _global_scales(amax)
            if pid_k == 0:
                tl.store(sdec_ptr + rows, s_dec, mask=rmask)
            packed, s_byte, _, c3, _ = _quantize_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K, False)
            pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            tl.store(
                codes_ptr + rows[:, None] * stride_c + pcols[None, :],
                packed.to(tl.uint8),
                mask=rmask[:, None] & (pcols[None, :] < stride_c),
            )
            scols = pid_k * NB + tl.arange(0, NB)
            tl.store(
                scales_ptr + rows[:, None] * stride_s + scols[None, :],
                s_byte.to(tl.uint8),
                mask=rmask[:, None] & (scols[None, :] < stride_s),
            )
            s16 = e4m3_to_f32(s_byte) * 16384.0  # the stored scale (NaN for NaN blocks, as the reference)
            xq = e2m1_times_scale(c3, s16[:, :, None]) * s_dec[:, None, None]
            r = tl.reshape(tl.reshape(x, (BLOCK_M, NB, 16)) - xq, (BLOCK_M, BLOCK_K))
            r = tl.where(m, r, 0.0)
            r64 = r.to(tl.float64)
            sq += r64 * r64
            mx = tl.maximum(mx, tl.where(r != r, 0.0, tl.abs(r)))
        tl.store(norm_ptr + pid_t * K + cols, tl.sum(sq, axis=0), mask=cmask)
        tl.store(chmax_ptr + pid_t * K + cols, tl.max(mx, axis=0), mask=cmask)

    @triton.jit
    def _residual_tile(x_ptr, xc_ptr, sc_ptr, sel_ptr, rows, rmask, s_dec, j0, T, K, NS, stride_xm,
                       BLOCK_S: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
        """R[rows, S[j0:j0+BLOCK_S]] in fp32 = x - (e2m1 * s) * S_dec, decoded from the stored X code
        nibble and block scale (the same code pass 2 computed from x, so the same Xq bits), with no
        re-quantization (no division per element)."""
        j = j0 + tl.arange(0, BLOCK_S)
        jm = j < NS
        ch = tl.load(sel_ptr + j, mask=jm, other=0)
        m = rmask[:, None] & jm[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ch[None, :], mask=m, other=0.0).to(tl.float32)
        sb = tl.load(sc_ptr + rows[:, None] * (K // 16) + (ch // 16)[None, :], mask=m, other=0)
        cb = tl.load(xc_ptr + rows[:, None] * (K // 2) + (ch // 2)[None, :], mask=m, other=0).to(tl.int32)
        c = (cb >> ((ch & 1) * 4)[None, :]) & 0xF
        s = e4m3_to_f32_hw(sb, INTERP)
        xq = e2m1_times_scale(c, s * 16384.0) * s_dec[:, None]
        return tl.where(m, x - xq, 0.0), ch

    @triton.jit
    def _rac_residual_kernel(
        x_ptr, xc_ptr, sc_ptr, sel_ptr, ramax_ptr, rcodes_ptr, rscales_ptr, rsdec_ptr, scat_ptr,
        T, K, NS, stride_xm,
        PER_TOKEN: tl.constexpr, SCATTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
        INTERP: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < T
        s_dec_x = tl.load(rsdec_ptr + rows, mask=rmask, other=1.0)  # X's S_dec per row (input)
        if PER_TOKEN:
            acc = tl.zeros((BLOCK_M, BLOCK_S), tl.float32)
            for j0 in range(0, NS, BLOCK_S):
                r, _ = _residual_tile(
                    x_ptr,
                    xc_ptr,
                    sc_ptr,
                    sel_ptr,
                    rows,
                    rmask,
                    s_dec_x,
                    j0,
                    T,
                    K,
                    NS,
                    stride_xm,
                    BLOCK_S,
                    INTERP,
                )
                acc = tl.maximum(acc, tl.where(r != r, 0.0, tl.abs(r)))
            ramax = tl.max(acc, axis=1)
        else:
            ramax = tl.zeros((BLOCK_M,), tl.float32) + tl.load(ramax_ptr)
        s_enc, s_dec = _global_scales(ramax)
        for j0 in range(0, NS, BLOCK_S):
            r, ch = _residual_tile(
                x_ptr, xc_ptr, sc_ptr, sel_ptr, rows, rmask, s_dec_x, j0, T, K, NS, stride_xm, BLOCK_S, INTERP
            )
            packed, s_byte, _, c3, _ = _quantize_tile(r, s_enc, s_dec, BLOCK_M, BLOCK_S, False)
            pj = j0 // 2 + tl.arange(0, BLOCK_S // 2)
            tl.store(
                rcodes_ptr + rows[:, None] * (NS // 2) + pj[None, :],
                packed.to(tl.uint8),
                mask=rmask[:, None] & (pj[None, :] < NS // 2),
            )
            sj = j0 // 16 + tl.arange(0, BLOCK_S // 16)
            tl.store(
                rscales_ptr + rows[:, None] * (NS // 16) + sj[None, :],
                s_byte.to(tl.uint8),
                mask=rmask[:, None] & (sj[None, :] < NS // 16),
            )
            if SCATTER:
                j = j0 + tl.arange(0, BLOCK_S)
                re = e2m1_times_scale(c3, (e4m3_to_f32(s_byte) * 16384.0)[:, :, None])
                re = tl.reshape(re, (BLOCK_M, BLOCK_S)).to(tl.bfloat16)  # exact
                tl.store(
                    scat_ptr + rows[:, None] * K + ch[None, :], re, mask=rmask[:, None] & (j[None, :] < NS)
                )
        tl.store(rsdec_ptr + T + rows, s_dec, mask=rmask)


@dataclass
class RACQuantized:
    """Outputs of the fused RAC quantize for X ``[T, K]`` and ``|S|`` residual channels.

    ``x``: NVFP4(X); ``residual``: NVFP4(R[:, S]) ``[T, |S|]`` (None when |S| = 0); ``channels``: S
    (long ``[|S|]``, selection order); ``scattered``: BF16 ``[T, K]`` with ``e2m1 * s_r`` of the
    residual at its channels and 0 elsewhere (the W4A4 GEMM operand), or None.
    """

    x: nvfp4.NVFP4Tensor
    residual: nvfp4.NVFP4Tensor | None
    channels: torch.Tensor | None
    scattered: torch.Tensor | None = None


def _nvfp4(codes, scales, g, shape, dtype) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(
        codes=codes, scales=scales.view(F8E4M3_DTYPE), global_scale=g, shape=shape, dtype=dtype
    )


def rac_quantize(
    x: torch.Tensor,
    n: int,
    *,
    act_scale: str = "tensor",
    scatter: bool = False,
    splits: int | None = None,
    pass2: tuple[int, int, int, int] | None = None,
    pass4: tuple[int, int, int] | None = None,
    timings: dict | None = None,
) -> RACQuantized:
    """Fused NVFP4 + dynamic RAC quantize of ``x`` ``[T, K]`` with ``n`` residual channels (Triton).

    ``pass2`` (BLOCK_M tokens, BLOCK_K channels, num_warps, target programs) / ``pass4`` (BLOCK_M
    tokens, BLOCK_S selected channels, num_warps) override the launch configs of ``tuning.json``
    (``rac_quantize.pass2`` / ``.pass4``); ``timings`` (a dict,
    CUDA only) receives a CUDA event before each stage, for the benchmark's per-stage times."""

    def mark(name: str) -> None:
        if timings is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            timings[name] = ev

    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use rac_quantize_reference (or kernel backend 'reference')")
    if x.dim() != 2 or x.shape[1] % NVFP4_BLOCK or n % NVFP4_BLOCK or not 0 <= n <= x.shape[1]:
        raise ValueError(f"rac_quantize needs x [T, K] with K % 16 == 0 and 0 <= n <= K, n % 16 == 0; "
                         f"got x {tuple(x.shape)}, n={n}")  # fmt: skip
    if act_scale not in ("tensor", "token"):
        raise ValueError(f"unknown act_scale {act_scale!r}; valid: tensor, token")
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    dev = x.device
    per_token = act_scale == "token"
    mark("row_amax")
    ra = row_amax(x)  # [T]
    amax_rows, stride_amax = (ra, 1) if per_token else (ra.amax().reshape(1), 0)
    if pass2 is None:
        c = tuning.config("rac_quantize", "pass2")
        pass2 = (c["block_m"], c["block_k"], c["num_warps"], c["target_programs"])
    bm, bk, nw2, target = pass2
    bk = min(bk, triton.next_power_of_2(k))
    k_tiles = triton.cdiv(k, bk)
    if splits is None:
        splits = max(1, min(triton.cdiv(t, 4 * bm), triton.cdiv(target, k_tiles)))
    rows_per_split = triton.cdiv(triton.cdiv(t, splits), bm) * bm
    splits = triton.cdiv(t, rows_per_split)
    codes = torch.empty(t, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(t, k // NVFP4_BLOCK, dtype=torch.uint8, device=dev)
    sdec = torch.empty(2 * t, dtype=torch.float32, device=dev)  # [X's S_dec per row | R's S_dec per row]
    norms = torch.empty(splits, k, dtype=torch.float64, device=dev)
    chmax = torch.empty(splits, k, dtype=torch.float32, device=dev)
    mark("pass2")
    _rac_quantize_kernel[(k_tiles, splits)](
        x, amax_rows, stride_amax, codes, scales, sdec, norms, chmax, t, k, x.stride(0), rows_per_split,
        k // 2, k // NVFP4_BLOCK, BLOCK_M=bm, BLOCK_K=bk, num_warps=nw2, **EXACT,
    )  # fmt: skip
    gx = sdec[:t].reshape(t, 1).clone() if per_token else sdec[0].clone()
    xq = _nvfp4(codes, scales, gx, x.shape, x.dtype)
    if n == 0:
        return RACQuantized(xq, None, None, None)
    mark("select")
    sel = torch.argsort(norms.sum(0), descending=True, stable=True)[:n]
    ramax = chmax.amax(0)[sel].amax().reshape(1)
    rcodes = torch.empty(t, n // 2, dtype=torch.uint8, device=dev)
    rscales = torch.empty(t, n // NVFP4_BLOCK, dtype=torch.uint8, device=dev)
    scat = torch.zeros(t, k, dtype=torch.bfloat16, device=dev) if scatter else rcodes
    if pass4 is None:
        c = tuning.config("rac_quantize", "pass4")
        pass4 = (c["block_m"], c["block_s"], c["num_warps"])
    bm4, bs, nw4 = pass4
    bs = min(bs, triton.next_power_of_2(n))
    mark("pass4")
    _rac_residual_kernel[(triton.cdiv(t, bm4),)](
        x, codes, scales, sel, ramax, rcodes, rscales, sdec, scat, t, k, n, x.stride(0),
        PER_TOKEN=per_token, SCATTER=scatter, BLOCK_M=bm4, BLOCK_S=bs, INTERP=interpreted(x), num_warps=nw4, **EXACT,
    )  # fmt: skip
    mark("end")
    gr = sdec[t:].reshape(t, 1).clone() if per_token else sdec[t].clone()
    rq = _nvfp4(rcodes, rscales, gr, torch.Size((t, n)), torch.float32)
    return RACQuantized(xq, rq, sel, scat if scatter else None)


def residual_norms_reference(r: torch.Tensor) -> torch.Tensor:
    """``sum_t R[t, c]^2`` in fp64 (exact squares, one rounding per add), ``[K]``."""
    return r.double().square().sum(dim=0)


def rac_quantize_reference(
    x: torch.Tensor, n: int, *, act_scale: str = "tensor", scatter: bool = False, splits: int | None = None
) -> RACQuantized:
    """Pure-PyTorch twin of ``rac_quantize`` following ``quads.quant.rac.rac_operands`` step by step."""
    per_token = act_scale == "token"
    xf = x.float()
    xq_t = nvfp4.quantize(xf, per_token=per_token)
    xq_t.dtype = x.dtype
    if n == 0:
        return RACQuantized(xq_t, None, None, None)
    r = xf - nvfp4.dequantize(xq_t, torch.float32)
    sel = torch.argsort(residual_norms_reference(r), descending=True, stable=True)[:n]
    rq = nvfp4.quantize(r[:, sel], per_token=per_token)
    scat = None
    if scatter:
        from quads.prototype.kernels.gemm import decoded

        scat = torch.zeros(x.shape, dtype=torch.bfloat16, device=x.device)
        scat[:, sel] = decoded(rq).to(torch.bfloat16)
    return RACQuantized(xq_t, rq, sel, scat)
