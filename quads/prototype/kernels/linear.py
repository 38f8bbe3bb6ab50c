"""Linear-layer entry points over the prototype GEMMs: Triton on CUDA, the references elsewhere, under
the kernel backend of ``quads.kernels.dispatch``. GEMMs agree with their references up to fp32
summation order."""

from __future__ import annotations

import torch

from quads.formats import nvfp4
from quads.kernels import dispatch, tuning


def w4a16_linear(x: torch.Tensor, w: nvfp4.NVFP4Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` x NVFP4 weight ``[N, K]`` -> ``[..., N]`` in ``x.dtype``.

    Triton (CUDA, BF16 x): the fused decode GEMM for ``M <= fused_max_m`` tokens (``tuning.json``
    ``w4a16_linear.dispatch``), else Triton dequantize + ``torch.mm`` (cuBLAS), which is faster there.
    Reference: ``x @ dequantize(w, x.dtype).T``.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if dispatch.use_triton(x2, w.codes) and x.dtype == torch.bfloat16:
        from quads.prototype.kernels import gemm

        if x2.shape[0] <= tuning.config("w4a16_linear", "dispatch")["fused_max_m"]:
            y = gemm.w4a16_gemm(x2.contiguous(), w)
        else:
            y = x2 @ dispatch.nvfp4_dequantize(w, x.dtype).T
    else:
        y = x2 @ nvfp4.dequantize(w, x.dtype).T
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, y.shape[-1])


def w4a16_grouped(x: torch.Tensor, w: nvfp4.NVFP4Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped MoE W4A16: ``x`` ``[T, K]`` sorted by expert, ``w`` ``[E, N, K]``, ``offsets`` ``[E+1]``."""
    if dispatch.use_triton(x, w.codes) and x.dtype == torch.bfloat16:
        from quads.prototype.kernels import gemm

        return gemm.w4a16_grouped_gemm(x.contiguous(), w, offsets)
    out = torch.empty(x.shape[0], w.codes.shape[1], dtype=x.dtype, device=x.device)
    wd = nvfp4.dequantize(w, x.dtype)
    offs = offsets.tolist()
    for e in range(w.codes.shape[0]):
        if offs[e + 1] > offs[e]:
            out[offs[e] : offs[e + 1]] = x[offs[e] : offs[e + 1]] @ wd[e].T
    return out


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
