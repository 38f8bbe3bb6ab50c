"""RAC's residual operand in three Triton kernels: channel norms, stable top-n selection, quantize + scatter.

For the fp32 residual ``r`` ``[M, K]`` of the factored W4A4 path (``quads.quant.factored.operands``) and
rows grouped as in ``factored.Segments`` (``group`` ``[M]`` in ``[0, G]``, G = rows of no group, SORTED
ascending so that each group is one contiguous run of rows, as ``moe.static_routes`` orders them; or
``group=None``: all rows one group), the three kernels produce what the reference path builds from ~12
torch kernels (sq_norms GEMM, argsort, gathers, two amax passes, a zero fill, the gathered quantize):

1. ``_rac_norms_kernel`` (grid G+1 x K-blocks, G+1: the masked rows' group too): ``norms[g, c] = sum
   over the group's rows of r^2`` in fp64 (each square of an fp32 value is exact in fp64; the sum runs
   over the rows in order, in tiles of BLOCK_M reduced by ``tl.sum``. The reference's fp64 GEMM
   ``members @ r^2`` may sum in another order, so two norms within a few fp64 ulps of each other may rank
   differently; equal channels, the ties the tie-break decides, get equal norms in both), and
   ``cmax[g, c]``, the NaN-ignoring max of ``|r|`` over the group's rows.
2. ``_rac_rank_kernel`` (grid G x K-blocks): by rank counting, ``rank[g, c] = #{c' : key[c'] > key[c] or
   (key[c'] == key[c] and c' < c)}`` with ``key`` the fp64 bits of the norm as int64 (norms are >= 0, so
   the integer order is the float order) and every NaN mapped to one key above +inf: exactly the order
   of ``torch.argsort(norms, descending=True, stable=True)`` (NaN first, as torch sorts NaN above every
   number; equal norms by channel index). Channel c is selected iff ``rank < n``; ``s[g, rank] = c``.
3. ``_rac_units_kernel`` (grid over blocks of rows; masked rows use group G-1's channels, as the
   reference does): the amax of ``R[:, S]``, per row (``per_token``: the NaN-ignoring max over the
   row's gathered residual) or per group (``max over c in S of cmax[g, c]``, the same max as the
   reference's max over the group's rows of each row's gathered amax), then the canonical NVFP4 quantize
   of the gathered row (``nvfp4_quant._quantize_tile``, as ``factored_quant._quantize_units_kernel``),
   ``u`` scattered to its channels, zero written to every channel outside ``s_g``; S_dec per row.

Cost: kernel 2 compares all K x K channel pairs per group; kernel 1 reduces a group's rows in one
program per block of channels, so a single group of many rows (a dense layer at prefill) is one
sequential pass per channel block.

The pure-PyTorch reference is ``factored.operands`` under the reference backend; tests compare the two
byte for byte (u, g, channels).
"""

from __future__ import annotations

import torch

