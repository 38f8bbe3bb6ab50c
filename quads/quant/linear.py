"""Apply a ``LinearSpec`` to one GEMM: route to the QAT, W4A4(+RAC) or FP8 functional form.

| spec.act | computed as                                       | GEMM dtype |
|----------|---------------------------------------------------|------------|
| none     | ``x @ Wop.T`` (``qat_linear``; Wop = QDQ(W) or W)  | x.dtype    |
| nvfp4    | ``w4a4_linear`` (RAC when ``rac_ratio > 0``)      | fp32       |
| fp8      | ``fp8_linear``                                    | fp32       |

The rollout's FP8 W8A8 layers on FP8 tensor cores bypass this for ``quads.quant.fp8_scaled`` (the weight's codes
and scales, ``quads.quant.layers``). With ``spec.error_scale != 1`` (the mismatch amplifier) every row goes through ``amplified_linear``
(fp32 GEMM of ``x + alpha (Q(x) - x)`` operands, ``quads.quant.amplify``).

The weight operand ``w_q`` comes from the caller (a per-step cache on the trainer side, the
synced store on the rollout side, see ``quads.quant.layers``); all paths have STE gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quads.model import gemm
from quads.quant import factored
from quads.quant.amplify import amplified_linear
from quads.quant.fp8_linear import fp8_linear
from quads.quant.qat import qat_linear
from quads.quant.recipe import LinearSpec
from quads.quant.w4a4 import w4a4_linear


def spec_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    spec: LinearSpec,
    *,
    w_q: factored.Weight,
    bias: torch.Tensor | None = None,
    static_channels: torch.Tensor | None = None,
    observe: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """``x`` ``[..., K]`` times master weight ``w`` ``[N, K]`` (operand ``w_q``; a packed ``w4a16.W4A16Weight``
    only for canonical W4A4(+RAC), ``quads.quant.factored``) under ``spec``."""
    if spec.is_identity:
        return gemm.linear(x, w, bias)
    if spec.error_scale != 1.0:
        return amplified_linear(x, w, spec, w_q=w_q, bias=bias, static_channels=static_channels, observe=observe)
    if spec.act == "none":
        return qat_linear(x, w, w_q=w_q, bias=bias)
    if spec.act == "nvfp4":
        return w4a4_linear(
            x, w, rac_ratio=spec.rac_ratio, selection=spec.rac_selection, act_scale=spec.act_scale,
            static_channels=static_channels, mode=spec.nvfp4_mode, w_q=w_q, bias=bias, observe=observe,
        )  # fmt: skip
    return fp8_linear(x, w, scheme=spec.fp8_scheme, w_q=w_q, bias=bias)
