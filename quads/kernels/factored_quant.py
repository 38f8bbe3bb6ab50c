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
group amaxes by one atomic max per row, then the same kernel reading each row's amax through its group.
The kernel runs over rows x column tiles, so a decode-sized operand (1,024 x 1,024) is ~1,000 programs.
The pure-PyTorch twin is ``quantize_units_reference``; tests compare them byte for byte.
"""

from __future__ import annotations

import torch

from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK
from quads.kernels._common import EXACT, HAS_TRITON
from quads.kernels.rac_select import RacMethod

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels.nvfp4_quant import (
        _global_scales,
        _store_codes_scales,
        _store_units,
        _units_tile,
        rows_absmax,
    )

    @triton.jit
    def _quantize_units_kernel(
        x_ptr, amax_ptr, group_ptr, idx_ptr, u_ptr, g_ptr, r_ptr, codes_ptr, scales_ptr, M, K, W, stride_xm,
        stride_um, COLS, GROUPED: tl.constexpr, GATHER: tl.constexpr, RESIDUAL: tl.constexpr, CODES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program (i, c): rows ``[i BLOCK_M, (i + 1) BLOCK_M)`` x columns ``[c COLS, (c + 1) COLS)`` of the
        quantized width W (K, or n gathered channels) in steps of BLOCK_K; the row's amax is ``amax[row]``, or
        ``amax[group[row]]`` with GROUPED."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        if GROUPED:
            amax = tl.load(amax_ptr + tl.load(group_ptr + rows, mask=rmask, other=0), mask=rmask, other=0.0)
        else:
            amax = tl.load(amax_ptr + rows, mask=rmask, other=0.0)
        s_enc, s_dec = _global_scales(amax)
        c0 = tl.program_id(1) * COLS
        tl.store(g_ptr + rows, s_dec, mask=rmask & (rows * 0 + c0 == 0))  # by the first column block
        for k0 in range(c0, c0 + COLS, BLOCK_K):
            j = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (j[None, :] < W)
            if GATHER:
                ch = tl.load(idx_ptr + rows[:, None] * W + j[None, :], mask=m, other=0)
            else:
                ch = tl.broadcast_to(j[None, :], (BLOCK_M, BLOCK_K))
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ch, mask=m, other=0.0).to(tl.float32)
            packed, s_byte, u = _units_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K)
            if CODES:  # the NVFP4 tensor itself, [M, W/2] codes and [M, W/16] scales (tests, export)
                _store_codes_scales(codes_ptr, scales_ptr, packed, s_byte, rows, rmask, k0, W, 1, 1, 1,
                                    False, BLOCK_K)
            _store_units(u_ptr, r_ptr, x, u, s_dec, rows, ch, m, stride_um, K, RESIDUAL)


    @triton.jit
    def _group_amax_kernel(x_ptr, group_ptr, amax_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr):  # fmt: skip
        """``amax[group[r]] = max(amax[group[r]], max |x[r, :]|)`` for rows ``[i BLOCK_M, (i + 1) BLOCK_M)``,
        NaN ignored (``amax`` zero-filled by the caller; one atomic max per row, exact and order-free)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        row_max = rows_absmax(x_ptr + rows * stride_xm, rmask, K, BLOCK_M, BLOCK_K)
        grp = tl.load(group_ptr + rows, mask=rmask, other=0)
        tl.atomic_max(amax_ptr + grp, row_max, mask=rmask, sem="relaxed")


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
        _check_out(out, m, k, "quantize_units")
        u = out
    g, r = _launch_units(x, amax.reshape(m).float().contiguous(), None, index, u, residual, codes, block_m, block_k,
                         cols, num_warps)
    return (u, g) + r


GROUP_UNITS_MAX_ROWS = 64  # group_units when the groups hold at most this many rows on average (decode)


def group_units(
    x: torch.Tensor,
    group: torch.Tensor,
    groups: int,
    out: torch.Tensor,
    *,
    residual: bool = False,
    block_m: int = 8,
    block_k: int = 128,
    cols: int | None = None,
    amax_block_m: int = 4,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quantize_units`` of rows sorted by group (``group`` ``[M]`` in ``[0, groups]``, as ``factored.Segments``)
    with each group's NaN-ignoring amax as the global scale, writing ``u`` into ``out`` (``[M, K]``, rows may be
    strided) -> ``(g [M], r [M, K] fp32 or None)``. Two launches: the group amaxes (one program per
    ``amax_block_m`` rows, an atomic max per row into a zeroed ``[groups + 1]``), then ``quantize_units``'
    kernel reading each row's amax through its group. The same bits as ``row_amax``, ``Segments.row_max`` and
    ``quantize_units`` (three to five launches); one atomic per row into ``groups + 1`` addresses, so it is for
    few rows per group (``GROUP_UNITS_MAX_ROWS``: the decode step). ``block_m``, ``block_k``, ``cols``: the
    quantize's launch config, as ``quantize_units``."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use row_amax, Segments.row_max and quantize_units_reference")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"group_units needs a width multiple of {NVFP4_BLOCK}, got {k}")
    if group.shape != (m,):
        raise ValueError(f"group_units: expected group [{m}], got {tuple(group.shape)}")
    _check_out(out, m, k, "group_units")
    group = group.contiguous()
    amax = torch.zeros(groups + 1, dtype=torch.float32, device=x.device)
    _group_amax_kernel[(triton.cdiv(m, amax_block_m),)](
        x, group, amax, m, k, x.stride(0), BLOCK_M=amax_block_m, BLOCK_K=min(256, triton.next_power_of_2(k)),
        num_warps=num_warps, **EXACT,
    )  # fmt: skip
    g, r = _launch_units(x, amax, group, None, out, residual, False, block_m, block_k, cols, num_warps)
    return g, r[0]


def _check_out(out: torch.Tensor, m: int, k: int, name: str) -> None:
    if out.shape != (m, k) or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be [{m}, {k}] with unit stride along K, got {tuple(out.shape)} "
                         f"strides {out.stride()}")


def _launch_units(x, amax, group, index, u, residual, codes, block_m, block_k, cols, num_warps):
    """``_quantize_units_kernel`` over ``x`` into ``u`` -> ``(g, (r or None,) + (codes, scales) if codes)``."""
    m, k = x.shape
    width = k if index is None else index.shape[1]
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
        x, amax, amax if group is None else group, idx, u, g, r, cd, sc, m, k, width, x.stride(0), u.stride(0), cols,
        GROUPED=group is not None, GATHER=index is not None, RESIDUAL=residual, CODES=codes, BLOCK_M=block_m,
        BLOCK_K=bk, num_warps=num_warps, **EXACT,
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
def _group_units_op(x: torch.Tensor, group: torch.Tensor, groups: int, out: torch.Tensor, slot: int,
                    residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g, r = group_units(x, group, groups, out[:, slot], residual=residual)
    return g, (r if residual else g.new_empty(0))


@_group_units_op.register_fake
def _(x, group, groups, out, slot, residual):
    m, k = x.shape
    return x.new_empty(m, dtype=torch.float32), x.new_empty((m, k) if residual else (0,), dtype=torch.float32)


def group_units_op(x: torch.Tensor, group: torch.Tensor, groups: int, out: torch.Tensor, slot: int, *,
                   residual: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``group_units`` writing ``u`` into ``out[:, slot]`` (``out`` ``[M, P, K]``), as the custom op
    ``quads::group_units`` -> ``(g [M], r [M, K] or None)``."""
    g, r = torch.ops.quads.group_units(x, group, groups, out, slot, residual)
    return g, (r if residual else None)


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
