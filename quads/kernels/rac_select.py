"""RAC's residual operand in Triton: per-group channel norms, stable top-n selection, quantize + scatter.

For the fp32 residual ``r`` ``[M, K]`` of the factored W4A4 path (``quads.quant.factored.operands``) and
rows grouped as in ``factored.Segments`` (``group`` ``[M]`` in ``[0, G]``, G = rows of no group, SORTED
ascending so that each group is one contiguous run of rows, as ``moe.static_routes`` orders them; or
``group=None``: all rows one group), the kernels produce what the reference path builds from ~12
torch kernels (sq_norms GEMM, argsort, gathers, two amax passes, a zero fill, the gathered quantize).

Shared numerics (both methods, so that they select the same channels bit for bit):

- ``norms[g, c]`` = the sum over the group's rows of ``r^2`` in fp64 (each square of an fp32 value is
  exact in fp64), added ROW BY ROW in row order (``_accumulate_rows``; masked lanes add +0, which
  changes no sum). The reference's fp64 GEMM ``members @ r^2`` may sum in another order, so two norms
  within a few fp64 ulps of each other may rank differently there; equal channels, the ties the
  tie-break decides, get equal norms everywhere. ``cmax[g, c]``: the NaN-ignoring max of ``|r|``.
- The order: ``key`` = the fp64 bits of the norm as int64 (norms are >= 0, so the integer order is the
  float order), every NaN mapped to one key above +inf; channels by key descending, equal keys by
  channel index ascending: exactly ``torch.argsort(norms, descending=True, stable=True)`` (torch sorts
  NaN above every number). ``S[g]`` = the first n channels; ``rank[g, c]`` = c's position.

``method="sort"`` (default for grouped rows and K <= ``SORT_MAX_K``, padded to a power of two), two kernels:

1. ``_rac_select_kernel`` (grid G, one program per group): the group's rows (found by one vector pass
   over ``group``), its K norms and maxima held in registers, then a bitonic sort of the
   ``(key, channel)`` pairs in registers (``_sort_rows``: log2(KP) (log2(KP) + 1) / 2 compare-and-swap
   steps over KP = next power of two of K; padded channels get key -1, after every real one; or, with
   ``sort_run``, runs of that many channels sorted in registers, then each pair's rank merged as the sum
   over the runs of a binary search, through a scratch row: the same order with fewer exchanges across
   warps, ``_merge_ranks``); stores
   ``S[g]``, ``rank[g]`` and, per group, ``gmax[g]`` = the max over S of ``cmax[g]`` (the n-th pair of
   the sorted list is the threshold: c is in S iff its pair is not after it). The rows of no group (group
   G, the masked slots) are zero rows, as the reference defines them: no program walks them.
2. ``_rac_units_sel_kernel`` (one row per program on the GPU): the row's gathered ``R[i, S]`` in one tile, its amax
   (``per_token``: NaN-ignoring max of the row; else ``gmax`` of its group; a row of no group reads as a zero
   row, amax 0, so S_dec = 1), the canonical NVFP4
   quantize (``nvfp4_quant._units_tile``), ``u`` scattered to its channels, zero outside S; S_dec.

   With ``select_backend="cuda"`` (``tuning.json`` at K = 1,024 and 256), step 1 is the CUDA kernel of
   ``rac_select_cuda`` instead: the same S, rank and gmax, the pairs sorted in registers across a block's warps.

   With ``split_runs`` (runs shorter than KP), step 1 is two launches of a program per (group, run) instead
   of one per group: ``_rac_run_sort_kernel`` sums its run's norms and maxima and sorts the run into the
   scratch rows, ``_rac_run_rank_kernel`` ranks its run's pairs by binary searches of every run, stores S and
   rank, and its run's part of ``gmax`` (the max over the run's selected channels; the units kernel takes the
   max over the parts): the same numbers, each group's chain of barriers cut into runs that run side by side.

``method="count"`` (any K; the default for one group and for K > ``SORT_MAX_K``), three kernels:

1. ``_rac_norms_kernel`` (grid G x K-blocks): norms and maxima per block of channels.
2. ``_rac_rank_kernel`` (grid G x K-blocks): ``rank[g, c] = #{c' : key[c'] > key[c] or (key[c'] ==
   key[c] and c' < c)}`` by comparing all K x K channel pairs; ``s[g, rank] = c`` if ``rank < n``.
3. ``_rac_units_kernel`` (grid over blocks of rows; the rows of no group read as zeros): the amax of
   ``R[:, S]`` per row or per group (``max over c in S of cmax[g, c]``), quantize, scatter, zero fill.

Cost: ``count`` compares K x K pairs per group (~K^2 int64 compares); ``sort`` ~K log2(K)^2 / 4
compare-and-swaps, but one program reads all of a group's rows, so a single group of many rows (a dense
layer at prefill) would be one program's sequential pass (``count`` spreads it over K / 128 programs):
the default keeps ``count`` for one group (``default_method``).

The pure-PyTorch reference is ``factored.operands`` under the reference backend; tests compare all three
byte for byte (u, g, channels).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from quads.formats.constants import NVFP4_BLOCK
from quads.kernels import tuning
from quads.kernels._common import EXACT, HAS_TRITON, check_out, interpreted

RacMethod = Literal["sort", "count"]  # the selection algorithm (module docstring); same channels either way
SelectBackend = Literal["triton", "cuda"]  # the sort path's selection kernel (``rac_units``); same bits either way
SORT_MAX_K = 4096  # the sort path holds a group's K norms (padded to a power of two) in one program

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out
    from quads.kernels.nvfp4_quant import _global_scales, _units_tile

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
    def _accumulate_rows(acc, cmax, r_ptr, i0, end, c, cmask, K, ROWS: tl.constexpr, WITH_MAX: tl.constexpr):
        """Rows ``i0 .. i0 + ROWS - 1`` below ``end``, one after the other: ``acc += r^2`` in fp64 (each
        square exact; a masked lane adds +0), ``cmax = max(cmax, |r|)`` NaN ignored (WITH_MAX). The one
        summation order of both selection methods: row by row, in row order."""
        for t in tl.static_range(ROWS):
            row = c * 0 + (i0 + t)  # as a vector: a scalar bound in the mask is not portable (interpreter)
            r = tl.load(r_ptr + row * K + c, mask=cmask & (row < end), other=0.0)
            r64 = r.to(tl.float64)
            acc = acc + r64 * r64
            if WITH_MAX:
                cmax = tl.maximum(cmax, tl.where(r != r, 0.0, tl.abs(r)))
        return acc, cmax

    @triton.jit
    def _rac_norms_kernel(r_ptr, group_ptr, norms_ptr, cmax_ptr, M, K, ONE_GROUP: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        """Over the rows i of group g: norms[g, c] = sum of r[i, c]^2 in fp64, cmax[g, c] = max |r[i, c]|
        (NaN ignored), for a block of channels c."""
        g = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < K
        start, end = _group_rows(group_ptr, g, M, ONE_GROUP, 256)
        acc = tl.zeros((BLOCK_C,), tl.float64)
        cmax = tl.zeros((BLOCK_C,), tl.float32)
        for i0 in range(start, end, ROWS):
            acc, cmax = _accumulate_rows(acc, cmax, r_ptr, i0, end, c, cmask, K, ROWS, True)
        tl.store(norms_ptr + g * K + c, acc, mask=cmask)
        tl.store(cmax_ptr + g * K + c, cmax, mask=cmask)

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
    def _row_groups(group_ptr, rows, rmask, G, ONE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
        """``(grp, gs)`` of ``rows``: each row's group id (G for a masked row), and the group whose channel
        selection it takes (a masked row takes the last group's)."""
        if ONE_GROUP:
            grp = tl.zeros((BLOCK_M,), tl.int32)
        else:
            grp = tl.load(group_ptr + rows, mask=rmask, other=0).to(tl.int32)
        return grp, tl.minimum(grp, G - 1)

    @triton.jit
    def _zero_outside(u_ptr, rank_ptr, rows, gs, rmask, K, n, stride_um, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """u[r, c] = 0 for the channels c outside row r's selection S (rank >= n in its group gs[r]),
        disjoint from the channels the caller scattered."""
        for c0 in range(0, K, BLOCK_K):
            c = c0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (c < K)[None, :]
            rk = tl.load(rank_ptr + gs[:, None] * K + c[None, :], mask=m, other=0)
            zero = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
            tl.store(u_ptr + rows[:, None] * stride_um + c[None, :], cast_out(zero, u_ptr), mask=m & (rk >= n))

    @triton.jit
    def _rac_units_kernel(
        r_ptr, group_ptr, s_ptr, rank_ptr, cmax_ptr, u_ptr, g_ptr, M, K, n, G, stride_um, ONE_GROUP: tl.constexpr,
        PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[BLOCK_M]``: amax of R[:, S], NVFP4(R[:, S]) scattered into u (zero outside S), S_dec. A row
        of no group is read as zeros."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        grp, gs = _row_groups(group_ptr, rows, rmask, G, ONE_GROUP, BLOCK_M)
        lmask = rmask & (grp < G)
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
                x = tl.load(r_ptr + rows[:, None] * K + ch, mask=m & lmask[:, None], other=0.0)
                acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)))
            else:  # its group's: the max over S of the group's per-channel maxima
                m = rmask[:, None] & (j < K)[None, :]
                rk = tl.load(rank_ptr + gs[:, None] * K + j[None, :], mask=m, other=n)
                cm = tl.load(cmax_ptr + grp[:, None] * K + j[None, :], mask=m & (rk < n) & lmask[:, None], other=0.0)
                acc = tl.maximum(acc, cm)
        s_enc, s_dec = _global_scales(tl.max(acc, axis=1))
        tl.store(g_ptr + rows, s_dec, mask=rmask)
        for k0 in range(0, n, BLOCK_K):
            j = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (j < n)[None, :]
            ch = tl.load(s_rows + j[None, :], mask=m, other=0)
            x = tl.load(r_ptr + rows[:, None] * K + ch, mask=m & lmask[:, None], other=0.0)
            _, _, u = _units_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K)
            tl.store(u_ptr + rows[:, None] * stride_um + ch, cast_out(u, u_ptr), mask=m)
        _zero_outside(u_ptr, rank_ptr, rows, gs, rmask, K, n, stride_um, BLOCK_M, BLOCK_K)

    @triton.jit
    def _swap_pairs(key, idx, W: tl.constexpr, S: tl.constexpr, J: tl.constexpr, LOG: tl.constexpr,
                    INTERP: tl.constexpr):  # fmt: skip
        """One compare-and-swap step of merge stage S (runs of 2**S) of a bitonic sort of each row of ``[W,
        2**LOG]`` (key, idx) pairs, partners 2**J apart, viewed as ``[W, A, 2, 2**J]``. A pair is "after" its
        partner when its key is smaller or the keys tie and its idx is larger (idx are distinct: a strict total
        order). Runs of stage S < LOG alternate direction (bit S of the position); the last stage sorts the
        whole row. The partner's values: one xor reduction over the pair axis on the GPU (as ``tl.sort``); the
        interpreter runs that reduction element by element in Python, so there the halves are swapped by a
        permute, split and join instead (the same values, ~20x faster)."""
        A: tl.constexpr = (1 << LOG) >> (J + 1)
        D: tl.constexpr = 1 << J
        k4 = tl.reshape(key, (W, A, 2, D))
        i4 = tl.reshape(idx, (W, A, 2, D))
        right = tl.arange(0, 2)[None, None, :, None]
        if INTERP:  # swap the halves: permute, split, join (builtins; tl.sum and tl.xor_sum are jit calls)
            kl, kr = tl.split(tl.permute(k4, (0, 1, 3, 2)))
            il, ir = tl.split(tl.permute(i4, (0, 1, 3, 2)))
            pk = tl.permute(tl.join(kr, kl), (0, 1, 3, 2))
            pi = tl.permute(tl.join(ir, il), (0, 1, 3, 2))
        else:
            pk = k4 ^ tl.xor_sum(k4, 2, keep_dims=True)
            pi = i4 ^ tl.xor_sum(i4, 2, keep_dims=True)
        if S < LOG:
            down = (tl.arange(0, A)[None, :, None, None] >> (S - J - 1)) & 1
        else:
            down = tl.zeros((1, A, 1, 1), tl.int32)
        after = (pk > k4) | ((pk == k4) & (pi < i4))  # this pair comes after its partner
        swap = after != ((down ^ right) != 0)  # the left (right) slot of an ascending run takes the earlier
        key = tl.reshape(tl.where(swap, pk, k4), (W, A * 2 * D))
        idx = tl.reshape(tl.where(swap, pi, i4), (W, A * 2 * D))
        return key, idx

    @triton.jit
    def _sort_rows(key, idx, W: tl.constexpr, LOG: tl.constexpr, INTERP: tl.constexpr):
        """Bitonic sort of each row of ``[W, 2**LOG]`` (int64 key, int32 idx) pairs held in registers: key
        descending, equal keys by idx ascending (the order of ``torch.argsort(descending=True, stable=True)``)."""
        for s in tl.static_range(1, LOG + 1):
            for t in tl.static_range(s):
                key, idx = _swap_pairs(key, idx, W, s, s - 1 - t, LOG, INTERP)
        return key, idx

    @triton.jit
    def _merge_ranks(key, idx, sk_ptr, si_ptr, W: tl.constexpr, LOG_L: tl.constexpr):
        """The rank of every pair of ``[W, L]`` (L = 2**LOG_L; each row sorted by ``_sort_rows``, the pairs
        distinct) in the order of all W L pairs: the sum over the rows of how many of that row's pairs come
        before it, each counted by a binary search of the row, stored to this program's scratch
        ``sk_ptr`` / ``si_ptr`` ``[W L]`` (its own row counts exactly its position there)."""
        L: tl.constexpr = 1 << LOG_L
        off = tl.arange(0, W)[:, None] * L + tl.arange(0, L)[None, :]
        tl.store(sk_ptr + off, key)
        tl.store(si_ptr + off, idx)
        tl.debug_barrier()  # every row stored before any is searched
        rank = tl.zeros((W, L), tl.int32)
        for w in tl.static_range(W):
            rank += _count_before(sk_ptr + w * L, si_ptr + w * L, key, idx, LOG_L)
        return rank

    @triton.jit
    def _before(pk, pi, key, idx):
        """Whether pair (pk, pi) comes before (key, idx): key descending, equal keys by idx ascending."""
        return (pk > key) | ((pk == key) & (pi < idx))

    @triton.jit
    def _count_before(sk_ptr, si_ptr, key, idx, LOG_L: tl.constexpr):
        """How many of the 2**LOG_L sorted pairs at ``sk_ptr`` / ``si_ptr`` come before each pair (key, idx) (any
        shape), by a binary search: the largest pos whose pairs all come before it, plus the pair at pos."""
        pos = tl.zeros(key.shape, tl.int32)
        for b in tl.static_range(LOG_L):
            step = 1 << (LOG_L - 1 - b)
            at = pos + (step - 1)
            pos = tl.where(_before(tl.load(sk_ptr + at), tl.load(si_ptr + at), key, idx), pos + step, pos)
        return pos + _before(tl.load(sk_ptr + pos), tl.load(si_ptr + pos), key, idx).to(tl.int32)

    @triton.jit
    def _channel_keys(r_ptr, group_ptr, g, c, cmask, M, K, ONE_GROUP: tl.constexpr, PER_TOKEN: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_G: tl.constexpr, C: tl.constexpr):  # fmt: skip
        """Group g's sort keys of channels ``c`` ``[C]`` (``_sort_key`` of the fp64 norms summed by
        ``_accumulate_rows``; padded channels -1, after every real one) and their |r| maxima (unless
        ``PER_TOKEN``)."""
        start, end = _group_rows(group_ptr, g, M, ONE_GROUP, BLOCK_G)
        acc = tl.zeros((C,), tl.float64)
        cmax = tl.zeros((C,), tl.float32)
        for i0 in range(start, end, ROWS):
            acc, cmax = _accumulate_rows(acc, cmax, r_ptr, i0, end, c, cmask, K, ROWS, not PER_TOKEN)
        return tl.where(cmask, _sort_key(acc), -1), cmax

    @triton.jit
    def _rac_select_kernel(
        r_ptr, group_ptr, s_ptr, rank_ptr, gmax_ptr, sk_ptr, si_ptr, M, K, n, ONE_GROUP: tl.constexpr,
        PER_TOKEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_G: tl.constexpr, LOG_K: tl.constexpr, LOG_W: tl.constexpr,
        INTERP: tl.constexpr,
    ):  # fmt: skip
        """Group g: the fp64 norms of its K channels, their stable descending order; stores S[g] (the first n),
        rank[g, c] and (per group) gmax[g] = max over S of the group's |r| maxima. The order: ``LOG_W`` 0, one
        bitonic sort of all KP pairs in registers; else each of 2**LOG_W runs of KP / 2**LOG_W channels sorted in
        registers (``_sort_rows``), then the ranks merged by binary searches of the runs (``_merge_ranks``, through this
        group's scratch rows ``sk`` / ``si`` ``[KP]``): the same order, fewer exchanges across warps."""
        g = tl.program_id(0)
        c = tl.arange(0, 1 << LOG_K)
        cmask = c < K
        key, cmax = _channel_keys(r_ptr, group_ptr, g, c, cmask, M, K, ONE_GROUP, PER_TOKEN, ROWS, BLOCK_G,
                                  1 << LOG_K)  # fmt: skip
        W: tl.constexpr = 1 << LOG_W
        L: tl.constexpr = (1 << LOG_K) >> LOG_W
        rk, ri = _sort_rows(tl.reshape(key, (W, L)), tl.reshape(c, (W, L)), W, LOG_K - LOG_W, INTERP)
        if LOG_W == 0:
            pos = tl.reshape(c, (W, L))  # one run: each pair's place in it is its rank
        else:
            pos = _merge_ranks(rk, ri, sk_ptr + g * (1 << LOG_K), si_ptr + g * (1 << LOG_K), W, LOG_K - LOG_W)
        tl.store(s_ptr + g * n + pos, ri.to(tl.int64), mask=pos < n)
        tl.store(rank_ptr + g * K + ri, pos, mask=ri < K)
        kth = tl.sum(tl.sum(tl.where(pos == n - 1, rk, 0), axis=1), axis=0)  # the n-th pair: the last one in S
        ith = tl.sum(tl.sum(tl.where(pos == n - 1, ri, 0), axis=1), axis=0)
        if not PER_TOKEN:
            sel = cmask & ((key > kth) | ((key == kth) & (c <= ith)))
            tl.store(gmax_ptr + g, tl.max(tl.where(sel, cmax, 0.0), axis=0))

    @triton.jit
    def _rac_run_sort_kernel(
        r_ptr, group_ptr, sk_ptr, si_ptr, cmax_ptr, M, K, ONE_GROUP: tl.constexpr, PER_TOKEN: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_G: tl.constexpr, LOG_K: tl.constexpr, LOG_L: tl.constexpr, INTERP: tl.constexpr,
    ):  # fmt: skip
        """Program (g, w), the split runs' first launch: the fp64 norms and |r| maxima of group g's channels
        [w L, (w + 1) L) (L = 2**LOG_L), as ``_rac_select_kernel`` sums them, the run's (key, channel) pairs sorted
        in registers (``_sort_rows``) and stored to ``sk`` / ``si`` [g, w L:(w + 1) L], the maxima to ``cmax``."""
        g = tl.program_id(0)
        L: tl.constexpr = 1 << LOG_L
        c = tl.program_id(1) * L + tl.arange(0, L)
        cmask = c < K
        key, cmax = _channel_keys(r_ptr, group_ptr, g, c, cmask, M, K, ONE_GROUP, PER_TOKEN, ROWS, BLOCK_G, L)
        rk, ri = _sort_rows(tl.reshape(key, (1, L)), tl.reshape(c, (1, L)), 1, LOG_L, INTERP)
        off = g.to(tl.int64) * (1 << LOG_K) + c
        tl.store(sk_ptr + off, tl.reshape(rk, (L,)))
        tl.store(si_ptr + off, tl.reshape(ri, (L,)))
        if not PER_TOKEN:
            tl.store(cmax_ptr + off, cmax)

    @triton.jit
    def _rac_run_rank_kernel(
        r_ptr, group_ptr, sk_ptr, si_ptr, cmax_ptr, s_ptr, rank_ptr, gmax_ptr, M, K, n, ONE_GROUP: tl.constexpr,
        PER_TOKEN: tl.constexpr, BLOCK_G: tl.constexpr, LOG_K: tl.constexpr, LOG_L: tl.constexpr,
    ):  # fmt: skip
        """Program (g, w), the split runs' second launch: the rank of each pair of group g's sorted run w among
        all KP pairs = the sum over the runs of how many of that run's pairs come before it (a binary search of
        each, as ``_merge_ranks``); stores S[g] (ranks < n), rank[g, c] and the run's part of gmax, ``gmax[g, w]``
        = the max of the selected channels' |r| maxima (the units kernel takes the max over w)."""
        g = tl.program_id(0)
        w = tl.program_id(1)
        L: tl.constexpr = 1 << LOG_L
        W: tl.constexpr = 1 << (LOG_K - LOG_L)
        base = g.to(tl.int64) * (1 << LOG_K)
        own = w * L + tl.arange(0, L)
        key = tl.load(sk_ptr + base + own)
        idx = tl.load(si_ptr + base + own)
        rank = tl.zeros((L,), tl.int32)
        for v in tl.static_range(W):
            rank += _count_before(sk_ptr + base + v * L, si_ptr + base + v * L, key, idx, LOG_L)
        tl.store(s_ptr + g * n + rank, idx.to(tl.int64), mask=rank < n)
        tl.store(rank_ptr + g * K + idx, rank, mask=idx < K)
        if not PER_TOKEN:
            sel = rank < n  # padded channels rank after the K real ones, so never below n <= K
            cmax = tl.load(cmax_ptr + base + idx, mask=sel, other=0.0)
            tl.store(gmax_ptr + g * W + w, tl.max(tl.where(sel, cmax, 0.0), axis=0))

    @triton.jit
    def _rac_units_sel_kernel(
        r_ptr, group_ptr, s_ptr, rank_ptr, gmax_ptr, u_ptr, g_ptr, M, K, n, G, stride_um, ONE_GROUP: tl.constexpr,
        PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GMAX_PARTS: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[BLOCK_M]`` (one on the GPU; the rows are independent) of the sort path: each row's gathered
        R[i, S] in one tile, its amax (the row's, or gmax of its group: the max of its ``GMAX_PARTS`` parts),
        NVFP4 quantize, u scattered to S, zero outside S, S_dec. A row of no group is read as zeros, its amax as 0
        (no gmax slot is written for it)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        grp, gs = _row_groups(group_ptr, rows, rmask, G, ONE_GROUP, BLOCK_M)
        j = tl.arange(0, BLOCK_N)
        m = rmask[:, None] & (j < n)[None, :]
        ch = tl.load(s_ptr + gs[:, None] * n + j[None, :], mask=m, other=0)  # [BLOCK_M, BLOCK_N]
        live = rmask & (grp < G)  # a row of no group: zeros, amax 0
        x = tl.load(r_ptr + rows[:, None] * K + ch, mask=m & live[:, None], other=0.0)
        if PER_TOKEN:
            amax = tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=1)
        else:
            amax = tl.load(gmax_ptr + grp * GMAX_PARTS, mask=live, other=0.0)
            for p in tl.static_range(1, GMAX_PARTS):
                amax = tl.maximum(amax, tl.load(gmax_ptr + grp * GMAX_PARTS + p, mask=live, other=0.0))
        s_enc, s_dec = _global_scales(amax)
        tl.store(g_ptr + rows, s_dec, mask=rmask)
        _, _, u = _units_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_N)
        tl.store(u_ptr + rows[:, None] * stride_um + ch, cast_out(u, u_ptr), mask=m)
        _zero_outside(u_ptr, rank_ptr, rows, gs, rmask, K, n, stride_um, BLOCK_M, BLOCK_K)


