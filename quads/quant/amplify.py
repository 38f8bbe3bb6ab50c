"""The mismatch amplifier: a quantized GEMM whose quantization error is scaled by ``alpha``.

A diagnostic for the dose-response experiment (``recipe.rollout_error_scale``, DESIGN.md section 6):
every operand ``x`` that a ``LinearSpec`` quantizes to ``Q(x)`` is replaced by

    x_alpha = x + alpha * (Q(x) - x)          (fp32; alpha = ``LinearSpec.error_scale``)

on both sides of the GEMM: the weight (``x`` = the master weight cast to the recipe's weight dtype,
``Q(x)`` = the synced operand ``QDQ(W)``) and the activation (``Q(x)`` = ``QDQ(X)``; with RAC the
compensated operand ``X_eff = Xq + scatter_S(QDQ(R[:, S]))``, kept as one GEMM over ``K + |S|``:
``A = [x + alpha (Xq - x) | alpha Rq_S]``, ``B = [W_alpha | W_alpha[:, S]]``, so ``A @ B.T`` is
``x_alpha_eff @ W_alpha.T`` up to accumulation order). ``alpha = 0`` is the unquantized GEMM in fp32,
``alpha = 1`` the spec itself.

``spec_linear`` calls this module only when ``alpha != 1``, so ``alpha = 1`` is the unamplified path
bit for bit. The weight sync is untouched (the synced operand stays ``QDQ(W)``). Two implementations of
the same operands: ``amplified_linear`` per GEMM (the experts loop and dense layers; the amplified weight
formed per call) and ``quads.quant.grouped.grouped_linear`` batched over experts (the padded layout of the
eager grouped path and of the captured decode step, ``QuantizedExperts.forward_static``; the amplified
weight kept by its ``WeightStore.get_amplified`` and refreshed in place at every sync). They agree to
the fp32 GEMMs' accumulation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quads.quant import ops
from quads.quant.qat import ste_linear
from quads.quant.rac import rac_channels, rac_operands
from quads.quant.recipe import LinearSpec
from quads.quant.w4a4 import rac_gemm_operands


def amplify(x: torch.Tensor, q: torch.Tensor, alpha: float) -> torch.Tensor:
    """``x + alpha * (q - x)`` in fp32 (``x``: the unquantized operand, ``q``: its quantized value)."""
    xf = x.float()
    return xf + alpha * (q.float() - xf)


def amplify_weight(w: torch.Tensor, w_q: torch.Tensor, spec: LinearSpec) -> torch.Tensor:
    """The amplified weight operand (fp32): ``W + alpha (QDQ(W) - W)`` with ``W`` the master weight cast to
    the operand's dtype, or ``W`` itself when the spec leaves the weight unquantized."""
    if spec.weight == "none":
        return w.detach().float()
    return amplify(w.detach().to(w_q.dtype), w_q, spec.error_scale)


def amplified_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    spec: LinearSpec,
    *,
    w_q: torch.Tensor,
    bias: torch.Tensor | None = None,
    static_channels: torch.Tensor | None = None,
    observe: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """``x`` ``[..., K]`` times master weight ``w`` ``[N, K]`` (synced operand ``w_q``) under ``spec`` with
    every quantization error scaled by ``spec.error_scale`` (module docstring); fp32 GEMM, ``x.dtype`` out."""
    alpha = spec.error_scale
    w_op = amplify_weight(w, w_q, spec)

    def compute(x2: torch.Tensor, need: bool):
        xf = x2.detach().float()
        if spec.act == "nvfp4":
            ops.check_k(x2.shape[-1], "amplified_linear")
            xq, rq, s = rac_operands(
                x2.detach(), n=rac_channels(x2.shape[-1], spec.rac_ratio), selection=spec.rac_selection,
                act_scale=spec.act_scale, mode=spec.nvfp4_mode, static_order=static_channels, observe=observe,
            )  # fmt: skip
            xa, ra = amplify(xf, xq, alpha), None if rq is None else alpha * rq
            a, b = rac_gemm_operands(xa, ra, s, w_op)
            x_eff = xa if s is None else xa.index_add(1, s, ra)
        elif spec.act == "fp8":
            a = x_eff = amplify(xf, ops.fp8_act_qdq(xf, spec.fp8_scheme), alpha)
            b = w_op
        else:
            a = x_eff = xf
            b = w_op
        y = ops.lowp_matmul(a, b).to(x2.dtype)
        return y, (x_eff if need else None), (w_op if need else None)

    return ste_linear(x, w, compute, bias)