from quads.formats.constants import NVFP4_BLOCK
from quads.kernels._common import EXACT, HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out, e2m1_times_scale, e4m3_to_f32
    from quads.kernels.nvfp4_quant import _global_scales, _quantize_tile

    @triton.jit
    def _sort_key(v):
        """fp64 norm (>= 0 or NaN) -> int64 key of the same order; every NaN above +inf (0x7FF0...)."""
        return tl.where(v != v, 0x7FF8000000000000, v.to(tl.int64, bitcast=True))

    @triton.jit
    def _group_rows(group_ptr, g, M, ONE_GROUP: tl.constexpr, BLOCK: tl.constexpr):
        """``[start, end)``: the rows of group g (rows sorted by group), or all rows for ONE_GROUP."""
        if ONE_GROUP:
            start = tl.program_id(0) * 0  # an int32 scalar, as the counted bounds below
            end = start + M
        else:
            lo = tl.zeros((BLOCK,), tl.int32)
            hi = tl.zeros((BLOCK,), tl.int32)
            for i0 in range(0, M, BLOCK):
                i = i0 + tl.arange(0, BLOCK)
                v = tl.load(group_ptr + i, mask=i < M, other=2147483647)
                lo += (v < g).to(tl.int32)
                hi += (v <= g).to(tl.int32)
            start = tl.sum(lo, axis=0)
            end = tl.sum(hi, axis=0)
        return start, end

    @triton.jit
    def _rac_norms_kernel(r_ptr, group_ptr, norms_ptr, cmax_ptr, M, K, ONE_GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        """Over the rows i of group g: norms[g, c] = sum of r[i, c]^2 in fp64, cmax[g, c] = max |r[i, c]|
        (NaN ignored), for a block of channels c."""
        g = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < K
        start, end = _group_rows(group_ptr, g, M, ONE_GROUP, 256)
        acc = tl.zeros((BLOCK_C,), tl.float64)
        amax = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
        for i0 in range(start, end, BLOCK_M):
            rows = i0 + tl.arange(0, BLOCK_M)
            m = (rows < end)[:, None] & cmask[None, :]
            r = tl.load(r_ptr + rows[:, None] * K + c[None, :], mask=m, other=0.0)
            r64 = r.to(tl.float64)
            acc += tl.sum(r64 * r64, axis=0)
            amax = tl.maximum(amax, tl.where(r != r, 0.0, tl.abs(r)))
        tl.store(norms_ptr + g * K + c, acc, mask=cmask)
        tl.store(cmax_ptr + g * K + c, tl.max(amax, axis=0), mask=cmask)

    @triton.jit
    def _rac_rank_kernel(norms_ptr, rank_ptr, s_ptr, K, n, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr):
        """rank of each channel of a block in its group's stable descending order; s[g, rank] = c if rank < n.
        Channels c' < c0 (the block's first) come before c when their key is >= c's, those past the block
        when it is >, those inside the block by the full rule (BLOCK_C a multiple of BLOCK_J)."""
        g = tl.program_id(0)
        c0 = tl.program_id(1) * BLOCK_C
        c = c0 + tl.arange(0, BLOCK_C)
        cmask = c < K
        key = _sort_key(tl.load(norms_ptr + g * K + c, mask=cmask, other=0.0))
        rank = tl.zeros((BLOCK_C,), tl.int32)
        for j0 in range(0, c0, BLOCK_J):  # every j < c
            kj = _sort_key(tl.load(norms_ptr + g * K + j0 + tl.arange(0, BLOCK_J)))
            rank += tl.sum((kj[None, :] >= key[:, None]).to(tl.int32), axis=1)
        for j0 in range(c0, c0 + BLOCK_C, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            kj = _sort_key(tl.load(norms_ptr + g * K + j, mask=j < K, other=0.0))
            before = (kj[None, :] > key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < c[:, None]))
            rank += tl.sum((before & (j < K)[None, :]).to(tl.int32), axis=1)
        for j0 in range(c0 + BLOCK_C, K, BLOCK_J):  # every j > c
            j = j0 + tl.arange(0, BLOCK_J)
            kj = _sort_key(tl.load(norms_ptr + g * K + j, mask=j < K, other=0.0))
            rank += tl.sum(((kj[None, :] > key[:, None]) & (j < K)[None, :]).to(tl.int32), axis=1)
        tl.store(rank_ptr + g * K + c, rank, mask=cmask)
        tl.store(s_ptr + g * n + rank, c.to(tl.int64), mask=cmask & (rank < n))

    @triton.jit
    def _rac_units_kernel(
        r_ptr, group_ptr, s_ptr, rank_ptr, cmax_ptr, u_ptr, g_ptr, M, K, n, G, stride_um, ONE_GROUP: tl.constexpr,
        PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[BLOCK_M]``: amax of R[:, S], NVFP4(R[:, S]) scattered into u (zero outside S), S_dec."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        if ONE_GROUP:
            grp = tl.zeros((BLOCK_M,), tl.int32)
        else:
            grp = tl.load(group_ptr + rows, mask=rmask, other=0).to(tl.int32)
        gs = tl.minimum(grp, G - 1)  # masked rows (group G) take the last group's channels
        s_rows = s_ptr + gs[:, None] * n  # [BLOCK_M, 1] each row's channel list
        if PER_TOKEN:
            width = n
        else:
            width = K
        acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, width, BLOCK_K):
            j = k0 + tl.arange(0, BLOCK_K)
            if PER_TOKEN:  # the row's own gathered amax
                m = rmask[:, None] & (j < n)[None, :]
                ch = tl.load(s_rows + j[None, :], mask=m, other=0)
                x = tl.load(r_ptr + rows[:, None] * K + ch, mask=m, other=0.0)
                acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)))
            else:  # its group's: the max over S of the group's per-channel maxima
                m = rmask[:, None] & (j < K)[None, :]
                rk = tl.load(rank_ptr + gs[:, None] * K + j[None, :], mask=m, other=n)
                cm = tl.load(cmax_ptr + grp[:, None] * K + j[None, :], mask=m & (rk < n), other=0.0)
                acc = tl.maximum(acc, cm)
        s_enc, s_dec = _global_scales(tl.max(acc, axis=1))
        tl.store(g_ptr + rows, s_dec, mask=rmask)
        for k0 in range(0, n, BLOCK_K):
            j = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (j < n)[None, :]
            ch = tl.load(s_rows + j[None, :], mask=m, other=0)
            x = tl.load(r_ptr + rows[:, None] * K + ch, mask=m, other=0.0)
            _, s_byte, _, c3, _ = _quantize_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K, False)
            s16 = e4m3_to_f32(s_byte) * 16384.0  # the stored scale (NaN for a NaN block, as the reference)
            u = tl.reshape(e2m1_times_scale(c3, s16[:, :, None]), (BLOCK_M, BLOCK_K))
            tl.store(u_ptr + rows[:, None] * stride_um + ch, cast_out(u, u_ptr), mask=m)
        for c0 in range(0, K, BLOCK_K):  # zero outside S (disjoint from the scattered channels)
            c = c0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (c < K)[None, :]
            rk = tl.load(rank_ptr + gs[:, None] * K + c[None, :], mask=m, other=0)
            zero = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
            tl.store(u_ptr + rows[:, None] * stride_um + c[None, :], cast_out(zero, u_ptr), mask=m & (rk >= n))


