"""All experts of a MoE layer in one batched GEMM per projection (the rollout side's expert path).

The experts loop (``QuantizedExperts`` on the trainer side, the vLLM method) runs one GEMM pair per
expert hit, with every quantizer called once per expert: at decode, with 32 experts and a few tokens
each, that is thousands of tiny kernel launches per layer, and the launches, not the math, set the
rollout's speed. Here the tokens routed to each expert are gathered into a zero-padded block

    X_pad [E, C, K]   (C = the largest number of tokens routed to one expert; rows past an expert's
                       count are zero)

and each projection is one batched operation over E: the activation quantizer runs once with a
per-expert amax ``[E, 1, 1]`` (or per token), RAC selects ``S_e`` per expert from the per-expert
residual norms ``[E, K]``, and the GEMM is one ``bmm`` over ``[E, C, K + |S|] x [E, K + |S|, N]``.

What stays identical to the loop, bit for bit: every quantized operand (codes, E4M3 block scales and
FP32 global scales: zero rows change neither an amax nor a residual norm), the channel sets S_e (up
to fp64 summation order of the norms, which can only matter for exact ties), and the order in which a
token's k expert outputs are summed (ascending expert id, in the compute dtype). What differs: the
fp32 accumulation order inside the GEMM (``bmm`` vs ``mm``), so outputs agree to accumulation-order
tolerance, as the kernel backends do (``quads.kernels.dispatch``).

Used when the padding is cheap (``E * C <= pad_limit * slots``) and the spec is one this module
implements (canonical NVFP4 mode; FP8 with per-token or 1x128-block activation scales); otherwise
the caller keeps its loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quads.formats import nvfp4
from quads.kernels import dispatch
from quads.model import gemm, moe
from quads.quant import factored, ops
from quads.quant.amplify import amplify, amplify_weight
from quads.quant.rac import rac_channels, residual_norms
from quads.quant.recipe import LinearSpec


@dataclass
class SlotOrder:
    """The ``T * k`` routing slots of ``top_k_index`` ``[T, k]`` sorted by expert with a stable sort.

    ``order`` ``[T*k]``: the flat slot index at each sorted position (token order within an expert;
    masked slots, expert id ``E``, sort last); ``counts`` ``[E]``: slots per expert. The one sort that
    both expert paths (the loop, ``quads.quant.layers.expert_groups``, and the padded layout below)
    read, so they visit tokens identically.
    """

    order: torch.Tensor
    counts: torch.Tensor
    k: int


def sort_slots(top_k_index: torch.Tensor, n_experts: int) -> SlotOrder:
    """Sort the slots of ``top_k_index`` ``[T, k]`` (ids in ``[0, E]``, ``E`` = masked) by expert."""
    flat = top_k_index.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts]
    return SlotOrder(order=order, counts=counts, k=top_k_index.shape[-1])


@dataclass
class ExpertLayout:
    """Where each routing slot sits in the padded block.

    ``expert`` / ``pos`` / ``tok``: ``[S]`` long over the valid slots, grouped by expert (token order
    within an expert), so ``X_pad[expert, pos] = x[tok]``; ``counts`` ``[E]`` long; ``capacity`` = C;
    ``slot_rank`` ``[T, k]``: for token t and its j-th expert in ascending id order, the index of that
    slot in the grouped order (``-1`` for a masked slot, expert id ``E``).
    """

    expert: torch.Tensor
    pos: torch.Tensor
    tok: torch.Tensor
    counts: torch.Tensor
    capacity: int
    slot_rank: torch.Tensor
    weights: torch.Tensor  # [S] router weight of each grouped slot


def expert_layout(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_experts: int,
                  slots: SlotOrder | None = None) -> ExpertLayout:
    """The padded layout of the routing ``top_k_index`` ``[T, k]`` (``slots``: its ``sort_slots``)."""
    T, k = top_k_index.shape
    slots = slots if slots is not None else sort_slots(top_k_index, n_experts)
    counts = slots.counts
    n_valid, capacity = torch.stack([counts.sum(), counts.max()]).tolist()  # the one host sync: sizes
    starts = torch.cumsum(counts, 0) - counts
    valid = slots.order[:n_valid]  # masked slots (id E) sort last
    expert = top_k_index.reshape(-1)[valid].long()
    pos = torch.arange(n_valid, device=valid.device) - starts[expert]
    rank_of_flat = torch.full((T * k,), -1, dtype=torch.long, device=valid.device)
    rank_of_flat[valid] = torch.arange(n_valid, device=valid.device)
    perm = torch.argsort(top_k_index.long(), dim=-1, stable=True)  # each token's slots by expert id
    slot_rank = rank_of_flat.view(T, k).gather(1, perm)
    return ExpertLayout(expert=expert, pos=pos, tok=valid // k, counts=counts, capacity=capacity,
                        slot_rank=slot_rank, weights=top_k_weights.reshape(-1)[valid])


def worth_padding(layout: ExpertLayout, n_experts: int, pad_limit: float) -> bool:
    """Whether the padded block holds at most ``pad_limit`` times the real rows (or is tiny anyway)."""
    rows = n_experts * layout.capacity
    return rows <= max(pad_limit * layout.expert.numel(), 4 * n_experts)


def supports(spec: LinearSpec) -> bool:
    """Whether ``grouped_linear`` implements ``spec`` (else the caller loops over experts)."""
    if spec.act == "nvfp4" or spec.weight == "nvfp4":
        if spec.nvfp4_mode != "te":
            return False
    if spec.act == "fp8" and spec.fp8_scheme == "tensor":
        return False  # one scale per expert's activation tensor: not implemented batched
    return True


def pad_rows(x: torch.Tensor, layout: ExpertLayout, n_experts: int) -> torch.Tensor:
    """``x`` ``[T, K]`` -> ``X_pad`` ``[E, C, K]`` (zero rows past each expert's count)."""
    out = x.new_zeros(n_experts, layout.capacity, x.shape[-1])
    out[layout.expert, layout.pos] = x[layout.tok]
    return out


def combine(y_pad: torch.Tensor, layout: ExpertLayout, T: int, dtype: torch.dtype) -> torch.Tensor:
    """``y_pad`` ``[E, C, H]`` -> ``out`` ``[T, H]``: each token's weighted expert outputs summed in
    ascending expert order in ``dtype`` (the loop's ``out[idx] += y * w`` order, bit for bit)."""
    y = y_pad[layout.expert, layout.pos]  # [S, H]
    contrib = (y * layout.weights[:, None].to(y.dtype)).to(dtype)
    contrib = torch.cat([contrib, contrib.new_zeros(1, contrib.shape[1])])  # row S: a masked slot's zero
    rank = torch.where(layout.slot_rank >= 0, layout.slot_rank, contrib.shape[0] - 1)
    parts = contrib[rank]  # [T, k, H]
    out = torch.zeros(T, y_pad.shape[-1], dtype=dtype, device=y_pad.device)
    for j in range(parts.shape[1]):
        out = out + parts[:, j]
    return out


@torch.library.custom_op("quads::grouped_nvfp4_qdq", mutates_args=())
def _nvfp4_qdq(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """QDQ of ``x`` ``[E, C, K]`` fp32: global scale per expert (or per row), as the loop quantizes each
    expert's ``[c_e, K]`` block on its own.

    The amax is measured here (never NaN or negative), so on the Triton path it goes straight to the
    kernel: ``dispatch``'s validation of a caller's amax costs two host syncs per call. One opaque op
    (``torch.library.custom_op``), so that a compiled decode step (``quads.rollout.decode``) runs it
    without tracing the launchers' Python or the reference's checks, which would break the graph.
    """
    if per_token:
        return ops.nvfp4_qdq(x, per_token=True)
    amax = nvfp4.nan_ignoring_amax(x, dim=(1, 2))  # [E, 1, 1], what nvfp4.quantize measures per expert
    if dispatch.use_triton(x):
        from quads.kernels.nvfp4_quant import nvfp4_quantize

        return dispatch.nvfp4_dequantize(nvfp4_quantize(x, amax=amax), x.dtype)
    return ops.nvfp4_qdq(x, amax=amax)


@_nvfp4_qdq.register_fake
def _(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    return torch.empty_like(x)


def grouped_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_q: torch.Tensor,
    spec: LinearSpec,
    *,
    static_order: torch.Tensor | None = None,
    observe: Callable[[torch.Tensor], None] | None = None,
    w_amp: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[E, C, K]`` times each expert's weight -> ``[E, C, N]`` in ``x.dtype``, under ``spec``.

    ``w``: the master stack ``[E, N, K]``; ``w_q``: its operand (``quantize_weight``). ``static_order``
    ``[E, >= |S|]``: calibrated RAC orders (``selection="static"``); ``observe(R [E, C, K])``: RAC
    calibration statistics. Numerics: see the module docstring. A spec with ``error_scale != 1`` (the
    mismatch amplifier) runs ``quads.quant.amplify``'s operands batched (``w_amp``: the amplified
    weight operand ``amplify_weight(w, w_q, alpha)`` if the caller keeps it, else formed here).
    """
    if spec.is_identity:
        return gemm.bmm(x, w.to(x.dtype).mT)
    alpha = spec.error_scale
    if alpha != 1.0:
        w_op = w_amp if w_amp is not None else amplify_weight(w, w_q, spec)
    if spec.act == "none":
        if alpha != 1.0:
            return torch.bmm(x.float(), w_op.mT).to(x.dtype)
        return gemm.bmm(x, w_q.to(x.dtype).mT)
    xf = x.float()
    if spec.act == "fp8":
        x_op = ops.fp8_act_qdq(xf.reshape(-1, xf.shape[-1]), spec.fp8_scheme).reshape(xf.shape)
        if alpha != 1.0:
            return torch.bmm(amplify(xf, x_op, alpha), w_op.mT).to(x.dtype)
        return torch.bmm(x_op, w_q.float().mT).to(x.dtype)
    E, C, K = xf.shape
    per_token = spec.act_scale == "token"
    ops.check_k(K, "NVFP4 activation")
    xq = _nvfp4_qdq(xf, per_token)
    n = rac_channels(K, spec.rac_ratio)
    rq = s = None
    if n or observe is not None:
        r = xf - xq
        if observe is not None:
            observe(r)
        if n:
            if spec.rac_selection == "dynamic":
                s = torch.argsort(residual_norms(r), dim=-1, descending=True, stable=True)[:, :n]  # [E, K] scores
            else:
                if static_order is None or static_order.shape[-1] < n:
                    raise ValueError(f"static RAC selection needs orders of at least {n} channels per expert")
                s = static_order[:, :n].to(device=x.device, dtype=torch.long)
            rq = _nvfp4_qdq(r.gather(2, s[:, None, :].expand(E, C, n)), per_token)  # own global scale
    if alpha != 1.0:  # [x + alpha (Xq - x) | alpha Rq_S] x [W_alpha | W_alpha[:, S]]
        xq, rq, w_q = amplify(xf, xq, alpha), None if rq is None else alpha * rq, w_op
    a, b = xq, w_q.float()
    if s is not None:
        a = torch.cat([xq, rq], dim=2)
        b = torch.cat([w_q, w_q.gather(2, s[:, None, :].expand(E, w_q.shape[1], n))], dim=2).float()
    return torch.bmm(a, b.mT).to(x.dtype)


def stacked_routes(routes: moe.StaticRoutes, p: int) -> moe.StaticRoutes:
    """The routes of the rows of ``[M, p, K]`` viewed as ``[M * p, K]``: sorted row ``i``'s ``p`` stacked
    operands become rows ``i * p .. i * p + p - 1``, so each expert's rows stay contiguous (offsets x p)."""
    if p == 1:
        return routes
    j = torch.arange(p, device=routes.pos.device)
    return moe.StaticRoutes(order=routes.order, slot_pos=routes.slot_pos, expert=routes.expert[:, None].expand(-1, p).reshape(-1),
                            offsets=routes.offsets * p, pos=(routes.pos[:, None] * p + j).reshape(-1),
                            capacity=routes.capacity * p, n_experts=routes.n_experts, ends=routes.ends * p,
                            token_slots=routes.token_slots)


def sorted_linear(
    xs: torch.Tensor,
    routes: moe.StaticRoutes,
    w_q: factored.Weight,
    spec: LinearSpec,
    *,
    segs: factored.Segments | None = None,
    stacked: moe.StaticRoutes | None = None,
    static_order: torch.Tensor | None = None,
    observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """W4A4 (+RAC) of the sorted rows ``xs`` ``[M, K]`` (``moe.static_routes`` order) with each row's
    expert weight ``w_q`` ``[E, N, K]`` -> ``[M, N]`` in ``xs.dtype``; zero rows at masked slots; no host
    sync, no padding.

    The factored form of ``quads.quant.factored``: NVFP4 global scales per expert (the amax over the
    expert's rows, or per row with ``act_scale="token"``), RAC channel sets per expert, one grouped
    GEMM (``factored.gemm``) over the stacked ``[activation | residual]`` rows of every expert, the
    fp32 global scales applied to its output. ``w_q`` is the stored weight operand: a tensor, used in
    ``factored.gemm_dtype(w_q)`` (pass its fp32 copy on the CPU to avoid a conversion per call) by
    ``moe.grouped_mm``, or the packed ``w4a16.W4A16Weight`` (the grouped W4A16 kernel, same operand values).
    ``segs``: the experts as row groups (``factored.Segments.of(routes.expert, E, routes.offsets)``; built here when
    None); ``stacked``: ``stacked_routes(routes, P)`` for the spec's P (1, or 2 with RAC; built here when
    None; a caller running several projections builds it once); ``static_order`` ``[E, >= |S|]``;
    ``observe(r, norms)``: see ``factored.operands``.
    """
    if spec.act != "nvfp4" or spec.nvfp4_mode != "te":
        raise ValueError(f"sorted_linear computes canonical NVFP4 activations, got spec {spec.describe()} "
                         f"(mode {spec.nvfp4_mode!r}); use grouped_linear on the padded layout")
    ops.check_k(xs.shape[-1], "NVFP4 activation")
    E = routes.n_experts
    segs = segs if segs is not None else factored.Segments.of(routes.expert, E, routes.offsets)
    dtype = factored.gemm_dtype(w_q)
    op = factored.operands(xs, segs, n=rac_channels(xs.shape[-1], spec.rac_ratio), dtype=dtype,
                           per_token=spec.act_scale == "token", selection=spec.rac_selection,
                           static_order=static_order, observe=observe)
    M, P, K = op.u.shape
    stacked = stacked if stacked is not None else stacked_routes(routes, P)
    if stacked.offsets.shape != routes.offsets.shape or stacked.expert.shape[0] != M * P:
        raise ValueError(f"sorted_linear: stacked routes for {stacked.expert.shape[0]} rows, the operands have "
                         f"{M} x {P}; pass stacked_routes(routes, {P})")
    y = factored.gemm(op.u.reshape(M * P, K), w_q, stacked)  # [M*P, N]
    return factored.scale_output(y.view(M, P, -1), op.g).to(xs.dtype)
