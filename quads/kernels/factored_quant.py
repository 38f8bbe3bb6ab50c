"""NVFP4 quantize to exact values (Triton): the activation side of the factored W4A4 GEMM in one pass.

For rows ``x`` ``[M, K]`` and a given amax per row (a group's amax, or the row's own), one kernel does
what ``quads.quant.factored`` would otherwise do in ~7 torch kernels: the canonical NVFP4 cast (the
arithmetic of ``nvfp4_quant._quantize_tile``, bit-exact with ``quads.formats.nvfp4``), then writes

- ``u = e2m1 * s`` (the dequantized value without its global scale; exact in BF16/FP16/FP32) in the
  output's dtype,
- ``g = S_dec`` per row (fp32),
- optionally the residual ``r = x - u * S_dec`` in fp32 (``(e2m1 * s) * S_dec`` is the reference's
  dequantized value, bit for bit; no FMA contraction, ``EXACT``).

``index`` ``[M, n]`` (long): quantize the gathered elements ``x[i, index[i, :]]`` as the row (blocks of 16
consecutive indices, RAC's selection order) and scatter ``u`` back to ``out[i, index[i, j]]`` (``out``
``[M, K]``, zero-initialized by the caller), so the residual operand never exists in gathered form.
Rows sorted by expert with each expert's amax as the global scale (the decode step): ``group_units``, the
same kernel given each row's NaN-ignoring max (computed where the rows are made: Inductor can fuse it into the
kernel that writes them) and the groups' row offsets; each program takes its rows' group amaxes as the max of
their groups' row maxima, so the group amax needs no launch (no zero fill, no atomics).
The kernel runs over rows x column tiles, so a decode-sized operand (1,024 x 1,024) is ~1,000 programs.
The pure-PyTorch twin is ``quantize_units_reference``; tests compare them byte for byte.
"""

from __future__ import annotations

import torch