def rac_units(
    r: torch.Tensor,
    group: torch.Tensor | None,
    groups: int,
    out: torch.Tensor,
    *,
    n: int,
    per_token: bool = False,
    block_m: int = 16,
    block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RAC's residual operand of ``r`` ``[M, K]`` fp32 (see the module docstring): writes the exact values
    of NVFP4(``R[:, S]``) scattered to their channels, zero elsewhere, into ``out`` ``[M, K]`` (rows may be
    strided, e.g. ``buf[:, 1]``); returns ``(S_dec [M] fp32, S [G, n] long)``. ``group`` ``[M]`` sorted
    ascending in ``[0, groups]`` (``groups``: rows of no group), or None (one group)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use quads.quant.factored.operands under the reference backend")
    m, k = r.shape
    if r.dtype != torch.float32 or r.stride() != (k, 1):
        raise ValueError(f"rac_units needs a contiguous fp32 residual, got {r.dtype} strides {r.stride()}")
    if not 0 < n <= k or n % NVFP4_BLOCK:
        raise ValueError(f"rac_units needs 0 < n <= K={k} and n a multiple of {NVFP4_BLOCK}, got n={n}")
    if out.shape != (m, k) or out.stride(-1) != 1:
        raise ValueError(f"rac_units: out must be [{m}, {k}] with unit stride along K, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    one = group is None
    n_sel = 1 if one else groups  # groups that own a channel set (the masked rows' group G does not)
    grp = r if one else group.contiguous()  # a placeholder pointer for one group
    norms = torch.empty(n_sel + (not one), k, dtype=torch.float64, device=r.device)
    cmax = torch.empty(n_sel + (not one), k, dtype=torch.float32, device=r.device)
    rank = torch.empty(n_sel, k, dtype=torch.int32, device=r.device)
    s = torch.empty(n_sel, n, dtype=torch.long, device=r.device)
    g = torch.empty(m, dtype=torch.float32, device=r.device)
    bc = min(128, triton.next_power_of_2(k))
    _rac_norms_kernel[(norms.shape[0], triton.cdiv(k, bc))](r, grp, norms, cmax, m, k, ONE_GROUP=one, BLOCK_M=16,
                                                            BLOCK_C=bc, num_warps=4)  # fmt: skip
    _rac_rank_kernel[(n_sel, triton.cdiv(k, bc))](norms, rank, s, k, n, BLOCK_C=bc, BLOCK_J=min(64, bc),
                                                  num_warps=4)  # fmt: skip
    bk = max(NVFP4_BLOCK, min(block_k, triton.next_power_of_2(n)))
    _rac_units_kernel[(triton.cdiv(m, block_m),)](
        r, grp, s, rank, cmax, out, g, m, k, n, n_sel, out.stride(0), ONE_GROUP=one, PER_TOKEN=per_token,
        BLOCK_M=block_m, BLOCK_K=bk, num_warps=4, **EXACT,
    )  # fmt: skip
    return g, s
