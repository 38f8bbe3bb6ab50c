"""RAC's residual operand in three Triton kernels: channel norms, stable top-n selection, quantize + scatter.

For the fp32 residual ``r`` ``[M, K]`` of the factored W4A4 path (``quads.quant.factored.operands``) and
rows grouped as in ``factored.Segments`` (``group`` ``[M]`` in ``[0, G]``, G = rows of no group, SORTED
ascending so that each group is one contiguous run of rows, as ``moe.static_routes`` orders them; or
``group=None``: all rows one group), the three kernels produce what the reference path builds from ~12
torch kernels (sq_norms GEMM, argsort, gathers, two amax passes, a zero fill, the gathered quantize):

1. ``_rac_norms_kernel`` (grid G x K-blocks): ``norms[g, c] = sum over the group's rows of r^2`` in fp64
   (each square of an fp32 value is exact in fp64; the sum runs over the rows in order, in tiles of
   BLOCK_M reduced by ``tl.sum``. The reference's fp64 GEMM ``members @ r^2`` may sum in another order,
   so two norms within a few fp64 ulps of each other may rank differently; equal channels (the ties the
   tie-break decides) get equal norms in both).
2. ``_rac_rank_kernel`` (grid G x K-blocks): by rank counting, ``rank[g, c] = #{c' : key[c'] > key[c] or
   (key[c'] == key[c] and c' < c)}`` with ``key`` the fp64 bits of the norm as int64 (norms are >= 0, so
   the integer order is the float order) and every NaN mapped to one key above +inf: exactly the order
   of ``torch.argsort(norms, descending=True, stable=True)`` (NaN first, as torch sorts NaN above every
   number; equal norms by channel index). Channel c is selected iff ``rank < n``; ``s[g, rank] = c``.
3. ``_rac_units_kernel`` (grid G+1, one program per group, masked rows included; they use group G-1's
   channels, as the reference does): the NaN-ignoring amax of the gathered ``r[i, s_g]`` (per row with
   ``per_token``, else over the group's rows), then the canonical NVFP4 quantize of the gathered row
   (``nvfp4_quant._quantize_tile``, as ``factored_quant._quantize_units_kernel``), ``u`` scattered to its
   channels and zero written to every channel outside ``s_g``; S_dec per row.

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
            start = 0
            end = M
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
    def _rac_norms_kernel(r_ptr, group_ptr, norms_ptr, M, K, ONE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_C: tl.constexpr):  # fmt: skip
        """norms[g, c-block] = sum of r[i, c]^2 in fp64 over the rows i of group g."""
        g = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < K
        start, end = _group_rows(group_ptr, g, M, ONE_GROUP, 256)
        acc = tl.zeros((BLOCK_C,), tl.float64)
        for i0 in range(start, end, BLOCK_M):
            rows = i0 + tl.arange(0, BLOCK_M)
            m = (rows < end)[:, None] & cmask[None, :]
            r = tl.load(r_ptr + rows[:, None] * K + c[None, :], mask=m, other=0.0).to(tl.float64)
            acc += tl.sum(r * r, axis=0)
        tl.store(norms_ptr + g * K + c, acc, mask=cmask)

    @triton.jit
    def _rac_rank_kernel(norms_ptr, rank_ptr, s_ptr, K, n, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr):
        """rank of each channel of a block in its group's stable descending order; s[g, rank] = c if rank < n."""
        g = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < K
        v = tl.load(norms_ptr + g * K + c, mask=cmask, other=0.0)
        key = _sort_key(v)
        rank = tl.zeros((BLOCK_C,), tl.int32)
        for j0 in range(0, K, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            w = tl.load(norms_ptr + g * K + j, mask=j < K, other=0.0)
            kj = _sort_key(w)
            before = (kj[None, :] > key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < c[:, None]))
            rank += tl.sum((before & (j < K)[None, :]).to(tl.int32), axis=1)
        tl.store(rank_ptr + g * K + c, rank, mask=cmask)
        tl.store(s_ptr + g * n + rank, c.to(tl.int64), mask=cmask & (rank < n))

    @triton.jit
    def _gathered_amax(r_ptr, s_row_ptr, rows, rmask, K, n, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """NaN-ignoring max |r[rows, s]| per row ``[BLOCK_M]``."""
        acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, n, BLOCK_K):
            j = k0 + tl.arange(0, BLOCK_K)
            ch = tl.load(s_row_ptr + j, mask=j < n, other=0)
            x = tl.load(r_ptr + rows[:, None] * K + ch[None, :], mask=rmask[:, None] & (j < n)[None, :], other=0.0)
            acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)))
        return tl.max(acc, axis=1)

    @triton.jit
    def _rac_units_kernel(
        r_ptr, group_ptr, s_ptr, rank_ptr, u_ptr, g_ptr, M, K, n, G, stride_um, ONE_GROUP: tl.constexpr,
        PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One group's rows: amax of R[:, S], NVFP4(R[:, S]) scattered into u (zero outside S), S_dec per row."""
        grp = tl.program_id(0)
        gs = tl.minimum(grp, G - 1)  # masked rows (group G) take the last group's channels
        start, end = _group_rows(group_ptr, grp, M, ONE_GROUP, 256)
        s_row_ptr = s_ptr + gs * n
        if not PER_TOKEN:
            gmax = tl.zeros((BLOCK_M,), tl.float32)
            for i0 in range(start, end, BLOCK_M):
                rows = i0 + tl.arange(0, BLOCK_M)
                gmax = tl.maximum(gmax, _gathered_amax(r_ptr, s_row_ptr, rows, rows < end, K, n, BLOCK_M, BLOCK_K))
            gmax = tl.zeros((BLOCK_M,), tl.float32) + tl.max(gmax, axis=0)
        for i0 in range(start, end, BLOCK_M):
            rows = i0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            if PER_TOKEN:
                amax = _gathered_amax(r_ptr, s_row_ptr, rows, rmask, K, n, BLOCK_M, BLOCK_K)
            else:
                amax = gmax
            s_enc, s_dec = _global_scales(amax)
            tl.store(g_ptr + rows, s_dec, mask=rmask)
            for k0 in range(0, n, BLOCK_K):
                j = k0 + tl.arange(0, BLOCK_K)
                m = rmask[:, None] & (j < n)[None, :]
                ch = tl.load(s_row_ptr + j, mask=j < n, other=0)
                x = tl.load(r_ptr + rows[:, None] * K + ch[None, :], mask=m, other=0.0)
                _, s_byte, _, c3, _ = _quantize_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K, False)
                s16 = e4m3_to_f32(s_byte) * 16384.0  # the stored scale (NaN for a NaN block, as the reference)
                u = tl.reshape(e2m1_times_scale(c3, s16[:, :, None]), (BLOCK_M, BLOCK_K))
                tl.store(u_ptr + rows[:, None] * stride_um + ch[None, :], cast_out(u, u_ptr), mask=m)
            for c0 in range(0, K, BLOCK_K):  # zero outside S (disjoint from the scattered channels)
                c = c0 + tl.arange(0, BLOCK_K)
                rk = tl.load(rank_ptr + gs * K + c, mask=c < K, other=0)
                zm = rmask[:, None] & ((c < K) & (rk >= n))[None, :]
                zero = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
                tl.store(u_ptr + rows[:, None] * stride_um + c[None, :], cast_out(zero, u_ptr), mask=zm)


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
    n_sel = 1 if one else groups  # groups that own a channel set
    grp = r if one else group.contiguous()  # a placeholder pointer for one group
    norms = torch.empty(n_sel, k, dtype=torch.float64, device=r.device)
    rank = torch.empty(n_sel, k, dtype=torch.int32, device=r.device)
    s = torch.empty(n_sel, n, dtype=torch.long, device=r.device)
    g = torch.empty(m, dtype=torch.float32, device=r.device)
    bc = min(128, triton.next_power_of_2(k))
    _rac_norms_kernel[(n_sel, triton.cdiv(k, bc))](r, grp, norms, m, k, ONE_GROUP=one, BLOCK_M=16, BLOCK_C=bc,
                                                   num_warps=4)
    _rac_rank_kernel[(n_sel, triton.cdiv(k, bc))](norms, rank, s, k, n, BLOCK_C=bc, BLOCK_J=64, num_warps=4)
    bk = max(NVFP4_BLOCK, min(block_k, triton.next_power_of_2(n)))
    _rac_units_kernel[(1 if one else groups + 1,)](
        r, grp, s, rank, out, g, m, k, n, n_sel, out.stride(0), ONE_GROUP=one, PER_TOKEN=per_token,
        BLOCK_M=block_m, BLOCK_K=bk, num_warps=4, **EXACT,
    )  # fmt: skip
    return g, s
