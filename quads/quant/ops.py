"""The one place where quantized layers call the number formats and the emulated low-precision GEMM.

Every layer in ``quads.quant`` goes through these functions, so a kernel backend (Triton on CUDA)
is inserted here and nowhere else; each function's pure-PyTorch body is the reference it must match.

Shapes: weights ``[N, K]`` or expert stacks ``[E, N, K]``; activations ``[T, K]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quads.formats import fp8, nvfp4
from quads.formats.constants import FP8_ACT_BLOCK, FP8_WEIGHT_BLOCK, NVFP4_BLOCK
from quads.kernels import dispatch
from quads.quant.recipe import LinearSpec


def check_k(k: int, what: str) -> None:
    """NVFP4 blocks need K % 16 == 0; say how to fix it otherwise."""
    if k % NVFP4_BLOCK:
        raise ValueError(
            f"{what}: in_features (K) must be a multiple of {NVFP4_BLOCK} for NVFP4, got K={k}; "
            "pad the layer or drop it from the recipe's targets"
        )


# ----------------------------------------------------------------------------------------------- NVFP4


def nvfp4_quantize(x: torch.Tensor, **opts) -> nvfp4.NVFP4Tensor:
    """``nvfp4.quantize`` (dispatch point: Triton on CUDA, bit-exact; see ``quads.kernels.dispatch``)."""
    return dispatch.nvfp4_quantize(x, **opts)


def nvfp4_dequantize(q: nvfp4.NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``nvfp4.dequantize`` (dispatch point: Triton on CUDA, bit-exact)."""
    return dispatch.nvfp4_dequantize(q, dtype)


def nvfp4_qdq(x: torch.Tensor, dtype: torch.dtype | None = None, **opts) -> torch.Tensor:
    """Quantize-dequantize, result in ``dtype`` (default ``x.dtype``); canonical mode without Triton: the
    fused ``nvfp4.qdq`` (the same bits, no codes materialized)."""
    dtype = x.dtype if dtype is None else dtype
    if opts.get("mode", "te") == "te" and not dispatch.use_triton(x):
        return nvfp4.qdq(x, dtype=dtype, **opts)
    return nvfp4_dequantize(nvfp4_quantize(x, **opts), dtype)


