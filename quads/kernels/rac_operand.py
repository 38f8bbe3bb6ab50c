"""W4A4 + RAC's whole activation operand of the decode step in one launch: a program per group does it all.

For rows ``x`` ``[M, K]`` sorted by group (``group`` ``[M]`` ascending in ``[0, G]``, G = the masked rows, as
``factored.Segments`` of ``moe.static_routes``) with each group's amax as the global scale and dynamic RAC
selection of ``n`` channels per group, ``factored.operands`` otherwise runs five launches a layer call
(``group_units``: a zero fill, the group amaxes, the quantize writing the residual; ``rac_select.rac_units``:
the selection, the residual's quantize). Their work per group is small at decode (~16 rows of 1,024 channels
in the 1b preset), so the step pays mostly for the chain of launches and the kernels' latencies. Here program
g does the same steps for its own rows, one after the other:

1. its rows (one vector pass over ``group``) and their amax (NaN-ignoring), the global scales;
2. the canonical NVFP4 quantize of each row (``nvfp4_quant._units_tile``): ``u`` into slot 0 of the stacked
   operand ``out`` ``[M, 2, K]``, zeros into slot 1, ``S_dec`` into ``g[:, 0]``, the fp32 residual into the
   scratch ``r``;
3. a block barrier, then ``rac_select._select_group`` over the residual it just wrote (the fp64 norms row by
   row, the stable descending sort, S, rank and the group's amax over S), the code the two-launch path runs;
4. a block barrier, then S and the group's amax over it loaded once, and for its rows NVFP4 of ``R[:, S]`` (the
   gathered quantize of ``rac_select._units_sel_rows``) scattered into slot 1 over the zeros, ``S_dec`` into
   ``g[:, 1]``.

The masked rows (group G) take their own amax for the activation and group G-1's channels and gmax[G] for the
residual, as the reference does: group G-1's program does them too, in each step beside its own rows.
Every value is computed by the same device functions in the same order as the launches it replaces, so the
outputs are the same bits (tests compare them with the five-launch path and the PyTorch reference). The
barriers order one program's global stores before its own threads' loads; no program reads another's output.

Cost: G programs (one wave), each a chain of its rows' loads, its sort (``rac_select``'s) and its rows' stores,
where the five-launch path spreads rows over many programs but waits at four kernel boundaries. A group of
many rows makes its program long: ``factored.operands`` takes this path only for the decode step's few rows
per group (``factored_quant.GROUP_UNITS_MAX_ROWS``) and where ``tuning.json`` ``rac_operand.decode.enabled``.
"""

from __future__ import annotations

import torch

from quads.formats.constants import NVFP4_BLOCK
from quads.kernels import tuning
from quads.kernels._common import EXACT, HAS_TRITON, interpreted
from quads.kernels.rac_select import SORT_MAX_K, check_residual

