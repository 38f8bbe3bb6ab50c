"""NVFP4 GEMMs for Hopper (Triton): weight-only W4A16, grouped MoE W4A16, emulated W4A4 (+RAC).

Legend: ``M`` tokens, ``N`` out-features, ``K`` in-features, ``E`` experts.

Weights are NVFP4 ``[N, K]`` (``[E, N, K]`` grouped): packed codes ``[N, K/2]`` (low nibble = even k),
e4m3 scales ``[N, K/16]`` (linear layout), FP32 decode scale ``gw`` (``[]``; ``[E, 1, 1]`` grouped).
Each K tile of the weight is decoded in registers to ``e2m1 * s`` in BF16, which is exact (see
``_common``), so the only rounding is the fp32 accumulation (tensor-core order) and the epilogue:

- W4A16: ``out = (x @ We.T) * gw`` with x BF16/FP16 ``[M, K]``.
- W4A4:  ``out = (Xe @ We.T) * (gx * gw) [+ (Re @ We.T) * (gr * gw)]`` with Xe = e2m1 * s of the
  NVFP4 activation (decoded in registers too), gx its global scale (per tensor or per token), and
  for RAC the residual operand Re ``[M, K]`` BF16 = the quantized residual ``e2m1 * s_r`` scattered
  back to its channels (zero elsewhere), gr its global scale. This equals the reference's single
  GEMM over ``[Xq | Rq_S]`` x ``[Wq | Wq[:, S]]`` up to summation order, and reads each weight tile
  once (the appended-columns layout would read |S|/K more of W, +50% at ratio 0.5).

Decode (small M) is weight-bandwidth bound: ``BLOCK_M = 16`` (the smallest tensor-core tile), small
``BLOCK_N`` and optional split-K so that a few hundred programs stream W. Split-K partials are added
with fp32 atomics into a zeroed fp32 buffer (summation order then varies run to run, within the
accumulation tolerance). Large M: ``dispatch`` falls back to dequantize + cuBLAS where that wins.

Every launcher has a ``*_reference`` twin with the same signature and the same arithmetic order
(fp32 products of the exact decoded operands, then the epilogue scales).
"""

from __future__ import annotations

import os

import torch