def nvfp4_quantize_weight(w: torch.Tensor, *, tile=(1, 16), mode: str = "te") -> nvfp4.NVFP4Tensor:
    """Quantize a weight ``[N, K]`` or an expert stack ``[E, N, K]``: one global scale per expert.

    Each expert is its own linear layer, so its FP32 global scale comes from its own amax (the
    canonical mode does all experts in one vectorized call by passing ``amax`` of shape ``[E, 1, 1]``;
    compatibility modes quantize expert by expert and stack).
    """
    if w.dim() == 2:
        return nvfp4_quantize(w, tile=tile, mode=mode)
    if w.dim() != 3:
        raise ValueError(f"weights must be [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    if mode == "te":
        if dispatch.use_triton(w):  # one row-amax launch, no fp32 copy of the stack (a max: the same value)
            amax = dispatch.slice_amax([w.contiguous()]).reshape(-1, 1, 1)
        else:
            amax = nvfp4.nan_ignoring_amax(w.float(), dim=(-2, -1))  # [E, 1, 1], never NaN or negative
        return nvfp4_quantize(w, tile=tile, mode=mode, amax=amax, amax_checked=True)
    qs = [nvfp4_quantize(w[e], tile=tile, mode=mode) for e in range(w.shape[0])]
    return nvfp4.NVFP4Tensor(
        codes=torch.stack([q.codes for q in qs]),
        scales=torch.stack([q.scales for q in qs]),
        global_scale=torch.stack([q.global_scale.reshape(1, 1) for q in qs]),
        shape=w.shape,
        dtype=w.dtype,
        tile=tuple(tile),
        mode=mode,
    )


# ------------------------------------------------------------------------------------------------- FP8


def fp8_weight_qdq(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """FP8 QDQ of a weight ``[N, K]`` / ``[E, N, K]`` (per expert), in ``w.dtype``.

    tensor: one scale per (expert) weight; row: one per output channel; block: 128x128 tiles.
    """
    if scheme == "tensor" and w.dim() == 3:
        return torch.stack([fp8.qdq(w[e], granularity="tensor") for e in range(w.shape[0])])
    if scheme == "block":
        return fp8.qdq(w, granularity="block", block=(FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK))
    return fp8.qdq(w, granularity=scheme)


def fp8_act_qdq(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """FP8 QDQ of activations ``[T, K]``: per tensor, per token (row), or 1x128 blocks."""
    if scheme == "block":
        return fp8.qdq(x, granularity="block", block=(1, FP8_ACT_BLOCK))
    return fp8.qdq(x, granularity=scheme)


# ----------------------------------------------------------------------------------- weights of a spec


def quantize_weight(w: torch.Tensor, spec: LinearSpec, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
    """The weight operand of ``spec`` for a master weight ``w``: ``(QDQ(w), packed or None)``.

    Dtype rule (bit-exact weight sync): the master weight is cast to ``dtype`` (the recipe's
    ``weight_dtype``) *before* quantization and the dequantized weight is returned in ``dtype``; the
    trainer and the rollout engine both call this function, so their weights agree bit for bit.
    ``packed`` is the ``NVFP4Tensor`` (codes, scales) for NVFP4 weights, else None. An unquantized
    spec returns ``w`` itself (no cast, no copy).
    """
    w = w.detach()
    if spec.weight == "none":
        return w, None
    if spec.weight == "nvfp4":
        q = nvfp4_weight(w, spec, dtype)
        return nvfp4_dequantize(q, dtype), q
    return fp8_weight_qdq(w.to(dtype), spec.fp8_scheme), None


def qat_weights(ws: Sequence[torch.Tensor], spec: LinearSpec, dtype: torch.dtype) -> list[torch.Tensor]:
    """The trainer's QAT weight operands of the masters ``ws``: ``[quantize_weight(w, spec, dtype)[0] for w
    in ws]``, the same bits, without the codes and scales (the trainer multiplies only the dequantized
    operand; the rollout's weight sync quantizes its own).

    Canonical NVFP4 weights on a Triton device: the weights of one shape, dtype and device as one group,
    two kernel launches per group (``dispatch.slice_amax``: every expert's amax; ``dispatch.nvfp4_qdq_group``:
    the cast, quantize and dequantize fused tile by tile); the operands are views of one ``[G, *shape]``
    buffer (alive while any of them is: the trainer replaces them all at each optimizer step). Elsewhere weight by weight and, for expert stacks, expert by expert with the fused ``nvfp4.qdq``
    (no codes; the temporaries of ~1 MiB of experts, ``QDQ_CHUNK_ELEMENTS``, not of a whole stack: on a CPU
    a temporary at malloc's mmap threshold, 32 MiB, is mapped and faulted in afresh at every refresh).
    Other specs: ``quantize_weight``.
    """
    ws = [w.detach() for w in ws]
    if spec.weight != "nvfp4" or spec.nvfp4_mode != "te":
        return [quantize_weight(w, spec, dtype)[0] for w in ws]
    tile = tuple(spec.weight_tile)
    for w in ws:
        check_k(w.shape[-1], "NVFP4 weight")
        if w.dim() not in (2, 3):
            raise ValueError(f"weights must be [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    if not ws or not dispatch.use_triton(*ws):
        return [_qdq_by_expert(w, dtype, tile) for w in ws]
    groups: dict[tuple, list[int]] = {}
    for i, w in enumerate(ws):
        groups.setdefault((w.shape, w.dtype, w.device), []).append(i)
    out = list(ws)
    for idx in groups.values():
        group = [ws[i].contiguous() for i in idx]
        amax = dispatch.slice_amax(group).to(dtype).float()  # = the amax of w.to(dtype): RNE is monotone
        for i, w_q in zip(idx, dispatch.nvfp4_qdq_group(group, amax, dtype, tile).unbind(0), strict=True):
            out[i] = w_q
    return out


# CPU refresh: experts per fused qdq call, so that each fp32 temporary stays near 1 MiB (2**18 elements), far
# below malloc's mmap threshold (32 MiB): a whole 100m gate_up stack makes 32 MiB fp32 temporaries, which are
# mapped and page-faulted afresh at every refresh (docs/PERF.md, trainer section: the CPU numbers)
QDQ_CHUNK_ELEMENTS = 2**18


def _qdq_by_expert(w: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int]) -> torch.Tensor:
    """``quantize_weight``'s operand of one canonical NVFP4 weight via the fused ``nvfp4.qdq``, a few
    experts at a time (``QDQ_CHUNK_ELEMENTS``), each with its own global amax (one expert: measured by
    ``qdq``; several: ``nan_ignoring_amax`` per expert, as ``nvfp4_quantize_weight`` takes it)."""
    if w.dim() == 2:
        return nvfp4.qdq(w.to(dtype), tile=tile, dtype=dtype)
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    step = max(1, QDQ_CHUNK_ELEMENTS // w[0].numel())
    for e in range(0, w.shape[0], step):
        x = w[e : e + step].to(dtype)
        amax = nvfp4.nan_ignoring_amax(x.float(), dim=(-2, -1)) if x.shape[0] > 1 else None
        out[e : e + step].copy_(nvfp4.qdq(x if amax is not None else x[0], tile=tile, amax=amax, dtype=dtype))
    return out


def nvfp4_weight(w: torch.Tensor, spec: LinearSpec, dtype: torch.dtype) -> nvfp4.NVFP4Tensor:
    """The ``NVFP4Tensor`` of master ``w`` under an NVFP4-weight ``spec`` (cast to ``dtype`` first): the
    codes and scales ``quantize_weight`` dequantizes (the rollout's packed W4A16 GEMM reads them)."""
    check_k(w.shape[-1], "NVFP4 weight")
    return nvfp4_quantize_weight(w.detach().to(dtype), tile=spec.weight_tile, mode=spec.nvfp4_mode)


def act_qdq(x: torch.Tensor, spec: LinearSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The activation operand of ``spec`` (no RAC): ``QDQ(x)`` in ``dtype`` (default ``x.dtype``)."""
    if spec.act == "none":
        return x if dtype is None else x.to(dtype)
    if spec.act == "nvfp4":
        check_k(x.shape[-1], "NVFP4 activation")
        return nvfp4_qdq(x, dtype, mode=spec.nvfp4_mode, per_token=spec.act_scale == "token")
    out = fp8_act_qdq(x, spec.fp8_scheme)
    return out if dtype is None else out.to(dtype)


# ---------------------------------------------------------------------------------------------- GEMMs


def lowp_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Emulated low-precision GEMM ``a @ b.T`` of dequantized operands, fp32 accumulate, fp32 out.

    ``a`` ``[T, K']``, ``b`` ``[N, K']``. NVFP4 ``e2m1 * s`` products are exact in fp32, so this
    matches a hardware FP4 GEMM up to accumulation order. With RAC, ``K' = K + |S|`` (see w4a4.py).
    """
    return a.float() @ b.float().T
