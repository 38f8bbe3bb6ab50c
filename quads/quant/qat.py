"""Quantization-aware training: quantized forward, straight-through (STE) backward.

``ste_linear(x, w, compute)`` runs ``compute`` (any quantized GEMM that returns the output and the
operands it effectively multiplied, ``x_op`` ``[T, K]`` and ``w_op`` ``[N, K]``) and back-propagates as
the plain linear ``y = x_op @ w_op.T`` evaluated at those operands, with the quantizers treated as
the identity:

    dL/dx = dL/dy @ w_op          (= F.linear's input grad at QDQ(w))
    dL/dw = dL/dy.T @ x_op        (= F.linear's weight grad at QDQ(x) or x)

so ``w`` (the master weight) receives the gradient of the unquantized linear evaluated at the
quantized point. Gradients are returned in ``x.dtype`` / ``w.dtype``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quads.model import gemm
from quads.quant import ops

# compute(x2d, need_operands) -> (y2d, x_op or None, w_op or None); shapes [T, N], [T, K], [N, K]
Compute = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


class _STELinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, compute):  # type: ignore[override]
        y, x_op, w_op = compute(x2, True)
        ctx.save_for_backward(x_op, w_op)
        ctx.x_dtype, ctx.w_dtype = x2.dtype, w.dtype
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x_op, w_op = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = gemm.matmul(g, w_op.to(g.dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gw = gemm.matmul(g.T, x_op.to(g.dtype)).to(ctx.w_dtype)
        return gx, gw, None


class _STEOperandFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, w_op):  # type: ignore[override]
        ctx.w_dtype = w.dtype
        return w_op

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g.to(ctx.w_dtype), None


def ste_operand(w: torch.Tensor, w_q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight operand ``w_q`` (e.g. a cached ``QDQ(w)``, any shape of ``w``) in ``dtype``, whose
    gradient goes to the master weight ``w`` unchanged (in ``w.dtype``): any product ``f(x, operand)``
    then back-propagates as above, ``dL/dx`` at ``w_op`` and ``dL/dw = dL/dw_op``, the gradient of the
    unquantized product evaluated at the quantized point. For GEMMs that take all experts at once."""
    w_op = w_q.detach().to(dtype)
    if not (torch.is_grad_enabled() and w.requires_grad):
        return w_op
    return _STEOperandFn.apply(w, w_op)


def ste_linear(
    x: torch.Tensor, w: torch.Tensor, compute: Compute, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` ``[..., K]``, ``w`` ``[N, K]`` -> ``[..., N]`` via ``compute`` with STE gradients."""
    k = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(
            f"expected x [..., K] and w [N, K] with the same K, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    x2 = x.reshape(-1, k)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        y = _STELinearFn.apply(x2, w, compute)
    else:
        y = compute(x2, False)[0]
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def qat_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    quantize_acts: bool = False,
    tile: tuple[int, int] = (1, 16),
    mode: str = "te",
    act_scale: str = "tensor",
    w_q: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 QAT linear: ``y = x @ QDQ(w).T`` (``quantize_acts``: ``QDQ(x) @ QDQ(w).T``), STE backward.

    ``QDQ(w)`` is computed in ``w.dtype`` unless ``w_q`` (an already dequantized weight, e.g. a
    per-step cache, any format) is given. The GEMM runs in ``x.dtype`` (``F.linear``), as the
    trainer's other layers do. ``act_scale``: NVFP4 activation global scale per "tensor" or "token".
    """
    if act_scale not in ("tensor", "token"):
        raise ValueError(f"unknown act_scale {act_scale!r}; valid: tensor, token")
    if w_q is None:
        ops.check_k(w.shape[-1], "qat_linear weight")
        w_q = ops.nvfp4_qdq(w.detach(), tile=tile, mode=mode)
    if quantize_acts:
        ops.check_k(x.shape[-1], "qat_linear activation")

    def compute(x2: torch.Tensor, need: bool):
        x_op = x2.detach()
        if quantize_acts:
            x_op = ops.nvfp4_qdq(x_op, mode=mode, per_token=act_scale == "token")
        w_op = w_q.to(x2.dtype)
        return gemm.linear(x_op, w_op), x_op, w_op

    return ste_linear(x, w, compute, bias)