from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK
from quads.kernels._common import HAS_TRITON, interpreting

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out, e2m1_times_scale, e4m3_to_f32, e4m3_to_f32_hw, unpack_codes

    @triton.jit
    def _dot(a, b, acc, DOT_F32: tl.constexpr):
        """acc += a @ b with BF16 operands (exact decoded values); DOT_F32 (interpreter only: its BF16
        dot is wrong, seen with triton 3.9) multiplies the same values as fp32 in IEEE precision."""
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _decode_tile(c_ptr, s_ptr, rows, k0, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                     stride_c=None, stride_s=None, INTERP: tl.constexpr = True):  # fmt: skip
        """NVFP4 rows ``rows`` x [k0, k0+BLOCK_K) -> ``e2m1 * s`` BF16 [BLOCK_R, BLOCK_K] (exact).

        ``stride_c`` / ``stride_s`` (= K/2, K/16 exactly: contiguous rows; passed as kernel arguments) let Triton see their
        divisibility by 16, so the scale bytes are loaded as vectors and software-pipelined (cp.async)
        like the codes; computed here from K they are scalar byte loads waited on in every K step."""
        if stride_c is None:
            stride_c = K // 2
        if stride_s is None:
            stride_s = K // 16
        rmask = rows < R
        pk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p = tl.load(
            c_ptr + rows[:, None] * stride_c + pk[None, :],
            mask=rmask[:, None] & (pk[None, :] < stride_c),
            other=0,
        )
        sk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        sb = tl.load(
            s_ptr + rows[:, None] * stride_s + sk[None, :],
            mask=rmask[:, None] & (sk[None, :] < stride_s),
            other=0,
        )
        s16 = e4m3_to_f32_hw(sb, INTERP) * 16384.0
        s16 = tl.reshape(tl.broadcast_to(s16[:, :, None], (BLOCK_R, BLOCK_K // 16, 16)), (BLOCK_R, BLOCK_K))
        w = e2m1_times_scale(unpack_codes(p, BLOCK_R, BLOCK_K), s16)
        return w.to(tl.bfloat16)  # exact: e2m1 * s has at most 6 significant bits

    @triton.jit
    def _w4a16_gemm_kernel(
        x_ptr, wc_ptr, ws_ptr, gw_ptr, out_ptr, M, N, K, stride_xm, stride_wc, stride_ws,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0,
            )
            w = _decode_tile(wc_ptr, ws_ptr, rn, k0, N, K, BLOCK_N, BLOCK_K, stride_wc, stride_ws, DOT_F32)
            acc = _dot(x.to(tl.bfloat16), tl.trans(w), acc, DOT_F32)
        out = acc * tl.load(gw_ptr)
        om = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(out, out_ptr), mask=om)
        else:
            tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], out, mask=om)

    @triton.jit
    def _nibble_pair(w, Q: tl.constexpr):
        """int32 words of 8 packed codes (nibble q = element q of the word) -> fp32 ``e2m1 * 2**-14`` of
        elements Q and Q + 4 (Q in 0..3), exact.

        One int32 holds both fp16 bit patterns (element Q in the low half, Q + 4 in the high half):
        magnitude bits to 9..11 / 25..27, sign bits to 15 / 31, i.e. 2 shifts and 2 masks per pair of
        elements (``_common.e2m1_times_scale`` explains why these fp16s are e2m1 * 2**-14)."""
        if Q * 4 <= 9:
            a = w << (9 - 4 * Q)
        else:
            a = w >> (4 * Q - 9)
        b = w << (12 - 4 * Q)
        p = (a & 0x0E000E00) | (b & -2147450880)  # 0x80008000 as int32
        lo = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _load_words(wc_ptr, ws_ptr, rows, kw, R, KW, INTERP: tl.constexpr):
        """Packed codes as int32 words ``[rows, kw]`` and the fp32 scale of each word, times 2**14."""
        m = (rows[:, None] < R) & (kw[None, :] < KW)
        w = tl.load(wc_ptr + rows[:, None] * KW + kw[None, :], mask=m, other=0)
        sb = tl.load(ws_ptr + rows[:, None] * (KW // 2) + (kw // 2)[None, :], mask=m, other=0)
        if INTERP:  # interpreter fallback: its float8 -> fp32 cast gives no NaN for 0x7F (_common)
            s = e4m3_to_f32(sb)
        else:  # sm_90: cvt.rn.f16x2.e4m3x2 (exact, NaN kept), 2 scales per instruction
            s = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return w, s * 16384.0

    @triton.jit
    def _w4a16_words_step(
        acc, x_ptr, stride_xm, rm, m_hi, w, s16, kw, KW,
        USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """One K step of the word-decode W4A16 over words ``kw`` (elements 8 kw + q). The K order is
        permuted (element q of every word at once), which a sum over K does not see.

        USE_DOT=False (GEMV, tiny M): acc [BM, BN, BKW] += x * e2m1 * 2**-14 summed over the word,
        times the word's scale (once per 8 elements): fp32 FMAs, no layout change. USE_DOT=True (swap-AB): acc [BN, BM] +=
        (e2m1 * s as BF16, exact) @ x^T, the decoded weight as the MMA's A operand, 8 dots of K=BKW."""
        xm = rm < m_hi
        for q in tl.static_range(4):
            lo, hi = _nibble_pair(w, q)
            km = kw < KW
            if USE_DOT:
                xl = tl.load(
                    x_ptr + rm[None, :] * stride_xm + (kw * 8 + q)[:, None],
                    mask=km[:, None] & xm[None, :],
                    other=0.0,
                )
                xh = tl.load(
                    x_ptr + rm[None, :] * stride_xm + (kw * 8 + q + 4)[:, None],
                    mask=km[:, None] & xm[None, :],
                    other=0.0,
                )
                acc = _dot((lo * s16).to(tl.bfloat16), xl.to(tl.bfloat16), acc, DOT_F32)
                acc = _dot((hi * s16).to(tl.bfloat16), xh.to(tl.bfloat16), acc, DOT_F32)
            else:
                xl = tl.load(
                    x_ptr + rm[:, None] * stride_xm + (kw * 8 + q)[None, :],
                    mask=xm[:, None] & km[None, :],
                    other=0.0,
                ).to(tl.float32)
                xh = tl.load(
                    x_ptr + rm[:, None] * stride_xm + (kw * 8 + q + 4)[None, :],
                    mask=xm[:, None] & km[None, :],
                    other=0.0,
                ).to(tl.float32)
                if q == 0:
                    part = lo[None, :, :] * xl[:, None, :]
                else:
                    part += lo[None, :, :] * xl[:, None, :]
                part += hi[None, :, :] * xh[:, None, :]
        if not USE_DOT:
            acc += part * s16[None, :, :]  # [BM, BN, BKW]; summed over words once, after the K loop
        return acc

    @triton.jit
    def _w4a16_words_kernel(
        x_ptr, wc_ptr, ws_ptr, gw_ptr, out_ptr, M, N, KW, stride_xm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """W4A16 with the packed codes read as int32 words (``KW = K / 8``): see ``_w4a16_words_step``."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if USE_DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KW), tl.float32)
        for kw0 in range(pid_k * BLOCK_KW, KW, BLOCK_KW * SPLIT_K):
            kw = kw0 + tl.arange(0, BLOCK_KW)
            w, s16 = _load_words(wc_ptr, ws_ptr, rn, kw, N, KW, DOT_F32)
            acc = _w4a16_words_step(acc, x_ptr, stride_xm, rm, M, w, s16, kw, KW, USE_DOT, DOT_F32)
        g = tl.load(gw_ptr)
        out = (tl.trans(acc) if USE_DOT else tl.sum(acc, axis=2)) * g
        om = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(out, out_ptr), mask=om)
        else:
            tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], out, mask=om)

    @triton.jit
    def _wdot_step(acc, xp_ptr, rm, mm, wc_ptr, ws_ptr, rn, nm, kw0, stride_xm, stride_w, stride_s,
                   BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
        """One K step (words kw0 .. kw0 + BLOCK_KW) of the "wdot" decode: see ``_w4a16_wdot_kernel``."""
        kw = kw0 + tl.arange(0, BLOCK_KW)
        km = kw < stride_w
        w = tl.load(wc_ptr + rn[:, None] * stride_w + kw[None, :], mask=nm[:, None] & km[None, :], other=0)
        ks = kw0 // 2 + tl.arange(0, BLOCK_KW // 2)
        sb = tl.load(ws_ptr + rn[:, None] * stride_s + ks[None, :], mask=nm[:, None] & (ks < stride_s)[None, :],
                     other=0)  # fmt: skip
        s16 = e4m3_to_f32_hw(sb, DOT_F32) * 16384.0
        s16 = tl.reshape(tl.join(s16, s16), (BLOCK_N, BLOCK_KW))  # words 2j, 2j+1 share scale j
        xm = mm[:, None] & km[None, :]
        xbase = xp_ptr + rm[:, None] * stride_xm + kw[None, :]
        for q in tl.static_range(4):
            lo, hi = _nibble_pair(w, q)
            xl = tl.load(xbase + q * stride_w, mask=xm, other=0.0)
            xh = tl.load(xbase + (q + 4) * stride_w, mask=xm, other=0.0)
            acc = _dot(xl, tl.trans((lo * s16).to(tl.bfloat16)), acc, DOT_F32)
            acc = _dot(xh, tl.trans((hi * s16).to(tl.bfloat16)), acc, DOT_F32)
        return acc

    @triton.jit
    def _w4a16_wdot_kernel(
        xp_ptr, wc_ptr, ws_ptr, gw_ptr, out_ptr, M, N, KW, stride_xm, stride_w, stride_s,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SPLIT_K: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """W4A16 with a packed word decode feeding the MMA ("wdot"). The codes are read as int32 words of
        8 codes (``KW = K / 8``); ``_nibble_pair`` builds elements q and q + 4 of every word with 2 shifts
        and 2 masks per pair, so the decode costs about 4 ops per element instead of about 16 for the
        byte / join decode of the tile kernel. The K order is permuted (element q of every word at once),
        which a sum over K does not see: x comes pre-permuted as ``xp`` ``[M, 8, KW]`` (``xp[m, q, kw] =
        x[m, 8 kw + q]``), so each of the 8 dots of a K step reads a plain [BLOCK_M, BLOCK_KW] tile."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        nm = rn < N
        mm = rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kw0 in range(pid_k * BLOCK_KW, KW, BLOCK_KW * SPLIT_K):
            acc = _wdot_step(acc, xp_ptr, rm, mm, wc_ptr, ws_ptr, rn, nm, kw0, stride_xm, stride_w, stride_s,
                             BLOCK_N, BLOCK_KW, DOT_F32)  # fmt: skip
        out = acc * tl.load(gw_ptr)
        om = mm[:, None] & nm[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(out, out_ptr), mask=om)
        else:
            tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], out, mask=om)

    @triton.jit
    def _w4a16_grouped_words_kernel(
        x_ptr, wc_ptr, ws_ptr, gw_ptr, offs_ptr, out_ptr, N, KW, stride_xm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """Grouped twin of ``_w4a16_words_kernel``: rows offs[e]:offs[e+1] of x use expert e; grid (N tiles, E)."""
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        start = tl.load(offs_ptr + e)
        end = tl.load(offs_ptr + e + 1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        wc_e = wc_ptr + e.to(tl.int64) * N * KW
        ws_e = ws_ptr + e.to(tl.int64) * N * (KW // 2)
        g = tl.load(gw_ptr + e)
        for m0 in range(start, end, BLOCK_M):  # experts without tokens read no weights
            rm = m0 + tl.arange(0, BLOCK_M)
            if USE_DOT:
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KW), tl.float32)
            for kw0 in range(0, KW, BLOCK_KW):
                kw = kw0 + tl.arange(0, BLOCK_KW)
                w, s16 = _load_words(wc_e, ws_e, rn, kw, N, KW, DOT_F32)
                acc = _w4a16_words_step(acc, x_ptr, stride_xm, rm, end, w, s16, kw, KW, USE_DOT, DOT_F32)
            out = (tl.trans(acc) if USE_DOT else tl.sum(acc, axis=2)) * g
            om = (rm[:, None] < end) & (rn[None, :] < N)
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(out, out_ptr), mask=om)

    @triton.jit
    def _w4a16_grouped_gemm_kernel(
        x_ptr, wc_ptr, ws_ptr, gw_ptr, offs_ptr, out_ptr, N, K, stride_xm, stride_wc, stride_ws,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """Tokens sorted by expert: rows offs[e]:offs[e+1] of x use expert e. Grid (N tiles, E)."""
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        start = tl.load(offs_ptr + e)
        end = tl.load(offs_ptr + e + 1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        wc_e = wc_ptr + e.to(tl.int64) * N * stride_wc
        ws_e = ws_ptr + e.to(tl.int64) * N * stride_ws
        g = tl.load(gw_ptr + e)
        for m0 in range(start, end, BLOCK_M):  # experts without tokens read no weights
            rm = m0 + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(
                    x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < end) & (rk[None, :] < K),
                    other=0.0,
                )
                w = _decode_tile(wc_e, ws_e, rn, k0, N, K, BLOCK_N, BLOCK_K, stride_wc, stride_ws, DOT_F32)
                acc = _dot(x.to(tl.bfloat16), tl.trans(w), acc, DOT_F32)
            om = (rm[:, None] < end) & (rn[None, :] < N)
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(acc * g, out_ptr), mask=om)

    @triton.jit
    def _w4a16_grouped_split_kernel(
        x_ptr, wc_ptr, ws_ptr, gw_ptr, offs_ptr, out_ptr, N, K, stride_xm, stride_wc, stride_ws,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        WDOT: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """Grouped W4A16 with split-K, grid (N tiles, E, SPLIT_K): at decode only the few routed experts
        have rows, so without a split only (active experts x N tiles) programs stream the weights, too
        few to keep HBM busy. WDOT: the packed word decode (x pre-permuted, ``stride_wc`` = K/8 words,
        see ``_w4a16_wdot_kernel``), else the byte decode of the tile kernel. SPLIT_K > 1: fp32 atomics
        into a zeroed output."""
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        pid_k = tl.program_id(2)
        start = tl.load(offs_ptr + e)
        end = tl.load(offs_ptr + e + 1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < N
        wc_e = wc_ptr + e.to(tl.int64) * N * stride_wc
        ws_e = ws_ptr + e.to(tl.int64) * N * stride_ws
        g = tl.load(gw_ptr + e)
        for m0 in range(start, end, BLOCK_M):  # experts without tokens read no weights
            rm = m0 + tl.arange(0, BLOCK_M)
            mm = rm < end
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
                if WDOT:
                    acc = _wdot_step(acc, x_ptr, rm, mm, wc_e, ws_e, rn, nm, k0 // 8, stride_xm, stride_wc, stride_ws,
                                     BLOCK_N, BLOCK_K // 8, DOT_F32)  # fmt: skip
                else:
                    rk = k0 + tl.arange(0, BLOCK_K)
                    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & (rk[None, :] < K),
                                other=0.0)  # fmt: skip
                    w = _decode_tile(
                        wc_e, ws_e, rn, k0, N, K, BLOCK_N, BLOCK_K, stride_wc, stride_ws, DOT_F32
                    )
                    acc = _dot(x.to(tl.bfloat16), tl.trans(w), acc, DOT_F32)
            om = mm[:, None] & nm[None, :]
            if SPLIT_K == 1:
                tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(acc * g, out_ptr), mask=om)
            else:
                tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], acc * g, mask=om)

    @triton.jit
    def _w4a4_gemm_kernel(
        xc_ptr, xs_ptr, gx_ptr, stride_gx, r_ptr, gr_ptr, stride_gr,
        wc_ptr, ws_ptr, gw_ptr, out_ptr, M, N, K,
        HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_r = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            xe = _decode_tile(xc_ptr, xs_ptr, rm, k0, M, K, BLOCK_M, BLOCK_K)
            w = _decode_tile(wc_ptr, ws_ptr, rn, k0, N, K, BLOCK_N, BLOCK_K)
            wt = tl.trans(w)
            acc = _dot(xe, wt, acc, DOT_F32)
            if HAS_RES:
                rk = k0 + tl.arange(0, BLOCK_K)
                r = tl.load(
                    r_ptr + rm[:, None] * K + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0,
                )
                acc_r = _dot(r, wt, acc_r, DOT_F32)
        gw = tl.load(gw_ptr)
        gx = tl.load(gx_ptr + rm * stride_gx, mask=rm < M, other=0.0)
        out = acc * (gx * gw)[:, None]
        if HAS_RES:
            gr = tl.load(gr_ptr + rm * stride_gr, mask=rm < M, other=0.0)
            out += acc_r * (gr * gw)[:, None]
        om = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(out, out_ptr), mask=om)
        else:
            tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], out, mask=om)


