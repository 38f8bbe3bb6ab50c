"""W4A4 (+RAC) as GEMMs of exact NVFP4 values, the FP32 global scales applied to the output.

An NVFP4 activation element dequantizes to ``(e2m1 * s) * g`` in fp32 (``quads.formats.nvfp4``):
``u = e2m1 * s`` (E2M1 times its E4M3 block scale) has at most 6 significant bits and lies in
``[2^-10, 2688]``, so it is exact in BF16, FP16 and FP32; ``g`` (S_dec) is one FP32 factor per row.
The weight operand is the stored ``QDQ(W)`` in the recipe's ``weight_dtype`` (the tensor the trainer's
QDQ(W) equals bit for bit), used as is. So for a row ``t`` of the activation

    y[t] = g_x[t] * (U_x @ Wq.T)[t]  +  g_r[t] * (U_r @ Wq.T)[t]          (RAC term only with |S| > 0)

with ``U_x`` ``[M, K]`` the exact values of ``QDQ(X)`` and ``U_r`` ``[M, K]`` those of the residual
``QDQ(R[:, S])`` scattered back to their channels (zero outside S, so no weight column is gathered and
K is not widened). Both products are one GEMM: the rows are stacked ``[M, 2, K]`` (a row's activation,
then its residual), so a group of rows stays contiguous and the weight is read once.

Against the fp32 emulation (``w4a4.rac_gemm_operands`` + ``ops.lowp_matmul``, and
``grouped.grouped_linear``), which multiplies the fp32 products ``fl(u * g)`` over K + |S| columns:
every quantized operand is bit-identical (codes, block scales, global scales, S), and each product
``u * w`` is exact in the fp32 accumulator here, where the emulation rounds ``u * g`` first. The two
differ by fp32 accumulation order and that rounding (both within ``gamma_K`` of the fp64 value, see
tests/test_quant_factored.py), plus, on CUDA, the BF16 rounding of each GEMM output (``torch._grouped_mm``
and cuBLAS write BF16) before the fp32 scale: one extra relative 2^-8 (BF16's unit roundoff) per term.

GEMM dtype (``gemm_dtype``): the weight operand's dtype on CUDA when it is BF16 (tensor cores; the
operands are exact there); FP32 otherwise (the CPU, whose BF16 GEMM may be a slow fallback, and FP32
weights), with the same exact operand values and an FP32 output.

Weight operand (``Weight``, ``gemm``): either ``QDQ(W)`` as a tensor (GEMM: ``F.linear`` for one weight,
``moe.grouped_mm`` / ``torch._grouped_mm`` for an expert stack), or, on the rollout side on a Triton
device (``quads.quant.layers.WeightStore``), the packed NVFP4 weight ``w4a16.W4A16Weight`` alone, with no
BF16 copy (GEMM: the packed W4A16 kernels, ``w4a16.linear_op`` / ``w4a16.grouped_op`` over the stacked
rows with the stacked routes' ``ends``; the operands are then BF16 wherever they run, Triton's
interpreter on the CPU included). Numerics contract of the packed operand: the kernels decode each
weight to ``bf16(fp32(e2m1 * s) * S_dec)``, the BF16 ``QDQ(W)`` the tensor path reads, bit for bit
(``w4a16.dequantize(pack(q))`` equals ``nvfp4.dequantize(q, bf16)``), and multiply it with the same
exact ``u`` with fp32 accumulation and a BF16 output, like ``torch._grouped_mm`` / cuBLAS. So on CUDA the
output differs from the BF16 tensor path only by the fp32 summation order inside each GEMM (split-K
partials included); against the fp32 GEMM (the CPU's tensor path) add the BF16 rounding of each GEMM
output (2^-8 relative per term, as above). tests/test_quant_factored.py checks both bounds.

Groups (``Segments``): rows that share an activation global scale and a RAC channel set: one group
for a dense linear, one per expert for the sorted rows of a MoE layer (``quads.model.moe.static_routes``:
row ``i`` belongs to expert ``expert[i]``, masked slots to the extra group E). Every per-group reduction
(amax, residual norms) is a masked reduction over a fixed ``[G+1, M]`` membership matrix: no host sync,
static shapes, so the path is CUDA-graph capturable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quads.formats import nvfp4
from quads.kernels import dispatch, w4a16
from quads.kernels.rac_select import RacMethod
from quads.model import moe


@dataclass
class Segments:
    """Row groups: ``group`` ``[M]`` long in ``[0, G]`` (G: rows of no group), sorted ascending (each group
    one contiguous run of rows, as ``moe.static_routes`` orders them; the fused RAC kernels,
    ``quads.kernels.rac_select``, and ``group_units`` rely on it), ``hits`` ``[G+1, M]`` bool (``hits[g, i]``:
    row i is in group g); ``groups`` = G; ``offsets`` ``[G+1]``: the first row of each group and of the rows of
    no group when the caller has them (``moe.StaticRoutes.offsets``; ``row_offsets`` counts them otherwise).
    ``group=None``: all rows one group."""

    group: torch.Tensor | None
    hits: torch.Tensor | None
    groups: int
    members: torch.Tensor | None = None  # hits[:G] in fp64 (the per-group sum as a GEMM)
    offsets: torch.Tensor | None = None

    @staticmethod
    def of(group: torch.Tensor | None, groups: int = 1, offsets: torch.Tensor | None = None) -> Segments:
        """``offsets``: the groups' first rows when the caller has them (the routes' offsets)."""
        if group is None:
            return Segments(None, None, 1)
        if offsets is not None and offsets.shape != (groups + 1,):
            raise ValueError(f"Segments: expected offsets [{groups + 1}], got {tuple(offsets.shape)}")
        hits = torch.arange(groups + 1, device=group.device)[:, None] == group[None, :]
        return Segments(group, hits, groups, hits[:groups].double(), offsets)

    def row_offsets(self) -> torch.Tensor:
        """``[G+1]``: the first row of each group and of the rows of no group (the given ``offsets``, else
        counted)."""
        return self.offsets if self.offsets is not None else F.pad(self.counts().cumsum(0), (1, 0))

    def row_max(self, v: torch.Tensor) -> torch.Tensor:
        """``v`` ``[M]`` (>= 0) -> the max over each row's group, per row ``[M]`` (exact: a max)."""
        if self.group is None:
            return v.amax().expand(v.shape[0])
        per_group = torch.where(self.hits, v[None, :], 0.0).amax(dim=1)  # [G+1]
        return per_group[self.group]

    def sq_norms(self, r: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """``sum over a group's rows of r^2`` in fp64, ``[G, K]`` (``rac.residual_norms`` per group; the
        squares of fp32 values are exact in fp64, so only the fp64 summation order differs). A NaN or inf
        square reaches its own group's norm only (in the GEMM, ``0 * inf`` would make every group's NaN).
        ``counts``: the groups' row counts (rows sorted by group, known on the host): each group's norms are
        then its own rows' ``sum(dim=0)``, the order of one group alone, so the groups' operands equal those
        of one ``operands`` call per group bit for bit (the CPU experts loop, ``QuantizedExperts``)."""
        sq = r.double().square()
        if self.group is None:
            return sq.sum(dim=0, keepdim=True)
        if counts is not None:
            if len(counts) != self.groups or sum(counts) > sq.shape[0]:
                raise ValueError(f"sq_norms: counts {counts} do not cover {self.groups} groups of {sq.shape[0]} rows")
            return torch.cat([part.sum(dim=0, keepdim=True) for part in sq[: sum(counts)].split(counts)])
        norms = self.members @ torch.where(sq.isfinite(), sq, 0.0)  # a GEMM: deterministic, no atomics
        norms = torch.where(self.members @ sq.isinf().double() > 0, torch.inf, norms)
        return torch.where(self.members @ sq.isnan().double() > 0, torch.nan, norms)

    def counts(self) -> torch.Tensor:
        """Rows per group ``[G]``."""
        if self.hits is None:
            raise ValueError("counts needs explicit groups")
        return self.hits[: self.groups].sum(dim=1)


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring ``max |x|`` of each row of ``x`` ``[M, K]`` -> fp32 ``[M]``: Triton on CUDA, ATen ops under
    ``torch.compile`` (Inductor can compute them in the kernel that makes ``x``, where the custom op would be a
    launch of its own; a max, so the same bits)."""
    if dispatch.use_triton(x) and not torch.compiler.is_compiling():
        from quads.kernels.factored_quant import row_amax_op

        return row_amax_op(x)
    return nvfp4.nan_ignoring_amax(x.float(), dim=-1).squeeze(-1)


def units(
    x: torch.Tensor, amax: torch.Tensor, out: torch.Tensor, slot: int, *, index: torch.Tensor | None = None,
    residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(g, r)``: writes the exact values ``e2m1 * s`` of NVFP4(``x`` ``[M, K]``) with amax ``[M]`` per row
    into ``out[:, slot]`` (``out`` ``[M, P, K]``, the stacked operand, in the GEMM dtype); returns S_dec
    ``[M]`` and the residual ``x - u * S_dec`` fp32 (``residual``, else None). ``index`` ``[M, n]``:
    quantize the gathered ``x[i, index[i]]`` and scatter ``u`` back (the slot must be zero-filled). One
    Triton kernel on CUDA (``quads.kernels.factored_quant``, a custom op, no host sync), its twin elsewhere."""
    from quads.kernels import factored_quant

    if dispatch.use_triton(x):
        return factored_quant.units_op(x, amax, out, slot, index=index, residual=residual)
    _, g, r = factored_quant.quantize_units_reference(x, amax, dtype=out.dtype, index=index, residual=residual,
                                                      out=out[:, slot])
    return g, r


Weight = torch.Tensor | w4a16.W4A16Weight  # the weight operand: QDQ(W), or its packed NVFP4 form


def gemm_dtype(w_q: Weight) -> torch.dtype:
    """The dtype of the factored GEMM's operands (see the module docstring)."""
    if isinstance(w_q, w4a16.W4A16Weight):
        return torch.bfloat16
    return torch.bfloat16 if (w_q.is_cuda and w_q.dtype == torch.bfloat16) else torch.float32


def gemm(u: torch.Tensor, w_q: Weight, routes: moe.StaticRoutes | None = None) -> torch.Tensor:
    """The GEMM of the stacked exact values ``u`` ``[R, K]`` (in ``gemm_dtype(w_q)``) with the weight operand
    -> ``[R, N]`` in ``u.dtype``: one weight ``[N, K]`` (``routes`` None), or an expert stack ``[E, N, K]``
    over rows sorted by expert (``routes``: their ``grouped.stacked_routes``; zero rows past the last
    expert's end). A packed weight runs the W4A16 kernels (module docstring)."""
    if isinstance(w_q, w4a16.W4A16Weight):
        return w4a16.linear_op(u, w_q) if routes is None else w4a16.grouped_op(u, w_q, routes.ends)
    w = w_q.to(u.dtype)
    return F.linear(u, w) if routes is None else moe.grouped_mm(u, w, routes)


def dense_weight(w_q: Weight) -> torch.Tensor:
    """The weight operand as a tensor: ``w_q`` itself, or the BF16 ``QDQ(W)`` decoded from the packed bytes."""
    return w4a16.dequantize(w_q) if isinstance(w_q, w4a16.W4A16Weight) else w_q


@dataclass
class Operands:
    """The factored activation operands of ``M`` rows: ``u`` ``[M, P, K]`` exact values in the GEMM
    dtype (P = 1: ``QDQ(X)``; P = 2 with RAC: then the residual scattered to K), ``g`` ``[M, P]`` fp32
    global decode scales, ``channels`` ``[G, |S|]`` the RAC channel sets (None without RAC)."""

    u: torch.Tensor
    g: torch.Tensor
    channels: torch.Tensor | None

    def dequantized(self) -> torch.Tensor:
        """``QDQ(X)`` plus the scattered ``QDQ(R[:, S])``, fp32 ``[M, K]`` (the STE point; the same fp32
        values as the emulation's ``(e2m1 * s) * g``)."""
        return (self.u.float() * self.g[..., None]).sum(dim=1)


def operands(
    x: torch.Tensor,
    segs: Segments,
    *,
    n: int,
    dtype: torch.dtype,
    per_token: bool = False,
    selection: str = "dynamic",
    static_order: torch.Tensor | None = None,
    observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    fused_rac: bool = True,
    rac_method: RacMethod | None = None,
    fused_amax: bool = True,
    counts: list[int] | None = None,
    operand_backend: str | None = None,
) -> Operands:
    """The factored W4A4 (+RAC with ``n`` = |S| channels) operands of ``x`` ``[M, K]`` (canonical NVFP4).

    Global scales: per group (``per_token=False``: the amax over the group's rows, as the expert loop
    quantizes each expert's tokens as one tensor) or per row. The rows of no group (group G: the masked
    slots of a fixed-slot decode, which the expert loop never sees) are zero rows: u = 0 and S_dec = 1 in
    both terms (R = 0), whatever ``x`` holds there, so no kernel has to walk them and their outputs are
    zero. RAC (``quads.quant.rac``): ``R = X - QDQ(X)`` in fp32; ``S`` per group: the ``n`` channels of
    largest ``sum R^2`` over the group's rows (fp64, stable descending sort), or ``static_order[g, :n]``;
    ``R[:, S]`` in selection order is quantized with its own global scale (per group over the gathered
    residual, or per row). ``observe(r, norms)``: the residual ``[M, K]`` and its per-group norms ``[G, K]``
    (static-order calibration).
    On Triton, dynamic selection without ``observe`` runs the residual operand as the custom op
    ``quads::rac_units`` (``quads.kernels.rac_select``: two or three kernels, the same bits as the steps
    below; ``rac_method``: its selection algorithm, ``sort`` / ``count``, None for its default;
    ``fused_rac=False`` runs the steps instead, for benchmarks and tests); static selection runs it as
    ``quads::rac_static_units`` (two launches, no sort; the same bits as the steps), its ``observe`` given
    the norms of ``quads::rac_group_norms`` (row by row in fp64: the GEMM's values up to summation order).
    The activation operand of rows
    in groups (``per_token=False``) with few rows per group (the decode step) is ``quads::group_units``
    (one launch after ``row_amax``: each program takes its rows' group amaxes from their groups' row maxima,
    ``segs.row_offsets()``; ``fused_amax=False``: ``row_amax``, ``Segments.row_max`` and ``units``, the same bits). ``counts``: the groups' row counts on the host (rows
    sorted by group), for the steps' norms (``Segments.sq_norms``): then every group's operands are those of
    an ``operands`` call of its rows alone, bit for bit. Where ``group_units`` and ``rac_units`` would run (dynamic
    selection, no ``observe``), the whole operand may run as one CUDA launch instead, ``quads::rac_operand``
    (``quads.kernels.rac_operand_cuda``: the same bits; ``operand_backend`` ``launches`` / ``cuda``, None for
    ``tuning.json``'s ``rac_operand.decode``).
    """
    if selection not in ("dynamic", "static"):
        raise ValueError(f"unknown RAC selection {selection!r}; valid: dynamic, static")
    need_r = n > 0 or observe is not None
    buf = torch.empty(x.shape[0], 2 if n else 1, x.shape[1], dtype=dtype, device=x.device)  # [M, P, K]
    fused = fused_amax and _group_units(x, segs, per_token)
    if fused and n and fused_rac and selection == "dynamic" and observe is None and x.is_cuda:
        from quads.kernels import rac_operand_cuda

        warps = rac_operand_cuda.plan(x, dtype, backend=operand_backend)
        if warps is not None:  # the whole operand in one launch
            from quads.kernels.factored_quant import rac_operand_op

            g, s = rac_operand_op(x, segs.row_offsets(), segs.groups, buf, n=n, warps=warps)
            return Operands(buf, g, s)
    if segs.group is not None and not fused and (counts is None or sum(counts) < x.shape[0]):
        x = torch.where((segs.group < segs.groups)[:, None], x, 0.0)  # the rows of no group: zero operands
        # (group_units reads them as zeros itself; host-known counts covering every row: there are none)
    amax = row_amax(x)
    if fused:  # the group amaxes inside the quantize (decode)
        from quads.kernels.factored_quant import group_units_op

        gx, r = group_units_op(x, amax, segs.group, segs.row_offsets(), segs.groups, buf, 0, residual=need_r)
    else:
        gx, r = units(x, amax if per_token else segs.row_max(amax), buf, 0, residual=need_r)
    if not need_r:
        return Operands(buf, gx[:, None], None)
    if n and fused_rac and selection == "dynamic" and observe is None and dispatch.use_triton(r):
        from quads.kernels.factored_quant import rac_units_op  # the fused twin of the steps below

        gr, s = rac_units_op(r, segs.group, segs.groups, buf, 1, n=n, per_token=per_token, method=rac_method)
        return Operands(buf, torch.stack([gx, gr], dim=1), s)
    if n and fused_rac and selection == "static" and dispatch.use_triton(r):
        from quads.kernels.factored_quant import (  # the steps' fused twin
            rac_group_norms_op,
            rac_static_units_op,
        )

        s = _static_channels(static_order, n, x.device, full=True)
        if observe is not None:  # the statistics of the next calibration (norms up to fp64 summation order)
            observe(r, rac_group_norms_op(r, segs.group, segs.groups))
        gr = rac_static_units_op(r, segs.group, segs.groups, s, buf, 1, n=n, per_token=per_token)
        return Operands(buf, torch.stack([gx, gr], dim=1), s[:, :n])
    norms = segs.sq_norms(r, counts) if selection == "dynamic" or observe is not None else None
    if observe is not None:
        observe(r, norms)
    if n == 0:
        return Operands(buf, gx[:, None], None)
    if selection == "dynamic":
        s = torch.argsort(norms, dim=-1, descending=True, stable=True)[:, :n]  # [G, n]
    else:
        s = _static_channels(static_order, n, x.device)
    s_rows = s.expand(x.shape[0], n) if segs.group is None else s[segs.group.clamp_max(segs.groups - 1)]
    ra = row_amax(r.gather(1, s_rows))  # [M] amax of R[:, S] of each row's group, per row
    buf[:, 1].zero_()  # the residual's values, scattered: zero outside S
    gr, _ = units(r, ra if per_token else segs.row_max(ra), buf, 1, index=s_rows)
    return Operands(buf, torch.stack([gx, gr], dim=1), s)


def _static_channels(static_order: torch.Tensor | None, n: int, device: torch.device, full: bool = False
                     ) -> torch.Tensor:
    """The calibrated orders ``[G, n]`` long (``full``: all their channels, ``[G, >= n]``); a clear error if
    there are none or too few."""
    if static_order is None or static_order.shape[-1] < n:
        got = None if static_order is None else tuple(static_order.shape)
        raise ValueError(f"static RAC selection needs a channel order of at least {n} channels per group, "
                         f"got shape {got}; pass the selector's orders (StaticChannelSelector) or use "
                         "selection='dynamic'")
    s = static_order.reshape(-1, static_order.shape[-1]).to(device=device, dtype=torch.long)
    return s if full else s[:, :n]


def _group_units(x: torch.Tensor, segs: Segments, per_token: bool) -> bool:
    """Whether ``operands`` quantizes ``x`` with ``group_units`` (few rows per group; shapes only)."""
    from quads.kernels.factored_quant import GROUP_UNITS_MAX_ROWS

    return (not per_token and segs.group is not None and x.shape[0] <= GROUP_UNITS_MAX_ROWS * segs.groups
            and dispatch.use_triton(x))


def product(u: torch.Tensor, g: torch.Tensor, w_q: Weight) -> torch.Tensor:
    """fp32 ``[M, N]``: the stacked exact values ``u`` ``[M, P, K]`` with their scales ``g`` ``[M, P]`` (an
    ``Operands``' ``u`` and ``g``, or a group's rows of them) times one weight operand ``[N, K]``."""
    m, p, k = u.shape
    return scale_output(gemm(u.reshape(m * p, k), w_q).view(m, p, -1), g)


def scale_output(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``y`` ``[M, P, N]`` (the GEMM of each stacked operand) -> ``sum_p g[:, p] * y[:, p]`` fp32 ``[M, N]``."""
    return (y.float() * g[..., None]).sum(dim=1)  # P <= 2 terms: (0 +) a + b, one rounding