from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK
from quads.kernels import tuning
from quads.kernels._common import EXACT, HAS_TRITON, check_out
from quads.kernels.rac_select import RacMethod

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels.nvfp4_quant import (
        _global_scales,
        _store_codes_scales,
        _store_units,
        _units_tile,
    )

    @triton.jit
    def _row_keys(group_ptr, rows, rmask, G, BY: tl.constexpr):
        """The row of a per-row table each row reads: its own (BY 0), its group's (1: ``group[row]``), its
        channel group's (2: ``min(group[row], G - 1)``, the masked rows' group G taking group G-1's), or row 0
        (3: one group)."""
        if BY == 0:
            return rows
        elif BY == 3:
            return rows * 0
        else:
            grp = tl.load(group_ptr + rows, mask=rmask, other=0)
            return tl.minimum(grp, G - 1) if BY == 2 else grp

    @triton.jit
    def _group_rows_max(rmax_ptr, group_ptr, offs_ptr, r0, rows, rmask, M, G, CHUNK: tl.constexpr):
        """Each row's group amax from the row maxima ``rmax`` ``[M]`` (>= 0, NaN-free) of rows sorted by group
        (``rows`` from ``r0 < M`` on): the max of ``rmax[offs[g], offs[g + 1])`` for the row's group g < G; 0 for
        an empty range and for the rows of no group (G: zero rows, ``factored.operands``), as
        ``factored.Segments.row_max`` of their zeroed values. Exact (a max). The span read is from the first
        row's group's start to the last row's group's end, the rows of no group never (scalar loads: the groups
        are sorted)."""
        grp = tl.load(group_ptr + rows, mask=rmask, other=0)
        start = tl.load(offs_ptr + tl.minimum(grp, G), mask=rmask, other=0)
        end = tl.where(grp < G, tl.load(offs_ptr + grp + 1, mask=rmask & (grp < G), other=0), start)
        g_lo = tl.load(group_ptr + r0)
        g_hi = tl.load(group_ptr + tl.minimum(r0 + rows.shape[0], M) - 1)
        lo = tl.load(offs_ptr + tl.minimum(g_lo, G))
        hi = tl.load(offs_ptr + tl.minimum(g_hi + 1, G))
        acc = tl.zeros(rows.shape, tl.float32)
        for j0 in range(lo, hi, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            v = tl.load(rmax_ptr + j, mask=j < hi, other=0.0)
            inside = (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])
            acc = tl.maximum(acc, tl.max(tl.where(inside, v[None, :], 0.0), axis=1))
        return acc

    @triton.jit
    def _quantize_units_kernel(
        x_ptr, amax_ptr, group_ptr, offs_ptr, idx_ptr, u_ptr, g_ptr, r_ptr, codes_ptr, scales_ptr, M, K, W, G,
        stride_xm, stride_um, stride_idx, COLS, AMAX_BY: tl.constexpr, IDX_BY: tl.constexpr, GATHER: tl.constexpr,
        RESIDUAL: tl.constexpr, CODES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program (i, c): rows ``[i BLOCK_M, (i + 1) BLOCK_M)`` x columns ``[c COLS, (c + 1) COLS)`` of the
        quantized width W (K, or n gathered channels) in steps of BLOCK_K. The row's amax is
        ``amax[_row_keys(AMAX_BY)]``, or for ``AMAX_BY`` 4 (``BY_GROUP_ROWS``) the max of its group's row maxima
        ``amax`` (``_group_rows_max``, the groups' row offsets ``offs``); gathered, its channels
        ``idx[_row_keys(IDX_BY), :W]`` (rows of ``stride_idx``). Where the rows have groups (``AMAX_BY`` 4,
        ``IDX_BY`` 2), the rows of no group (G) are read as zeros (``factored.operands``' zero rows: u = 0, r = 0)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        if AMAX_BY == 4 or IDX_BY == 2:
            xmask = rmask & (tl.load(group_ptr + rows, mask=rmask, other=0) < G)
        else:
            xmask = rmask
        if AMAX_BY == 4:
            amax = _group_rows_max(amax_ptr, group_ptr, offs_ptr, tl.program_id(0) * BLOCK_M, rows, rmask, M, G, 64)
        else:
            amax = tl.load(amax_ptr + _row_keys(group_ptr, rows, rmask, G, AMAX_BY), mask=rmask, other=0.0)
        irow = _row_keys(group_ptr, rows, rmask, G, IDX_BY)
        s_enc, s_dec = _global_scales(amax)
        c0 = tl.program_id(1) * COLS
        tl.store(g_ptr + rows, s_dec, mask=rmask & (rows * 0 + c0 == 0))  # by the first column block
        for k0 in range(c0, c0 + COLS, BLOCK_K):
            j = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (j[None, :] < W)
            if GATHER:
                ch = tl.load(idx_ptr + irow[:, None] * stride_idx + j[None, :], mask=m, other=0)
            else:
                ch = tl.broadcast_to(j[None, :], (BLOCK_M, BLOCK_K))
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ch, mask=m & xmask[:, None], other=0.0).to(tl.float32)
            packed, s_byte, u = _units_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K)
            if CODES:  # the NVFP4 tensor itself, [M, W/2] codes and [M, W/16] scales (tests, export)
                _store_codes_scales(codes_ptr, scales_ptr, packed, s_byte, rows, rmask, k0, W, 1, 1, 1,
                                    False, BLOCK_K)
            _store_units(u_ptr, r_ptr, x, u, s_dec, rows, ch, m, stride_um, K, RESIDUAL)


    @triton.jit
    def _gather_amax_kernel(r_ptr, group_ptr, order_ptr, amax_ptr, M, K, n, G, stride_order, IDX_BY: tl.constexpr,
                            AMAX_BY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        """NaN-ignoring max of ``|r[row, order[_row_keys(IDX_BY), :n]]|`` for rows ``[i BLOCK_M, (i + 1)
        BLOCK_M)`` into ``amax[_row_keys(AMAX_BY)]``: stored per row (AMAX_BY 0), else an atomic max (``amax``
        zeroed by the caller; a row's group, or one). With groups (IDX_BY 2) the rows of no group (G) are read
        as zeros (``factored.operands``' zero rows), so their amax is 0."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        lmask = rmask
        if IDX_BY == 2:
            lmask = rmask & (tl.load(group_ptr + rows, mask=rmask, other=0) < G)
        irow = _row_keys(group_ptr, rows, rmask, G, IDX_BY)
        acc = tl.zeros((BLOCK_M,), tl.float32)
        for j0 in range(0, n, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            m = rmask[:, None] & (j < n)[None, :]
            ch = tl.load(order_ptr + irow[:, None] * stride_order + j[None, :], mask=m, other=0)
            x = tl.load(r_ptr + rows[:, None] * K + ch, mask=m & lmask[:, None], other=0.0)
            acc = tl.maximum(acc, tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=1))
        if AMAX_BY == 0:
            tl.store(amax_ptr + rows, acc, mask=rmask)
        else:
            tl.atomic_max(amax_ptr + _row_keys(group_ptr, rows, rmask, G, AMAX_BY), acc, mask=rmask, sem="relaxed")


BY_ROW, BY_GROUP, BY_CHANNEL_GROUP, BY_ONE = 0, 1, 2, 3  # _row_keys' modes
BY_GROUP_ROWS = 4  # the quantize kernel's amax: the max of the row's group's row maxima (_group_rows_max)


def quantize_units(
    x: torch.Tensor,
    amax: torch.Tensor,
    *,
    dtype: torch.dtype = torch.bfloat16,
    index: torch.Tensor | None = None,
    residual: bool = False,
    codes: bool = False,
    out: torch.Tensor | None = None,
    block_m: int = 8,
    block_k: int = 128,
    cols: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, ...]:
    """``(u [M, K] in dtype, g [M] fp32, r [M, K] fp32 or None)`` of ``x`` ``[M, K]`` with amax ``[M]``
    (see the module docstring; ``index`` ``[M, n]``: gathered quantization, ``u`` scattered, zero elsewhere;
    ``residual`` only without ``index``). ``codes``: also the packed codes ``[M, W/2]`` and E4M3 scales
    ``[M, W/16]`` (W = K or n) as two more outputs. ``out``: write ``u`` there (``[M, K]``, rows may be
    strided, e.g. one slice of a stacked operand; zero-filled by the caller when ``index`` is given).
    Launch config: one program per ``block_m`` rows x ``cols`` columns (a multiple of ``block_k``; None:
    ``block_k``, one tile per program)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use quantize_units_reference")
    if residual and index is not None:
        raise ValueError("quantize_units: residual=True needs index=None (the residual of gathered rows is not kept)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    width = k if index is None else index.shape[1]
    if width % NVFP4_BLOCK:
        raise ValueError(f"quantize_units needs a width multiple of {NVFP4_BLOCK}, got {width}")
    if out is None:
        u = (torch.empty if index is None else torch.zeros)(m, k, dtype=dtype, device=x.device)
    else:
        check_out(out, m, k, "quantize_units")
        u = out
    g, r = _launch_units(x, amax.reshape(m).float().contiguous(), None, 0, BY_ROW, index, BY_ROW, u, residual, codes,
                         block_m, block_k, cols, num_warps)  # fmt: skip
    return (u, g) + r


GROUP_UNITS_MAX_ROWS = 64  # group_units when the groups hold at most this many rows on average (decode)


def group_units(
    x: torch.Tensor,
    row_max: torch.Tensor,
    group: torch.Tensor,
    offsets: torch.Tensor,
    groups: int,
    out: torch.Tensor,
    *,
    residual: bool = False,
    block_m: int | None = None,
    block_k: int | None = None,
    cols: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quantize_units`` of rows sorted by group (``group`` ``[M]`` in ``[0, groups]``, as ``factored.Segments``;
    ``offsets`` ``[groups + 1]``: the first row of each group and of the rows of no group) with each group's
    NaN-ignoring amax as the global scale, writing ``u`` into ``out`` (``[M, K]``, rows may be strided) -> ``(g
    [M], r [M, K] fp32 or None)``. ``row_max`` ``[M]`` fp32: each row's NaN-ignoring ``max |x|``
    (``factored.row_amax``'s values, computed by the caller where the rows are made). One launch: each program
    takes its rows' group amaxes as the max of their groups' row maxima, then quantizes. The rows of no group
    (group ``groups``, the masked slots) are zero rows, as ``factored.operands`` defines them: u = 0, r = 0, S_dec
    1, whatever ``x`` holds there. The same bits as zeroing them, then ``row_amax``, ``Segments.row_max`` and
    ``quantize_units``; each program reads its groups' row maxima (never those of no group), so it
    is for few rows per group (``GROUP_UNITS_MAX_ROWS``: the decode step). ``block_m``, ``block_k``, ``cols``:
    the quantize's launch config, as ``quantize_units``; each launch setting left None comes from ``tuning.json``
    (``group_units.decode``)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use row_amax, Segments.row_max and quantize_units_reference")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"group_units needs a width multiple of {NVFP4_BLOCK}, got {k}")
    if group.shape != (m,) or row_max.shape != (m,) or offsets.shape != (groups + 1,):
        raise ValueError(f"group_units: expected group [{m}], row_max [{m}] and offsets [{groups + 1}], got "
                         f"{tuple(group.shape)}, {tuple(row_max.shape)} and {tuple(offsets.shape)}")
    if row_max.dtype != torch.float32:
        raise ValueError(f"group_units: row_max must be fp32 (the row maxima), got {row_max.dtype}")
    check_out(out, m, k, "group_units")
    cfg = tuning.config("group_units", "decode", block_m=block_m, block_k=block_k, cols=cols, num_warps=num_warps)
    block_m, block_k, cols, num_warps = (cfg[key] for key in ("block_m", "block_k", "cols", "num_warps"))
    g, r = _launch_units(x, row_max.contiguous(), group.contiguous(), groups, BY_GROUP_ROWS, None, BY_ROW, out,
                         residual, False, block_m, block_k, cols, num_warps, offsets=offsets.contiguous())
    return g, r[0]


def rac_static_units(
    r: torch.Tensor,
    group: torch.Tensor | None,
    groups: int,
    order: torch.Tensor,
    out: torch.Tensor,
    *,
    n: int,
    per_token: bool = False,
    block_m: int = 8,
    block_k: int = 128,
    num_warps: int = 4,
) -> torch.Tensor:
    """RAC's residual operand with a calibrated channel order (``rac_selection="static"``): the exact values of
    NVFP4(``r[i, S_g]``), ``S_g = order[g, :n]`` of row i's group g (``group=None``: one group, ``order[0]``),
    scattered to their channels in ``out`` ``[M, K]`` (zero-filled by the caller; rows may be strided) -> S_dec
    ``[M]``; the rows of no group (group G, the masked slots) are read as zeros (u = 0, S_dec 1), as
    ``factored.operands`` defines them. The global scale: the NaN-ignoring amax of the row's gathered values
    (``per_token``), else of its group's (atomic max per row). Two launches, no sort; the same bits as
    ``factored.operands``' steps (``row_amax`` of the gather, ``Segments.row_max``, ``quantize_units``)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use quads.quant.factored.operands' steps")
    from quads.kernels.rac_select import check_residual

    m, k = check_residual(r, n, "rac_static_units")
    want = 1 if group is None else groups
    if order.dim() != 2 or order.shape[0] != want or order.shape[1] < n or order.dtype != torch.long:
        raise ValueError(f"rac_static_units needs a long channel order [{want}, >= {n}], got {order.dtype} "
                         f"{tuple(order.shape)}")  # fmt: skip
    check_out(out, m, k, "rac_static_units")
    order = order.contiguous()
    idx_by = BY_ONE if group is None else BY_CHANNEL_GROUP
    if per_token:
        amax, amax_by = torch.empty(m, dtype=torch.float32, device=r.device), BY_ROW
    else:
        amax = torch.zeros(1 if group is None else groups + 1, dtype=torch.float32, device=r.device)
        amax_by = BY_ONE if group is None else BY_GROUP
    grp = amax if group is None else group.contiguous()  # a placeholder pointer for one group
    _gather_amax_kernel[(triton.cdiv(m, 4),)](
        r, grp, order, amax, m, k, n, groups, order.stride(0), IDX_BY=idx_by, AMAX_BY=amax_by, BLOCK_M=4,
        BLOCK_N=min(256, triton.next_power_of_2(n)), num_warps=num_warps, **EXACT,
    )  # fmt: skip
    g, _ = _launch_units(r, amax, grp, groups, amax_by, order, idx_by, out, False, False, block_m, block_k, None,
                         num_warps, width=n)  # fmt: skip
    return g


def _launch_units(x, amax, group, groups, amax_by, index, idx_by, u, residual, codes, block_m, block_k, cols, num_warps,
                  width=None, offsets=None):  # fmt: skip
    """``_quantize_units_kernel`` over ``x`` into ``u`` -> ``(g, (r or None,) + (codes, scales) if codes)``;
    ``width``: the gathered channels per row (None: ``index``'s columns, or K); ``offsets``: the groups' first
    rows (``BY_GROUP_ROWS``). Where the rows have groups (``BY_GROUP_ROWS``, ``BY_CHANNEL_GROUP``), the rows of
    no group are read as zeros."""
    m, k = x.shape
    width = width or (k if index is None else index.shape[1])
    g = torch.empty(m, dtype=torch.float32, device=x.device)
    r = torch.empty(m, k, dtype=torch.float32, device=x.device) if residual else g
    idx = g if index is None else index.contiguous()
    cd = torch.empty(m, width // 2, dtype=torch.uint8, device=x.device) if codes else g
    sc = torch.empty(m, width // NVFP4_BLOCK, dtype=torch.uint8, device=x.device) if codes else g
    bk = max(NVFP4_BLOCK, min(block_k, triton.next_power_of_2(width)))
    cols = bk if cols is None else cols
    if cols % bk:
        raise ValueError(f"quantize launch: cols={cols} must be a multiple of block_k={bk}")
    _quantize_units_kernel[(triton.cdiv(m, block_m), triton.cdiv(width, cols))](
        x, amax, amax if group is None else group, amax if offsets is None else offsets, idx, u, g, r, cd, sc, m, k,
        width, groups, x.stride(0), u.stride(0),
        idx.stride(0) if index is not None else 0, cols, AMAX_BY=amax_by, IDX_BY=idx_by, GATHER=index is not None,
        RESIDUAL=residual, CODES=codes, BLOCK_M=block_m, BLOCK_K=bk, num_warps=num_warps, **EXACT,
    )  # fmt: skip
    rest = (r if residual else None,)
    return g, rest + (cd, sc.view(torch.float8_e4m3fn)) if codes else rest


def quantize_units_reference(
    x: torch.Tensor,
    amax: torch.Tensor,
    *,
    dtype: torch.dtype = torch.bfloat16,
    index: torch.Tensor | None = None,
    residual: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pure-PyTorch twin of ``quantize_units`` (``nvfp4.quantize`` with the given amax per row)."""
    if residual and index is not None:
        raise ValueError("quantize_units: residual=True needs index=None (the residual of gathered rows is not kept)")
    xf = x.float()
    xs = xf if index is None else xf.gather(1, index)
    us, s_dec = nvfp4.scaled_values(xs, amax=amax.reshape(-1, 1))
    g = s_dec.reshape(-1)
    if index is None:
        u = us.to(dtype)
    else:
        u = torch.zeros(xf.shape, dtype=dtype, device=x.device).scatter_(1, index, us.to(dtype))
    if out is not None:
        u = out.copy_(u)
    if not residual:
        return u, g, None
    return u, g, xf - us * g[:, None]


# ------------------------------------------------------------------------------- as custom ops
# The compiled decode step (torch.compile) sees the kernels below as opaque ops with a declared
# mutation (``out``) and fresh outputs, so Dynamo neither traces the launchers (their Python: shape
# checks, the tuning table read) nor functionalizes a Triton kernel that writes into a strided view.


@torch.library.custom_op("quads::quantize_units", mutates_args=("out",))
def _units_op(x: torch.Tensor, amax: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor, slot: int,
              residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _, g, r = quantize_units(x, amax, dtype=out.dtype, index=index, residual=residual, out=out[:, slot])
    return g, (r if residual else g.new_empty(0))


@_units_op.register_fake
def _(x, amax, index, out, slot, residual):
    m, k = x.shape
    return x.new_empty(m, dtype=torch.float32), x.new_empty((m, k) if residual else (0,), dtype=torch.float32)


def units_op(x: torch.Tensor, amax: torch.Tensor, out: torch.Tensor, slot: int, *, index: torch.Tensor | None = None,
             residual: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quantize_units`` writing ``u`` into ``out[:, slot]`` (``out`` ``[M, P, K]``, the stacked operand),
    as the custom op ``quads::quantize_units`` -> ``(g [M], r [M, K] or None)``."""
    g, r = torch.ops.quads.quantize_units(x, amax, index, out, slot, residual)
    return g, (r if residual else None)


@torch.library.custom_op("quads::group_units", mutates_args=("out",))
def _group_units_op(x: torch.Tensor, row_max: torch.Tensor, group: torch.Tensor, offsets: torch.Tensor, groups: int,
                    out: torch.Tensor, slot: int, residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g, r = group_units(x, row_max, group, offsets, groups, out[:, slot], residual=residual)
    return g, (r if residual else g.new_empty(0))


@_group_units_op.register_fake
def _(x, row_max, group, offsets, groups, out, slot, residual):
    m, k = x.shape
    return x.new_empty(m, dtype=torch.float32), x.new_empty((m, k) if residual else (0,), dtype=torch.float32)


def group_units_op(x: torch.Tensor, row_max: torch.Tensor, group: torch.Tensor, offsets: torch.Tensor, groups: int,
                   out: torch.Tensor, slot: int, *, residual: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``group_units`` writing ``u`` into ``out[:, slot]`` (``out`` ``[M, P, K]``), as the custom op
    ``quads::group_units`` -> ``(g [M], r [M, K] or None)``."""
    g, r = torch.ops.quads.group_units(x, row_max, group, offsets, groups, out, slot, residual)
    return g, (r if residual else None)


@torch.library.custom_op("quads::rac_static_units", mutates_args=("out",))
def _rac_static_units_op(r: torch.Tensor, group: torch.Tensor | None, groups: int, order: torch.Tensor,
                         out: torch.Tensor, slot: int, n: int, per_token: bool) -> torch.Tensor:
    dst = out[:, slot]
    dst.zero_()
    return rac_static_units(r, group, groups, order, dst, n=n, per_token=per_token)


@_rac_static_units_op.register_fake
def _(r, group, groups, order, out, slot, n, per_token):
    return r.new_empty(r.shape[0], dtype=torch.float32)


def rac_static_units_op(r: torch.Tensor, group: torch.Tensor | None, groups: int, order: torch.Tensor,
                        out: torch.Tensor, slot: int, *, n: int, per_token: bool) -> torch.Tensor:
    """``rac_static_units`` writing RAC's residual operand into ``out[:, slot]`` (zero-filled here; ``out``
    ``[M, P, K]``), as the custom op ``quads::rac_static_units`` -> S_dec ``[M]``."""
    return torch.ops.quads.rac_static_units(r, group, groups, order, out, slot, n, per_token)


@torch.library.custom_op("quads::rac_group_norms", mutates_args=())
def _rac_group_norms_op(r: torch.Tensor, group: torch.Tensor | None, groups: int) -> torch.Tensor:
    from quads.kernels.rac_select import group_norms

    return group_norms(r, group, groups)


@_rac_group_norms_op.register_fake
def _(r, group, groups):
    return r.new_empty((1 if group is None else groups, r.shape[1]), dtype=torch.float64)


def rac_group_norms_op(r: torch.Tensor, group: torch.Tensor | None, groups: int) -> torch.Tensor:
    """``rac_select.group_norms`` as the custom op ``quads::rac_group_norms``."""
    return torch.ops.quads.rac_group_norms(r, group, groups)


@torch.library.custom_op("quads::row_amax", mutates_args=())
def _row_amax_op(x: torch.Tensor) -> torch.Tensor:
    from quads.kernels.nvfp4_quant import row_amax

    return row_amax(x)


@_row_amax_op.register_fake
def _(x):
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


def row_amax_op(x: torch.Tensor) -> torch.Tensor:
    """``nvfp4_quant.row_amax`` as the custom op ``quads::row_amax``."""
    return torch.ops.quads.row_amax(x)


@torch.library.custom_op("quads::rac_units", mutates_args=("out",))
def _rac_units_op(r: torch.Tensor, group: torch.Tensor | None, groups: int, out: torch.Tensor, slot: int, n: int,
                  per_token: bool, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    from quads.kernels.rac_select import rac_units

    return rac_units(r, group, groups, out[:, slot], n=n, per_token=per_token, method=method)


@_rac_units_op.register_fake
def _(r, group, groups, out, slot, n, per_token, method):
    return r.new_empty(r.shape[0], dtype=torch.float32), r.new_empty((1 if group is None else groups, n),
                                                                     dtype=torch.long)


def rac_units_op(r: torch.Tensor, group: torch.Tensor | None, groups: int, out: torch.Tensor, slot: int, *, n: int,
                 per_token: bool, method: RacMethod | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rac_select.rac_units`` writing RAC's residual operand into ``out[:, slot]`` (``out`` ``[M, P, K]``,
    the stacked operand), as the custom op ``quads::rac_units`` -> ``(S_dec [M], S [G, n])``. ``method``:
    the selection algorithm (None: ``rac_select.default_method``, resolved here so that the op's
    argument names it)."""
    from quads.kernels.rac_select import default_method

    method = default_method(r.shape[-1], group is not None) if method is None else method
    return torch.ops.quads.rac_units(r, group, groups, out, slot, n, per_token, method)


@torch.library.custom_op("quads::rac_operand", mutates_args=("out",))
def _rac_operand_op(x: torch.Tensor, offsets: torch.Tensor, groups: int, out: torch.Tensor, n: int, warps: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    from quads.kernels import rac_operand_cuda

    return rac_operand_cuda.operand(x, offsets, groups, out, n=n, warps=warps)


@_rac_operand_op.register_fake
def _(x, offsets, groups, out, n, warps):
    return x.new_empty((x.shape[0], 2), dtype=torch.float32), x.new_empty((groups, n), dtype=torch.long)


def rac_operand_op(x: torch.Tensor, offsets: torch.Tensor, groups: int, out: torch.Tensor, *, n: int, warps: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rac_operand_cuda.operand`` (the decode's W4A4 + RAC operand in one CUDA launch, writing ``out`` ``[M, 2,
    K]``) as the custom op ``quads::rac_operand`` -> ``(S_dec of both terms [M, 2], S [G, n])``."""
    return torch.ops.quads.rac_operand(x, offsets, groups, out, n, warps)