# ------------------------------------------------------------------------------------------ helpers


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            "Triton is not installed; use the *_reference functions (or QUADS_KERNELS=reference)"
        )


def _check_weight(w: nvfp4.NVFP4Tensor, k: int, what: str) -> None:
    if w.codes.shape[-1] * 2 != k:
        raise ValueError(
            f"{what}: activations have K={k} but the weight codes have K={w.codes.shape[-1] * 2}"
        )
    if w.codes.dtype != torch.uint8:
        raise ValueError(f"{what}: weight codes must be packed uint8, got {w.codes.dtype}")
    if w.scales.shape[-1] != k // NVFP4_BLOCK:
        raise ValueError(f"{what}: needs linear [.., N, K/16] scales, got shape {tuple(w.scales.shape)}")


def decoded(q: nvfp4.NVFP4Tensor) -> torch.Tensor:
    """``e2m1 * s`` (no global scale) in fp32, shape of the tensor: exact, and exact in BF16 too."""
    vals = nvfp4.e2m1_values(nvfp4.unpack(q.codes))
    s = q.scales.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return vals * s


def _per_row(g: torch.Tensor, m: int) -> tuple[torch.Tensor, int]:
    g = g.float()
    if g.numel() == 1:
        return g.reshape(1).contiguous(), 0
    return g.reshape(m).contiguous(), 1