def check_residual(r: torch.Tensor, n: int | None, name: str) -> tuple[int, int]:
    """``(M, K)`` of RAC's residual ``r``: a contiguous fp32 ``[M, K]``, and ``0 < n <= K`` a multiple of 16
    channels (``n`` None: not checked); a clear error otherwise."""
    m, k = r.shape
    if r.dtype != torch.float32 or r.stride() != (k, 1):
        raise ValueError(f"{name} needs a contiguous fp32 residual, got {r.dtype} strides {r.stride()}")
    if n is not None and (not 0 < n <= k or n % NVFP4_BLOCK):
        raise ValueError(f"{name} needs 0 < n <= K={k} and n a multiple of {NVFP4_BLOCK}, got n={n}")
    return m, k


def default_method(k: int, grouped: bool = True) -> RacMethod:
    """``sort`` for rows in groups (experts) whose K norms, padded to a power of two, fit one program
    (``SORT_MAX_K``); else ``count``. One group (a dense layer, ``group=None``) keeps ``count``: the sort
    path would read all M rows in one program, where ``count`` spreads them over K / 128 programs."""
    return "sort" if grouped and 1 << max(k - 1, 0).bit_length() <= SORT_MAX_K else "count"


def rac_units(
    r: torch.Tensor,
    group: torch.Tensor | None,
    groups: int,
    out: torch.Tensor,
    *,
    n: int,
    per_token: bool = False,
    method: RacMethod | None = None,
    sort_run: int | None = None,
    select_warps: int | None = None,
    select_rows: int | None = None,
    split_runs: bool | None = None,
    select_backend: SelectBackend | None = None,
    cuda_warps: int | None = None,
    block_m: int | None = None,
    block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RAC's residual operand of ``r`` ``[M, K]`` fp32 (see the module docstring): writes the exact values
    of NVFP4(``R[:, S]``) scattered to their channels, zero elsewhere, into ``out`` ``[M, K]`` (rows may be
    strided, e.g. ``buf[:, 1]``); returns ``(S_dec [M] fp32, S [G, n] long)``. ``group`` ``[M]`` sorted
    ascending in ``[0, groups]`` (``groups``: rows of no group), or None (one group). ``method``: the
    selection algorithm (None: ``default_method(K, group is not None)``); both give the same bits. ``sort_run``
    (sort): channels per run sorted in registers before the runs' ranks are merged (``_rac_select_kernel``), a
    power of two, or null: one run of all K (padded to a power of two, KP); the same order either way.
    ``select_warps``: the select kernel's warps (null: KP / 128, within 4..16); ``select_rows``: rows whose loads
    the select kernel issues together when it sums a group's norms (null: 4096 / KP, within 1..8; the same sums
    in the same row order either way). ``split_runs`` (with runs shorter than KP): each run's norms and sort by a
    program of its own (grid groups x runs, ``_rac_run_sort_kernel``), the ranks merged by a second launch of as
    many programs (``_rac_run_rank_kernel``), where the select kernel runs one program per group; ``select_warps``
    are then the run kernels' (null: L / 64 for runs of L, within 2..8). ``select_backend``: ``"cuda"`` runs the
    selection as the CUDA kernel ``rac_select_cuda`` (rows in groups on a CUDA GPU, K a multiple of 16 up to 1,024;
    elsewhere the Triton kernels run): one block per group of ``cuda_warps`` warps (null:
    ``rac_select_cuda.default_warps``); the Triton ones' settings then unused. These six, None: ``tuning.json``
    ``rac_select`` for KP (launch options, the same bits under each). ``block_m``: rows per
    program of the units kernel (None: 16 for ``count``; for ``sort`` 1 on the GPU, 16 under the
    interpreter, whose cost is per program); ``block_k``: the count path's units tile width."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use quads.quant.factored.operands under the reference backend")
    m, k = check_residual(r, n, "rac_units")
    check_out(out, m, k, "rac_units")
    method = default_method(k, group is not None) if method is None else method
    if method not in get_args(RacMethod):
        raise ValueError(f"unknown RAC selection method {method!r}; valid: {', '.join(get_args(RacMethod))}")
    kp = triton.next_power_of_2(k)
    if method == "sort" and kp > SORT_MAX_K:
        raise ValueError(f"rac_units: method='sort' holds K (padded to a power of two) <= {SORT_MAX_K} norms in "
                         f"one program, got K={k}; use method='count'")
    if sort_run is not None and (sort_run < 2 or sort_run & (sort_run - 1) or method != "sort"):
        raise ValueError(f"rac_units: sort_run must be a power of two >= 2 with method='sort', got {sort_run} "
                         f"with method={method!r}")
    if select_rows is not None and select_rows < 1:
        raise ValueError(f"rac_units: select_rows must be >= 1, got {select_rows}")
    if split_runs and method != "sort":
        raise ValueError(f"rac_units: split_runs needs method='sort', got method={method!r}")
    if select_backend is not None and select_backend not in get_args(SelectBackend):
        raise ValueError(f"rac_units: unknown select_backend {select_backend!r}; valid: "
                         f"{', '.join(get_args(SelectBackend))}")
    one = group is None
    n_sel = 1 if one else groups  # groups that own a channel set (the masked rows' group G does not)
    grp = r if one else group.contiguous()  # a placeholder pointer for one group
    s = torch.empty(n_sel, n, dtype=torch.long, device=r.device)
    rank = torch.empty(n_sel, k, dtype=torch.int32, device=r.device)
    g = torch.empty(m, dtype=torch.float32, device=r.device)
    if method == "sort":
        tuned = tuning.config("rac_select", tuning.case("rac_select", f"k{kp}", "sort"),  # per padded K
                              sort_run=sort_run, select_warps=select_warps, select_rows=select_rows,
                              split_runs=split_runs, select_backend=select_backend, cuda_warps=cuda_warps)
        run, warps, rows = tuned["sort_run"], tuned["select_warps"], tuned["select_rows"]
        split = bool(tuned["split_runs"])
        bm = (16 if interpreted(r) else 1) if block_m is None else block_m
        if tuned["select_backend"] == "cuda":
            from quads.kernels import rac_select_cuda

            cw = tuned["cuda_warps"] or rac_select_cuda.default_warps(k)
            if rac_select_cuda.supports(r, group, cw):
                _cuda_units(r, grp, n_sel, out, s, rank, g, n, per_token, bm, cw)
                return g, s
        log_w = 0 if run is None or run >= kp else (kp // run).bit_length() - 1
        if split and not log_w:
            raise ValueError(f"rac_units: split_runs needs runs shorter than K padded to a power of two ({kp}), "
                             f"got sort_run={run}")
        if warps is None:
            warps = max(2, min(8, (kp >> log_w) // 64)) if split else max(4, min(16, kp // 128))
        rows = max(1, min(8, 4096 // kp)) if rows is None else rows
        _sort_units(r, grp, one, n_sel, out, s, rank, g, n, per_token, bm, log_w, warps, rows, split)
    else:
        _count_units(r, grp, one, n_sel, out, s, rank, g, n, per_token, block_m or 16, block_k)
    return g, s


def group_norms(r: torch.Tensor, group: torch.Tensor | None, groups: int) -> torch.Tensor:
    """``sum over a group's rows of r^2`` in fp64 ``[G, K]`` (``[1, K]`` for ``group=None``), added row by row in
    row order (``_rac_norms_kernel``, the count path's norms): the statistics a static RAC order is calibrated
    from (``factored.Segments.sq_norms``' values up to the fp64 summation order)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use quads.quant.factored.Segments.sq_norms")
    m, k = check_residual(r, None, "group_norms")
    one = group is None
    n_sel = 1 if one else groups
    norms = torch.empty(n_sel, k, dtype=torch.float64, device=r.device)
    cmax = torch.empty(n_sel, k, dtype=torch.float32, device=r.device)
    bc = min(128, triton.next_power_of_2(k))
    _rac_norms_kernel[(n_sel, triton.cdiv(k, bc))](r, r if one else group.contiguous(), norms, cmax, m, k,
                                                   ONE_GROUP=one, ROWS=4, BLOCK_C=bc, num_warps=4)  # fmt: skip
    return norms


def _sort_units(r, grp, one, n_sel, out, s, rank, g, n, per_token, block_m, log_w, warps, rows, split) -> None:
    """The sort path's launches (module docstring); ``log_w``: log2 of the sorted runs (0: one run);
    ``warps``: the select kernel's (``split``: the run kernels'); ``rows``: its rows loaded together; ``split``
    (``log_w`` > 0): each run's norms and sort by its own program, the ranks merged by a second launch."""
    m, k = r.shape
    kp = triton.next_power_of_2(k)
    parts = (1 << log_w) if split else 1  # gmax per group, in parts
    gmax = torch.empty(n_sel * parts, dtype=torch.float32, device=r.device)
    sk = torch.empty(n_sel, kp, dtype=torch.long, device=r.device) if log_w else gmax  # the merge's scratch
    si = torch.empty(n_sel, kp, dtype=torch.int32, device=r.device) if log_w else gmax
    common = dict(ONE_GROUP=one, PER_TOKEN=per_token, BLOCK_G=min(2048, triton.next_power_of_2(m)),
                  LOG_K=kp.bit_length() - 1)
    if split:
        cmax = torch.empty(n_sel, kp, dtype=torch.float32, device=r.device)
        log_l = kp.bit_length() - 1 - log_w
        _rac_run_sort_kernel[(n_sel, parts)](r, grp, sk, si, cmax, m, k, ROWS=rows, LOG_L=log_l,
                                             INTERP=interpreted(r), num_warps=warps, **common)  # fmt: skip
        _rac_run_rank_kernel[(n_sel, parts)](r, grp, sk, si, cmax, s, rank, gmax, m, k, n, LOG_L=log_l,
                                             num_warps=warps, **common)  # fmt: skip
    else:
        _rac_select_kernel[(n_sel,)](
            r, grp, s, rank, gmax, sk, si, m, k, n, ROWS=rows, LOG_W=log_w, INTERP=interpreted(r),
            num_warps=warps, **common,
        )  # fmt: skip
    _units_after_select(r, grp, one, n_sel, out, s, rank, gmax, g, n, per_token, block_m, parts)


def _cuda_units(r, grp, n_sel, out, s, rank, g, n, per_token, block_m, warps) -> None:
    """The sort path with its selection as the CUDA kernel (``rac_select_cuda``), then the same units kernel."""
    from quads.kernels import rac_select_cuda

    gmax = torch.empty(n_sel, dtype=torch.float32, device=r.device)
    rac_select_cuda.select(r, grp, s, rank, gmax, n=n, groups=n_sel, per_token=per_token, warps=warps)
    _units_after_select(r, grp, False, n_sel, out, s, rank, gmax, g, n, per_token, block_m, 1)


def _units_after_select(r, grp, one, n_sel, out, s, rank, gmax, g, n, per_token, block_m, parts) -> None:
    """The sort path's second launch, ``_rac_units_sel_kernel``, over the selection's S, rank and gmax."""
    m, k = r.shape
    bn = max(NVFP4_BLOCK, triton.next_power_of_2(n))
    _rac_units_sel_kernel[(triton.cdiv(m, block_m),)](
        r, grp, s, rank, gmax, out, g, m, k, n, n_sel, out.stride(0), ONE_GROUP=one, PER_TOKEN=per_token,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=min(triton.next_power_of_2(k), 1024), GMAX_PARTS=parts,
        num_warps=4 if block_m * bn <= 1024 else 8, **EXACT,
    )  # fmt: skip


def _count_units(r, grp, one, n_sel, out, s, rank, g, n, per_token, block_m, block_k) -> None:
    """The count path's three launches (module docstring)."""
    m, k = r.shape
    norms = torch.empty(n_sel, k, dtype=torch.float64, device=r.device)
    cmax = torch.empty(n_sel, k, dtype=torch.float32, device=r.device)  # the rows of no group: never read
    bc = min(128, triton.next_power_of_2(k))
    _rac_norms_kernel[(norms.shape[0], triton.cdiv(k, bc))](r, grp, norms, cmax, m, k, ONE_GROUP=one, ROWS=4,
                                                            BLOCK_C=bc, num_warps=4)  # fmt: skip
    _rac_rank_kernel[(n_sel, triton.cdiv(k, bc))](norms, rank, s, k, n, BLOCK_C=bc, BLOCK_J=min(64, bc),
                                                  num_warps=4)  # fmt: skip
    bk = max(NVFP4_BLOCK, min(block_k, triton.next_power_of_2(n)))
    _rac_units_kernel[(triton.cdiv(m, block_m),)](
        r, grp, s, rank, cmax, out, g, m, k, n, n_sel, out.stride(0), ONE_GROUP=one, PER_TOKEN=per_token,
        BLOCK_M=block_m, BLOCK_K=bk, num_warps=4, **EXACT,
    )  # fmt: skip
