"""NVFP4 W4A4 linear with Residual Activation Compensation, as one GEMM over K + |S| channels.

    Y = Xq @ Wq.T + QDQ(R[:, S]) @ Wq[:, S].T
      = [Xq | QDQ(R[:, S])] @ [Wq | Wq[:, S]].T          (one GEMM, K' = K + |S|)

             K              |S|                          K              |S|
    A  [T, K']  = [   Xq   | Rq_S ]        B [N, K'] = [   Wq   | Wq[:, S] ]

``Xq = QDQ(X)``, ``Wq = QDQ(W)`` (no weight residual: the weight columns of S are duplicated),
``Rq_S = QDQ(R[:, S])`` (see ``quads.quant.rac`` for |S|, S and the residual's scales).

How it is computed (canonical NVFP4 mode): in the factored form of ``quads.quant.factored``,
``Y = g_x * (U_x @ Wq.T) + g_r * (U_r @ Wq.T)`` with the exact ``e2m1 * s`` values ``U`` (``U_r``
scattered back to its channels) in BF16 on CUDA (tensor cores) or FP32 on the CPU, fp32 accumulation,
the FP32 global scales applied to the output (on a Triton device the rollout's weight operand is the
packed NVFP4 weight, read by the W4A16 kernel: same operand values); the same formula as the engine's capturable expert path
(``quads.quant.grouped.sorted_linear``), with one group of rows. The fp32 emulation above
(``rac_gemm_operands`` + ``ops.lowp_matmul``: both operands dequantized to fp32, one GEMM over K')
is the reference it is tested against (same quantized operands, accumulation order aside), and the
path of the compatibility modes. The output is cast to ``x.dtype``.
Gradients (if any) are straight-through at ``X_eff = Xq + scatter_S(Rq_S)`` and ``Wq``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quads.quant import factored, ops
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
    w_q: factored.Weight | None = None,
    bias: torch.Tensor | None = None,
    observe: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """``x`` ``[..., K]``, ``w`` ``[N, K]`` -> ``[..., N]`` in ``x.dtype`` (W4A4 + RAC, see module doc).

    ``w_q``: the already dequantized weight (the rollout side stores it at sync time), or in the
    canonical mode its packed form ``w4a16.W4A16Weight`` (``quads.quant.factored``: the same operand
    values, read by the packed W4A16 kernel); when None, ``QDQ(w)`` is computed here with ``tile`` and ``mode``. ``static_channels``: a calibrated channel
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
    elif mode != "te" and not isinstance(w_q, torch.Tensor):
        raise ValueError(f"w4a4_linear: a packed weight operand needs the canonical NVFP4 mode 'te', got mode "
                         f"{mode!r}; pass the dequantized QDQ(W) tensor")

    def compute(x2: torch.Tensor, need: bool):
        if mode == "te":
            return factored_compute(x2, need)
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

    def factored_compute(x2: torch.Tensor, need: bool):
        dtype = factored.gemm_dtype(w_q)
        op = factored.operands(
            x2.detach(), factored.Segments.of(None), n=n, dtype=dtype, per_token=act_scale == "token",
            selection=selection, static_order=static_channels,
            observe=None if observe is None else lambda r, norms: observe(r),
        )  # fmt: skip
        y = factored.product(op.u, op.g, w_q)
        if not need:
            return y.to(x2.dtype), None, None
        return y.to(x2.dtype), op.dequantized(), factored.dense_weight(w_q)

    return ste_linear(x, w, compute, bias)