def _grid_split(m: int, n: int, k: int, block_n: int, block_k: int, split_k: int | None) -> int:
    if split_k is not None:
        return split_k
    if m > 64:
        return 1
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 264 and k // (block_k * split * 2) >= 4:  # ~2 programs per SM (132 SMs)
        split *= 2
    return split


# ------------------------------------------------------------------------------------------ W4A16


# W4A16 paths: "tile" (join/reshape decode + tl.dot), "gemv" (int32 word decode + fp32 FMAs) and
# "dot" (word decode + swap-AB tl.dot). Run 3 (docs/PERF.md) found the tile kernel waiting on a scalar
# byte load of the scales in every K step (their row stride K/16 had no known divisibility, so they were
# neither vectorized nor software-pipelined); with the strides passed as arguments every operand is a
# cp.async load pipelined num_stages deep. "auto" is tile with the per-shape table below.
GEMV_MAX_M = 0
W4A16_DEFAULTS = {
    "wdot": dict(block_n=32, block_k=256, num_warps=4, split_k=1, num_stages=3),
    "gemv": dict(block_n=16, block_k=512, num_warps=4, split_k=1, num_stages=3),
    "dot": dict(block_n=128, block_k=128, num_warps=4, split_k=None, num_stages=3),
    "tile": dict(block_n=64, block_k=128, num_warps=4, split_k=None, num_stages=3),
}
# "auto" config per M bucket, for any shape, and per (N, K, M bucket) where the H200 sweep
# (benchmarks/bench_kernels.py, suite "tune") measured better: (impl, (block_n, block_k, split_k,
# num_warps, num_stages)); split_k None: picked from the grid size. Only "tile" is used: "wdot" (packed
# word decode, about 30% fewer instructions per weight in the sm_90 SASS) measured 10-15% faster at
# M <= 16 (run 5) but is experimental (see WDOT_MIN_BLOCK_K).
W4A16_BY_M: dict[int, tuple[str, tuple[int, int, int | None, int, int]]] = {
    1: ("tile", (32, 256, 1, 4, 3)),  # best of 72 tile configs at M=1 on 8192x8192 and 28672x4096 (run 4)
    4: ("tile", (32, 256, 1, 4, 3)),
    16: ("tile", (32, 256, 1, 4, 3)),  # best of 72 at M=16 on both shapes
    32: ("tile", (64, 128, None, 4, 3)),
    64: ("tile", (128, 128, 1, 4, 3)),  # best of 36 at M=64 on 28672x4096
}
W4A16_TABLE: dict[tuple[int, int, int], tuple[str, tuple[int, int, int | None, int, int]]] = {
    (8192, 8192, 64): ("tile", (128, 128, 4, 8, 3)),  # best of 36 at M=64 on 8192x8192
}


