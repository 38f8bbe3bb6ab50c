"""NVFP4 W4A4 linear with Residual Activation Compensation, as one GEMM over K + |S| channels.

    Y = Xq @ Wq.T + QDQ(R[:, S]) @ Wq[:, S].T
      = [Xq | QDQ(R[:, S])] @ [Wq | Wq[:, S]].T          (one GEMM, K' = K + |S|)

             K              |S|                          K              |S|
    A  [T, K']  = [   Xq   | Rq_S ]        B [N, K'] = [   Wq   | Wq[:, S] ]

``Xq = QDQ(X)``, ``Wq = QDQ(W)`` (no weight residual: the weight columns of S are duplicated),
``Rq_S = QDQ(R[:, S])`` (see ``quads.quant.rac`` for |S|, S and the residual's scales). Both
operands are dequantized to fp32 (``e2m1 * s`` is exact) and multiplied with fp32 accumulation, so
this emulates a hardware FP4 GEMM over the concatenated K' up to accumulation order; the kernel
backend (``quads.quant.ops``) computes exactly this layout. The output is cast to ``x.dtype``.
Gradients (if any) are straight-through at ``X_eff = Xq + scatter_S(Rq_S)`` and ``Wq``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quads.quant import ops
from quads.quant.qat import ste_linear
from quads.quant.rac import rac_channels, rac_operands


def rac_gemm_operands(
    xq: torch.Tensor, rq: torch.Tensor | None, s: torch.Tensor | None, wq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated GEMM operands ``A`` ``[T, K+|S|]`` and ``B`` ``[N, K+|S|]`` (fp32)."""
    if s is None:
        return xq, wq.float()
    cols = torch.cat([torch.arange(wq.shape[1], device=s.device), s])  # [K + |S|]: all columns, then S again
    return torch.cat([xq, rq], dim=1), wq.index_select(1, cols).float()  # one gather, in the stored dtype


def w4a4_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    rac_ratio: float = 0.0,
    selection: str = "dynamic",
    act_scale: str = "tensor",
    static_channels: torch.Tensor | None = None,
    tile: tuple[int, int] = (1, 16),
    mode: str = "te",
    w_q: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    observe: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """``x`` ``[..., K]``, ``w`` ``[N, K]`` -> ``[..., N]`` in ``x.dtype`` (W4A4 + RAC, see module doc).

    ``w_q``: the already dequantized weight (the rollout side stores it at sync time); when None,
    ``QDQ(w)`` is computed here with ``tile`` and ``mode``. ``static_channels``: a calibrated channel
    order (at least |S| long) for ``selection="static"``. ``observe``: called with the residual
    ``[T, K]`` (calibration statistics).
    """
    k = x.shape[-1]
    ops.check_k(k, "w4a4_linear")
    if act_scale not in ("tensor", "token"):
        raise ValueError(f"unknown act_scale {act_scale!r}; valid: tensor, token")
    n = rac_channels(k, rac_ratio)
    if w_q is None:
        w_q = ops.nvfp4_qdq(w.detach(), tile=tile, mode=mode)

    def compute(x2: torch.Tensor, need: bool):
        xq, rq, s = rac_operands(
            x2.detach(), n=n, selection=selection, act_scale=act_scale, mode=mode,
            static_order=static_channels, observe=observe,
        )  # fmt: skip
        a, b = rac_gemm_operands(xq, rq, s, w_q)
        y = ops.lowp_matmul(a, b).to(x2.dtype)
        if not need:
            return y, None, None
        x_eff = xq if s is None else xq.index_add(1, s, rq)
        return y, x_eff, w_q

    return ste_linear(x, w, compute, bias)
