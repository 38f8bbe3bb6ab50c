"""Kernel dispatch: Triton on CUDA tensors, the pure-PyTorch references everywhere else.

One switch: ``QUADS_KERNELS=auto|triton|reference`` (environment) or ``with kernels("reference"):``
(a context manager that overrides the environment). ``auto`` (default) uses Triton for CUDA tensors
when Triton imports; ``triton`` also runs the kernels on CPU tensors when ``TRITON_INTERPRET=1``
(tests) and raises if Triton is missing; ``reference`` never uses Triton. The Triton modules are
imported on first use, so importing this module costs nothing without a GPU.

Quantizers are bit-exact with their references, so switching backends never changes a quantized
value; GEMMs agree up to fp32 summation order.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK
from quads.kernels._common import HAS_TRITON, interpreting

BACKENDS = ("auto", "triton", "reference")
ENV = "QUADS_KERNELS"
# W4A16: at or below this many tokens the fused Triton GEMM runs; above it, Triton dequantize +
# cuBLAS (torch.mm) is faster on an H200 (M=256: 108 vs 233 us, docs/PERF.md).
W4A16_FUSED_MAX_M = 64

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("quads_kernels", default=None)


def backend() -> str:
    """The active backend name (context manager first, then ``$QUADS_KERNELS``, then ``auto``)."""
    b = _override.get() or os.environ.get(ENV, "auto")
    if b not in BACKENDS:
        raise ValueError(f"{ENV}={b!r} is not a kernel backend; valid: {', '.join(BACKENDS)}")
    return b


@contextlib.contextmanager
def kernels(name: str) -> Iterator[None]:
    """``with kernels("reference"):`` forces a backend inside the block."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(BACKENDS)}")
    tok = _override.set(name)
    try:
        yield
    finally:
        _override.reset(tok)


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels should run on these tensors under the active backend."""
    b = backend()
    if b == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if b == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{ENV}=triton but Triton is not installed; pip install triton or use {ENV}=auto")
        if not (on_cuda or interpreting()):
            raise RuntimeError(f"{ENV}=triton needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
        return True
    return HAS_TRITON and on_cuda


# ------------------------------------------------------------------------------------------- NVFP4


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    mode: str = "te",
    tile: tuple[int, int] = (1, 16),
    per_token: bool = False,
    amax: torch.Tensor | float | None = None,
) -> nvfp4.NVFP4Tensor:
    """``nvfp4.quantize`` (same arguments, same bits); Triton for the canonical mode on CUDA."""
    if mode == "te" and use_triton(x):
        from quads.kernels.nvfp4_quant import nvfp4_quantize as q

        if amax is not None:
            amax = nvfp4.check_amax(amax, x, per_token)
        return q(x, tile=tile, per_token=per_token, amax=amax)
    return nvfp4.quantize(x, mode=mode, tile=tile, per_token=per_token, amax=amax)


def nvfp4_dequantize(q: nvfp4.NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``nvfp4.dequantize`` (same bits); Triton on CUDA."""
    if use_triton(q.codes) and q.scales.shape[-1] * NVFP4_BLOCK == q.codes.shape[-1] * 2:
        from quads.kernels.nvfp4_quant import nvfp4_dequantize as dq

        return dq(q, dtype)
    return nvfp4.dequantize(q, dtype)



# ------------------------------------------------------------------------------------------- GEMMs


def w4a16_linear(x: torch.Tensor, w: nvfp4.NVFP4Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` x NVFP4 weight ``[N, K]`` -> ``[..., N]`` in ``x.dtype``.

    Triton (CUDA, BF16 x): the fused decode GEMM for ``M <= W4A16_FUSED_MAX_M`` tokens, else Triton
    dequantize + ``torch.mm`` (cuBLAS). Reference: ``x @ dequantize(w, x.dtype).T``.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if use_triton(x2, w.codes) and x.dtype == torch.bfloat16:
        from quads.kernels import gemm

        if x2.shape[0] <= W4A16_FUSED_MAX_M:
            y = gemm.w4a16_gemm(x2.contiguous(), w)
        else:
            y = x2 @ nvfp4_dequantize(w, x.dtype).T
    else:
        y = x2 @ nvfp4.dequantize(w, x.dtype).T
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, y.shape[-1])


def w4a16_grouped(x: torch.Tensor, w: nvfp4.NVFP4Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped MoE W4A16: ``x`` ``[T, K]`` sorted by expert, ``w`` ``[E, N, K]``, ``offsets`` ``[E+1]``."""
    if use_triton(x, w.codes) and x.dtype == torch.bfloat16:
        from quads.kernels import gemm

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
    from quads.kernels import gemm, rac

    if use_triton(x2, w.codes):
        qz, mm = rac.rac_quantize, gemm.w4a4_gemm
    else:
        qz, mm = rac.rac_quantize_reference, gemm.w4a4_gemm_reference
    q = qz(x2, rac_channels, act_scale=act_scale, scatter=rac_channels > 0)
    res_scale = None if q.residual is None else q.residual.global_scale
    y = mm(q.x, w, residual=q.scattered, residual_scale=res_scale, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, y.shape[-1])