# "wdot" is experimental: on the H200 (runs 5-6, docs/PERF.md) it gave wrong results (relative error
# 0.98) at BLOCK_KW = 16 (block_k 128: N=96, K=512, split 4, 4 warps, 4 stages), and a NaN block scale
# (E4M3 0x7F) did not reach the output; the causes are not found. So on the GPU it runs only with
# QUADS_EXPERIMENTAL_WDOT=1 (the benchmarks set it) and block_k >= 256, and "auto" never picks it.
WDOT_MIN_BLOCK_K = 256
WDOT_ENV = "QUADS_EXPERIMENTAL_WDOT"


def _check_wdot_block(block_k: int) -> None:
    if interpreting():
        return
    if os.environ.get(WDOT_ENV) != "1":
        raise ValueError(
            f"impl='wdot' is experimental and gave wrong results on sm_90 (NaN block scales lost, block_k < "
            f"{WDOT_MIN_BLOCK_K} wrong; docs/PERF.md runs 5-6): use impl='auto' or 'tile', or set {WDOT_ENV}=1 "
            "to run it anyway"
        )
    if block_k < WDOT_MIN_BLOCK_K:
        raise ValueError(
            f"impl='wdot' needs block_k >= {WDOT_MIN_BLOCK_K} on the GPU (block_k {block_k} gave wrong "
            "results on sm_90, docs/PERF.md run 5)"
        )


