"""Emulated W4A4 (+RAC) NVFP4 GEMM for Hopper (Triton); the W4A16 GEMMs are ``quads.kernels.w4a16``.

Legend: ``M`` tokens, ``N`` out-features, ``K`` in-features.

Weights are NVFP4 ``[N, K]``: packed codes ``[N, K/2]`` (low nibble = even k), e4m3 scales ``[N, K/16]``
(linear layout), FP32 decode scale ``gw`` (``[]``). Each K tile is decoded in registers to ``e2m1 * s``
in BF16, which is exact (see ``_common``), so the only rounding is the fp32 accumulation (tensor-core
order) and the epilogue:

- W4A4:  ``out = (Xe @ We.T) * (gx * gw) [+ (Re @ We.T) * (gr * gw)]`` with Xe = e2m1 * s of the
  NVFP4 activation (decoded in registers too), gx its global scale (per tensor or per token), and
  for RAC the residual operand Re ``[M, K]`` BF16 = the quantized residual ``e2m1 * s_r`` scattered
  back to its channels (zero elsewhere), gr its global scale. This equals the reference's single
  GEMM over ``[Xq | Rq_S]`` x ``[Wq | Wq[:, S]]`` up to summation order, and reads each weight tile
  once (the appended-columns layout would read |S|/K more of W, +50% at ratio 0.5).

Decode (small M) is weight-bandwidth bound: ``BLOCK_M = 16`` (the smallest tensor-core tile), small
``BLOCK_N`` and optional split-K so that a few hundred programs stream W. Split-K partials are added
with fp32 atomics into a zeroed fp32 buffer (summation order then varies run to run, within the
accumulation tolerance).

The launcher has a ``*_reference`` twin with the same signature and the same arithmetic order
(fp32 products of the exact decoded operands, then the epilogue scales).
"""

from __future__ import annotations

import torch

from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK
from quads.kernels._common import HAS_TRITON, interpreted

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out, e2m1_times_scale, e4m3_to_f32_hw, unpack_codes

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
            "Triton is not installed; use the *_reference functions (or kernel backend 'reference')"
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
    its channels (``quads.prototype.kernels.rac``), ``residual_scale`` its FP32 global scale ([] or [M, 1]).
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
        HAS_RES=has_res, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, DOT_F32=interpreted(a.codes),
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