if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out
    from quads.kernels.nvfp4_quant import _global_scales, _store_units, _units_tile, rows_absmax
    from quads.kernels.rac_select import _group_rows, _select_group

    @triton.jit
    def _quantize_run(x_ptr, u_ptr, g_ptr, r_ptr, start, end, K, stride_xm, stride_um, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
        """Rows ``[start, end)`` (one group's) quantized with their common amax as the global scale: ``u`` into
        slot 0 at ``u_ptr`` (rows of ``stride_um``), zeros into slot 1 (RAC's operand outside S; S's channels are
        written over later), ``S_dec`` at ``g_ptr`` (rows of 2), the residual ``x - u * S_dec`` in fp32 at ``r_ptr``
        ``[M, K]`` (``group_units``' values: the amax, then ``_quantize_units_kernel``'s)."""
        acc = tl.zeros((BLOCK_M,), tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            acc = tl.maximum(acc, rows_absmax(x_ptr + rows * stride_xm, rows < end, K, BLOCK_M, BLOCK_K))
        amax = tl.max(acc, axis=0)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            s_enc, s_dec = _global_scales(tl.zeros((BLOCK_M,), tl.float32) + amax)
            tl.store(g_ptr + rows * 2, s_dec, mask=rmask)
            for k0 in range(0, K, BLOCK_K):
                ch = k0 + tl.arange(0, BLOCK_K)
                m = rmask[:, None] & (ch[None, :] < K)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + ch[None, :], mask=m, other=0.0).to(tl.float32)
                _, _, u = _units_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_K)
                _store_units(u_ptr, r_ptr, x, u, s_dec, rows, ch[None, :], m, stride_um, K, True)
                zero = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
                tl.store(u_ptr + K + rows[:, None] * stride_um + ch[None, :], cast_out(zero, u_ptr), mask=m)

    @triton.jit
    def _residual_run(r_ptr, u_ptr, g_ptr, start, end, ch, amax, n, K, stride_um, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):  # fmt: skip
        """Rows ``[start, end)`` of RAC's operand with their group's channels ``ch`` ``[BLOCK_N]`` (S in selection
        order, the first n live) and amax over them: NVFP4 of ``R[i, S]`` (``_units_tile``, as
        ``rac_select._units_sel_rows``) scattered into slot 1 at ``u_ptr``, ``S_dec`` at ``g_ptr`` (rows of 2)."""
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            m = rmask[:, None] & (tl.arange(0, BLOCK_N) < n)[None, :]
            x = tl.load(r_ptr + rows[:, None] * K + ch[None, :], mask=m, other=0.0)
            s_enc, s_dec = _global_scales(tl.zeros((BLOCK_M,), tl.float32) + amax)
            tl.store(g_ptr + rows * 2, s_dec, mask=rmask)
            _, _, u = _units_tile(x, s_enc, s_dec, BLOCK_M, BLOCK_N)
            tl.store(u_ptr + rows[:, None] * stride_um + ch[None, :], cast_out(u, u_ptr), mask=m)

    @triton.jit
    def _rac_operand_kernel(
        x_ptr, group_ptr, u_ptr, g_ptr, r_ptr, s_ptr, rank_ptr, gmax_ptr, sk_ptr, si_ptr, M, K, n, G, stride_xm,
        stride_um, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_G: tl.constexpr,
        LOG_K: tl.constexpr, LOG_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_MR: tl.constexpr,
        INTERP: tl.constexpr,
    ):  # fmt: skip
        """Program g < G: group g's operand (module docstring); program G-1 also the masked rows [end, M)."""
        g = tl.program_id(0)
        start, end = _group_rows(group_ptr, g, M, False, BLOCK_G)
        _quantize_run(x_ptr, u_ptr, g_ptr, r_ptr, start, end, K, stride_xm, stride_um, BLOCK_M, BLOCK_K)
        if g == G - 1:
            _quantize_run(x_ptr, u_ptr, g_ptr, r_ptr, end, M, K, stride_xm, stride_um, BLOCK_M, BLOCK_K)
        tl.debug_barrier()  # the residual stored by every thread before any reads it
        _select_group(r_ptr, group_ptr, s_ptr, rank_ptr, gmax_ptr, sk_ptr, si_ptr, g, M, K, n, G, False, False,
                      ROWS, BLOCK_G, LOG_K, LOG_W, INTERP)  # fmt: skip
        tl.debug_barrier()  # S and gmax stored before the rows read them
        j = tl.arange(0, BLOCK_N)
        ch = tl.load(s_ptr + g * n + j, mask=j < n, other=0)
        _residual_run(r_ptr, u_ptr + K, g_ptr + 1, start, end, ch, tl.load(gmax_ptr + g), n, K, stride_um,
                      BLOCK_MR, BLOCK_N)  # fmt: skip
        if g == G - 1:  # the masked rows: this group's channels, their own amax over them (gmax[G])
            _residual_run(r_ptr, u_ptr + K, g_ptr + 1, end, M, ch, tl.load(gmax_ptr + G), n, K, stride_um,
                          BLOCK_MR, BLOCK_N)  # fmt: skip