def m_bucket(m: int) -> int:
    """The W4A16 tuning bucket of ``m`` tokens: 1, 4, 16, 32 or 64 (the smallest not below m)."""
    for b in (1, 4, 16, 32):
        if m <= b:
            return b
    return 64


def _words(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[..., K/2]`` uint8 viewed as int32 words (8 codes each; K % 16 == 0)."""
    c = codes if codes.is_contiguous() else codes.contiguous()
    return c.view(torch.int32)


def w4a16_gemm(
    x: torch.Tensor,
    w: nvfp4.NVFP4Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` BF16 x NVFP4 ``w`` ``[N, K]`` -> ``[M, N]`` = ``(x @ We.T) * gw`` (fp32 accumulate).

    ``impl``: "wdot" (packed word decode + tl.dot), "gemv" (FMA, M <= 8), "dot" (swap-AB MMA), "tile"
    (byte decode + tl.dot); "auto" takes impl and config from ``W4A16_TABLE`` (per N, K, M bucket)
    or ``W4A16_BY_M``; explicit blocks override the path's defaults. ``split_k=None`` picks a
    split from the grid size (path defaults aside); ``split_k=0`` means the same."""
    _require_triton()
    m, k = x.shape
    _check_weight(w, k, "w4a16_gemm")
    n = w.codes.shape[0]
    out_dtype = out_dtype or x.dtype
    if impl not in W4A16_DEFAULTS and impl != "auto":
        raise ValueError(f"impl must be auto, wdot, gemv, dot or tile, got {impl!r}")
    d = dict(W4A16_DEFAULTS["tile" if impl == "auto" else impl])
    if impl == "auto":
        mb = m_bucket(m)
        impl, cfg = W4A16_TABLE.get((n, k, mb), W4A16_BY_M[mb])
        if m <= GEMV_MAX_M:
            impl, cfg = "gemv", None
        d = dict(W4A16_DEFAULTS[impl])
        if cfg is not None:
            d.update(zip(("block_n", "block_k", "split_k", "num_warps", "num_stages"), cfg))
    if impl == "wdot" and k % 16:
        impl = "tile"
    if impl == "wdot":
        _check_wdot_block(block_k or d["block_k"])
    block_n = block_n or d["block_n"]
    block_k = min(block_k or d["block_k"], max(16 if impl == "tile" else 128, triton.next_power_of_2(k)))
    num_warps = num_warps or d["num_warps"]
    num_stages = num_stages or d["num_stages"]
    split_k = split_k if split_k is not None else d["split_k"]
    split_k = split_k or None
    if impl == "gemv":
        if m > 8:
            raise ValueError(f"impl='gemv' is for M <= 8 rows, got M={m}")
        block_m = triton.next_power_of_2(m)
    else:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    split = _grid_split(m, n, k, block_n, block_k, split_k)
    if split > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    gw = w.global_scale.float().reshape(1)
    if impl == "wdot":
        xp = x.reshape(m, k // 8, 8).transpose(1, 2).contiguous()  # xp[m, q, kw] = x[m, 8 kw + q]
        _w4a16_wdot_kernel[grid](
            xp, _words(w.codes), w.scales.view(torch.uint8), gw, out, m, n, k // 8, k, k // 8, k // NVFP4_BLOCK,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_k // 8, SPLIT_K=split, DOT_F32=interpreting(),
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    elif impl == "tile":
        _w4a16_gemm_kernel[grid](
            x, w.codes, w.scales.view(torch.uint8), gw, out, m, n, k, x.stride(0), k // 2, k // NVFP4_BLOCK,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, DOT_F32=interpreting(),
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    else:
        _w4a16_words_kernel[grid](
            x, _words(w.codes), w.scales.view(torch.uint8), gw, out, m, n, k // 8, x.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_k // 8, SPLIT_K=split,
            USE_DOT=impl == "dot", DOT_F32=interpreting(), num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out if out.dtype == out_dtype else out.to(out_dtype)


def w4a16_gemm_reference(x: torch.Tensor, w: nvfp4.NVFP4Tensor, *, out_dtype: torch.dtype | None = None, **_):
    """``(x.float() @ We.T) * gw`` with ``We = e2m1 * s`` exact; same order as the kernel."""
    out = (x.float() @ decoded(w).T) * w.global_scale.float()
    return out.to(out_dtype or x.dtype)


# Grouped configs (block_n, block_k, num_warps, num_stages, split_k), from the H200 MoE sweeps (runs 4
# and 5, E=128 N=1536 K=2048 top-8): at decode (<= GROUPED_DECODE_ROWS routed rows) the T=1 best, else
# the best summed over T=16 and T=64. "auto" is the tile kernel (verified on the GPU); wdot measured
# faster at T=16/64 (101.6 against 123.8 us at T=16) but stays off until its real-size checks pass.
GROUPED_TILE_CONFIG = (64, 128, 4, 3, 1)
GROUPED_TILE_DECODE_CONFIG = (64, 256, 8, 3, 1)
GROUPED_WDOT_CONFIG = (64, 256, 4, 3, 1)
GROUPED_WDOT_DECODE_CONFIG = (64, 256, 4, 3, 2)
GROUPED_TILE_SPLIT_CONFIG = (64, 128, 4, 3, 1)
GROUPED_TILE_SPLIT_DECODE_CONFIG = (32, 256, 4, 3, 1)
GROUPED_IMPL = "tile"
GROUPED_IMPL_DECODE = "tile"
GROUPED_DECODE_ROWS = 16


def w4a16_grouped_gemm(
    x: torch.Tensor,
    w: nvfp4.NVFP4Tensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Grouped MoE W4A16: ``x`` ``[T, K]`` sorted by expert, ``w`` ``[E, N, K]``, ``offsets`` ``[E+1]``
    int32 (rows ``offsets[e]:offsets[e+1]`` use expert e) -> ``[T, N]``.

    ``impl``: "wdot" (packed word decode + tl.dot, split-K), "tile_split" (byte decode, split-K),
    "tile" (byte decode, no split), "gemv" / "dot" (run 3's word kernels); "auto" picks
    ``GROUPED_IMPL_DECODE`` at decode (<= ``GROUPED_DECODE_ROWS`` routed rows), else ``GROUPED_IMPL``.
    Configs: (block_n, block_k, num_warps, num_stages, split_k)."""
    _require_triton()
    t, k = x.shape
    _check_weight(w, k, "w4a16_grouped_gemm")
    e, n = w.codes.shape[0], w.codes.shape[1]
    if offsets.numel() != e + 1:
        raise ValueError(f"offsets must have E+1 = {e + 1} entries, got {offsets.numel()}")
    decode = t <= GROUPED_DECODE_ROWS
    if impl == "auto":
        impl = GROUPED_IMPL_DECODE if decode else GROUPED_IMPL
    if impl in ("tile", "wdot", "tile_split"):
        table = {"tile": (GROUPED_TILE_DECODE_CONFIG, GROUPED_TILE_CONFIG),
                 "wdot": (GROUPED_WDOT_DECODE_CONFIG, GROUPED_WDOT_CONFIG),
                 "tile_split": (GROUPED_TILE_SPLIT_DECODE_CONFIG, GROUPED_TILE_SPLIT_CONFIG)}[impl]  # fmt: skip
        cfg = table[0] if decode else table[1]
    else:
        cfg = (64, 256, 4, 3, 1)
    block_n = block_n or cfg[0]
    block_k = block_k or cfg[1]
    num_warps = num_warps or cfg[2]
    num_stages = num_stages or cfg[3]
    split_k = split_k or cfg[4]
    out_dtype = out_dtype or x.dtype
    gw = w.global_scale.float().reshape(-1).expand(e).contiguous()
    offs = offsets.to(torch.int32)
    if impl in ("wdot", "tile_split"):
        wdot = impl == "wdot" and k % 16 == 0
        if wdot:
            _check_wdot_block(block_k)
        block_k = min(block_k, max(128 if wdot else 16, triton.next_power_of_2(k)))
        if split_k > 1:
            out = torch.zeros(t, n, dtype=torch.float32, device=x.device)
        else:
            out = torch.empty(t, n, dtype=out_dtype, device=x.device)
        if wdot:
            xs = x.reshape(t, k // 8, 8).transpose(1, 2).contiguous()  # xs[t, q, kw] = x[t, 8 kw + q]
            wc, swc = _words(w.codes), k // 8
        else:
            xs, wc, swc = x, w.codes, k // 2
        _w4a16_grouped_split_kernel[(triton.cdiv(n, block_n), e, split_k)](
            xs, wc, w.scales.view(torch.uint8), gw, offs, out, n, k, xs.stride(0), swc, k // NVFP4_BLOCK,
            BLOCK_M=block_m or 16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, WDOT=wdot,
            DOT_F32=interpreting(), num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        return out if out.dtype == out_dtype else out.to(out_dtype)
    out = torch.empty(t, n, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), e)
    if impl == "tile":
        _w4a16_grouped_gemm_kernel[grid](
            x, w.codes, w.scales.view(torch.uint8), gw, offs, out, n, k, x.stride(0), k // 2, k // NVFP4_BLOCK,
            BLOCK_M=block_m or 16, BLOCK_N=block_n, BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))),
            DOT_F32=interpreting(), num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    elif impl in ("gemv", "dot"):
        block_k = min(block_k, max(128, triton.next_power_of_2(k)))
        _w4a16_grouped_words_kernel[grid](
            x, _words(w.codes), w.scales.view(torch.uint8), gw, offs, out, n, k // 8, x.stride(0),
            BLOCK_M=block_m or (1 if impl == "gemv" else 16), BLOCK_N=block_n, BLOCK_KW=block_k // 8,
            USE_DOT=impl == "dot", DOT_F32=interpreting(), num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    else:
        raise ValueError(f"impl must be auto, wdot, tile_split, tile, gemv or dot, got {impl!r}")
    return out


def w4a16_grouped_gemm_reference(x, w, offsets, *, out_dtype=None, **_):
    """Per expert ``(x_e.float() @ We_e.T) * gw_e``, same order as the kernel."""
    out = torch.empty(x.shape[0], w.codes.shape[1], dtype=out_dtype or x.dtype, device=x.device)
    we = decoded(w)
    gw = w.global_scale.float().reshape(-1).expand(w.codes.shape[0])
    offs = offsets.tolist()
    for e in range(w.codes.shape[0]):
        a, b = offs[e], offs[e + 1]
        if b > a:
            out[a:b] = ((x[a:b].float() @ we[e].T) * gw[e]).to(out.dtype)
    return out


# ------------------------------------------------------------------------------------------- W4A4


def w4a4_gemm(
    a: nvfp4.NVFP4Tensor,
    w: nvfp4.NVFP4Tensor,
    *,
    residual: torch.Tensor | None = None,
    residual_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int | None = None,
) -> torch.Tensor:
    """Emulated W4A4 (+RAC): NVFP4 ``a`` ``[M, K]`` x NVFP4 ``w`` ``[N, K]`` -> ``[M, N]``.

    ``residual``: RAC operand ``[M, K]`` BF16, ``e2m1 * s_r`` of the quantized residual scattered to
    its channels (``quads.kernels.rac``), ``residual_scale`` its FP32 global scale ([] or [M, 1]).
    """
    _require_triton()
    m, k = a.codes.shape[0], a.codes.shape[1] * 2
    _check_weight(w, k, "w4a4_gemm")
    n = w.codes.shape[0]
    split = _grid_split(m, n, k, block_n, block_k, split_k)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    gx, sgx = _per_row(a.global_scale, m)
    has_res = residual is not None
    if has_res:
        if residual.shape != (m, k) or residual_scale is None:
            raise ValueError(
                f"residual must be [M, K] = {(m, k)} with residual_scale, got {tuple(residual.shape)}"
            )
        gr, sgr = _per_row(residual_scale, m)
        r = residual.to(torch.bfloat16).contiguous()
    else:
        gr, sgr, r = gx, 0, gx
    if split > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=a.codes.device)
    else:
        out = torch.empty(m, n, dtype=out_dtype, device=a.codes.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _w4a4_gemm_kernel[grid](
        a.codes, a.scales.view(torch.uint8), gx, sgx, r, gr, sgr,
        w.codes, w.scales.view(torch.uint8), w.global_scale.float().reshape(1), out, m, n, k,
        HAS_RES=has_res, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, DOT_F32=interpreting(),
    )  # fmt: skip
    return out if out.dtype == out_dtype else out.to(out_dtype)


def w4a4_gemm_reference(a, w, *, residual=None, residual_scale=None, out_dtype=torch.bfloat16, **_):
    """``(Xe @ We.T) * (gx * gw) [+ (Re @ We.T) * (gr * gw)]`` in fp32, same order as the kernel."""
    m = a.codes.shape[0]
    we = decoded(w)
    gw = w.global_scale.float()
    gx = a.global_scale.float().reshape(-1, 1) if a.global_scale.numel() > 1 else a.global_scale.float()
    out = (decoded(a) @ we.T) * (gx * gw)
    if residual is not None:
        gr = residual_scale.float()
        gr = gr.reshape(m, 1) if gr.numel() > 1 else gr
        out = out + (residual.float() @ we.T) * (gr * gw)
    return out.to(out_dtype)
