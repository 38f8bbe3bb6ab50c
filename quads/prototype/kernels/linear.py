"""Linear-layer entry points over the prototype GEMMs: Triton on CUDA, the references elsewhere, under
the kernel backend of ``quads.kernels.dispatch``. GEMMs agree with their references up to fp32
summation order."""

from __future__ import annotations

import torch

from quads.formats import nvfp4
from quads.kernels import dispatch


def w4a4_linear(
    x: torch.Tensor,
    w: nvfp4.NVFP4Tensor,
    *,
    rac_channels: int = 0,
    act_scale: str = "tensor",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Emulated W4A4 (+ dynamic RAC with ``rac_channels`` = |S|) of ``x`` ``[..., K]`` -> ``[..., N]``.

    Quantizes X (and the residual) with the fused RAC kernel and runs the W4A4 GEMM with global scales
    in the epilogue; the reference path runs the same steps in PyTorch.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    from quads.prototype.kernels import gemm, rac

    if dispatch.use_triton(x2, w.codes):
        qz, mm = rac.rac_quantize, gemm.w4a4_gemm
    else:
        qz, mm = rac.rac_quantize_reference, gemm.w4a4_gemm_reference
    q = qz(x2, rac_channels, act_scale=act_scale, scatter=rac_channels > 0)
    res_scale = None if q.residual is None else q.residual.global_scale
    y = mm(q.x, w, residual=q.scattered, residual_scale=res_scale, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, y.shape[-1])