def rac_operand(
    x: torch.Tensor,
    group: torch.Tensor,
    groups: int,
    out: torch.Tensor,
    *,
    n: int,
    block_m: int | None = None,
    block_k: int | None = None,
    block_mr: int | None = None,
    num_warps: int | None = None,
    sort_run: int | None = None,
    select_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W4A4 + RAC's operand of ``x`` ``[M, K]`` (rows sorted by ``group`` ``[M]`` in ``[0, groups]``) in one launch
    (module docstring): writes ``out`` ``[M, 2, K]`` (slot 0 the exact values of ``QDQ(X)``, slot 1 those of
    ``QDQ(R[:, S])`` scattered, zero outside S) -> ``(g [M, 2] fp32 S_dec, S [groups, n] long)``, the bits of
    ``group_units`` + ``rac_select.rac_units(method="sort")``. Launch options, None: ``tuning.json``
    ``rac_operand.decode`` (``block_m`` rows x ``block_k`` columns per quantize tile, ``block_mr`` rows x n
    gathered channels per residual tile, ``num_warps``; null warps:
    the selection's, KP / 128 within 4..16) and ``rac_select`` for K padded to a power of two (``sort_run``,
    ``select_rows``); the same bits under each."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use quads.quant.factored.operands under the reference backend")
    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError(f"rac_operand needs x with unit stride along K, got strides {x.stride()}")
    if not 0 < n <= k or n % NVFP4_BLOCK or k % NVFP4_BLOCK:
        raise ValueError(f"rac_operand needs K and n multiples of {NVFP4_BLOCK} with 0 < n <= K, got K={k} n={n}")
    kp = triton.next_power_of_2(k)
    if kp > SORT_MAX_K:
        raise ValueError(f"rac_operand sorts K (padded to a power of two) <= {SORT_MAX_K} norms in one program, "
                         f"got K={k}; use factored.operands' launches (method='count')")
    if group.shape != (m,) or groups < 1:
        raise ValueError(f"rac_operand: expected group [{m}] and groups >= 1, got {tuple(group.shape)}, {groups}")
    if out.shape != (m, 2, k) or out.stride(-1) != 1 or out.stride(1) != k:
        raise ValueError(f"rac_operand: out must be [{m}, 2, {k}] with rows of two K-slots, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    cfg = tuning.config("rac_operand", "decode", block_m=block_m, block_k=block_k, block_mr=block_mr,
                        num_warps=num_warps)
    sel = tuning.config("rac_select", tuning.case("rac_select", f"k{kp}", "sort"), sort_run=sort_run,
                        select_rows=select_rows)
    run, rows = sel["sort_run"], sel["select_rows"]
    if run is not None and (run < 2 or run & (run - 1)):
        raise ValueError(f"rac_operand: sort_run must be a power of two >= 2, got {run}")
    log_w = 0 if run is None or run >= kp else (kp // run).bit_length() - 1
    warps = cfg["num_warps"] or max(4, min(16, kp // 128))
    rows = max(1, min(8, 4096 // kp)) if rows is None else rows
    group = group.contiguous()
    r = torch.empty(m, k, dtype=torch.float32, device=x.device)  # the residual, each program's own rows
    g = torch.empty(m, 2, dtype=torch.float32, device=x.device)
    s = torch.empty(groups, n, dtype=torch.long, device=x.device)
    rank = torch.empty(groups, k, dtype=torch.int32, device=x.device)
    gmax = torch.empty(groups + 1, dtype=torch.float32, device=x.device)
    sk = torch.empty(groups, kp, dtype=torch.long, device=x.device) if log_w else gmax  # the merge's scratch
    si = torch.empty(groups, kp, dtype=torch.int32, device=x.device) if log_w else gmax
    check_residual(r, n, "rac_operand")
    _rac_operand_kernel[(groups,)](
        x, group, out, g, r, s, rank, gmax, sk, si, m, k, n, groups, x.stride(0), out.stride(0),
        BLOCK_M=cfg["block_m"], BLOCK_K=min(cfg["block_k"], kp), ROWS=rows,
        BLOCK_G=min(2048, triton.next_power_of_2(max(m, 1))), LOG_K=kp.bit_length() - 1, LOG_W=log_w,
        BLOCK_N=max(NVFP4_BLOCK, triton.next_power_of_2(n)), BLOCK_MR=cfg["block_mr"], INTERP=interpreted(x),
        num_warps=warps, **EXACT,
    )  # fmt: skip
    return g, s


# ------------------------------------------------------------------------------- as a custom op
# The compiled decode step sees it as one opaque op writing ``out`` (see factored_quant's custom ops).


@torch.library.custom_op("quads::rac_operand", mutates_args=("out",))
def _rac_operand_op(x: torch.Tensor, group: torch.Tensor, groups: int, out: torch.Tensor,
                    n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rac_operand(x, group, groups, out, n=n)


@_rac_operand_op.register_fake
def _(x, group, groups, out, n):
    return x.new_empty((x.shape[0], 2), dtype=torch.float32), x.new_empty((groups, n), dtype=torch.long)


def rac_operand_op(x: torch.Tensor, group: torch.Tensor, groups: int, out: torch.Tensor, *, n: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rac_operand`` as the custom op ``quads::rac_operand`` -> ``(g [M, 2], S [groups, n])``."""
    return torch.ops.quads.rac_operand(x, group, groups, out, n)


ENABLED = bool(tuning.config("rac_operand", "decode")["enabled"])  # read once: the compiled step traces enabled()


def enabled(k: int) -> bool:
    """Whether ``factored.operands`` takes the one-launch operand for K channels: ``tuning.json``
    ``rac_operand.decode.enabled`` (``ENABLED``) and K padded to a power of two <= ``SORT_MAX_K``."""
    return ENABLED and 1 << max(k - 1, 0).bit_length() <= SORT_MAX_K
