"""FP8 (E4M3) W8A8 linear, emulated: ``y = QDQ(x) @ QDQ(w).T`` in fp32, output in ``x.dtype``.

Schemes (``quads.formats.fp8``): ``tensor`` (one scale per weight / per activation tensor), ``row``
(per-output-channel weights, per-token activations), ``block`` (DeepSeek-V3: 128x128 weight tiles,
1x128 activation blocks; K and N must be multiples of 128). Gradients are straight-through.
"""

from __future__ import annotations

import torch

from quads.quant import ops
from quads.quant.qat import ste_linear
from quads.quant.recipe import FP8_SCHEMES


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    scheme: str = "row",
    w_q: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[..., K]``, ``w`` ``[N, K]`` -> ``[..., N]``; ``w_q``: an already dequantized weight."""
    if scheme not in FP8_SCHEMES:
        raise ValueError(f"unknown FP8 scheme {scheme!r}; valid: {', '.join(FP8_SCHEMES)}")
    if w_q is None:
        w_q = ops.fp8_weight_qdq(w.detach(), scheme)

    def compute(x2: torch.Tensor, need: bool):
        x_op = ops.fp8_act_qdq(x2.detach().float(), scheme)
        y = ops.lowp_matmul(x_op, w_q).to(x2.dtype)
        return y, x_op, w_q

    return ste_linear(x, w, compute, bias)
