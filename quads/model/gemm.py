"""Matrix products in the compute dtype, fast on every x86 CPU: ``linear``, ``matmul``, ``bmm``, ``Linear``.

torch runs a BF16 GEMM on the CPU through oneDNN only when the CPU has native BF16 arithmetic
(AVX-512 with BF16, AMX, AVX2-VNNI-2); elsewhere (e.g. an AVX2-only AMD EPYC) it falls back to a generic
kernel that is 15-100x slower than an FP32 GEMM of the same shape (benchmarks/bench_cpu.py,
benchmarks/results/). On such a CPU these functions compute a BF16 product as the FP32 product of
the BF16 operands, rounded to BF16 once: the numbers of a BF16 GEMM with FP32 accumulation (what
oneDNN and the fallback kernel compute), up to FP32 summation order, which differs between GEMM
libraries anyway. Under CPU autocast to BF16 the operands are rounded to BF16 first, as autocast
does. Everything else (FP32 / FP64 operands, CUDA, CPUs with BF16 GEMMs) goes to torch's own op
unchanged. Gradients follow: the FP32 route back-propagates through the same casts, so each
gradient is rounded to its operand's dtype as the BF16 GEMM's gradient would be.

The FP32 product is an ``autograd.Function`` (``_FP32Product``) whose backward GEMMs run with autocast
off, as the forward's do. Plain autograd runs them so anyway; AOTAutograd (``torch.compile``) traces
the backward under the autocast state of the compiled call, and would turn those FP32 GEMMs into BF16
GEMMs: the slow kernel again, and gradients that differ from the plain step's within rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def native_bf16_gemm() -> bool:
    """Whether torch's CPU BF16 GEMM runs on oneDNN (native BF16 arithmetic) rather than its slow fallback.

    A property of the process: ``torch.compile`` reads it once while tracing and keeps the answer as a
    constant (the probe returns a Python bool, which a graph cannot hold; ``mark_compile_constants``).
    Only CPU GEMMs ask it (``fp32_route`` answers False for CUDA tensors before calling it)."""
    return _probe_native_bf16()


def mark_compile_constants() -> None:
    """Mark ``native_bf16_gemm`` as a compile-time constant for ``torch.compile``; called where quads
    compiles, not at import: the marker loads ``torch._dynamo`` (~3 s of CPU per process)."""
    torch.compiler.assume_constant_result(native_bf16_gemm)


@functools.cache
def _probe_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN: the fallback kernel
        return False


def fp32_route(*tensors: torch.Tensor) -> bool:
    """Whether a product of ``tensors`` is a CPU BF16 GEMM that this CPU can only run slowly."""
    if any(t.device.type != "cpu" for t in tensors):
        return False
    bf16 = all(t.dtype == torch.bfloat16 for t in tensors)
    if not bf16 and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
        bf16 = all(t.dtype in (torch.float32, torch.bfloat16) for t in tensors)  # what autocast casts to BF16
    return bf16 and not native_bf16_gemm()


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


class _FP32Product(torch.autograd.Function):
    """``a @ b`` of FP32 tensors with autocast off in the forward and in the backward; ``b`` 2-D (``a``
    any batch shape, folded into rows) or ``a`` and ``b`` 3-D with the same batch (``bmm``). The
    backward is ``mm`` / ``bmm``'s own: ``grad_a = g @ b^T``, ``grad_b = a^T @ g`` (rows summed)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        with torch.autocast("cpu", enabled=False):
            if b.dim() == 2:
                return torch.mm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[-1])
            return torch.bmm(a, b)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        ga = gb = None
        with torch.autocast("cpu", enabled=False):
            if b.dim() == 2:
                g2 = g.reshape(-1, g.shape[-1])
                if ctx.needs_input_grad[0]:
                    ga = torch.mm(g2, b.t()).view(a.shape)
                if ctx.needs_input_grad[1]:
                    gb = torch.mm(a.reshape(-1, a.shape[-1]).t(), g2)
            else:
                if ctx.needs_input_grad[0]:
                    ga = torch.bmm(g, b.transpose(1, 2))
                if ctx.needs_input_grad[1]:
                    gb = torch.bmm(a.transpose(1, 2), g)
        return ga, gb


def _fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The FP32 product of the BF16-rounded ``a`` and ``b`` (not rounded): ``_FP32Product``'s shapes."""
    if not (b.dim() == 2 and a.dim() >= 1 or a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0]):
        raise ValueError(f"gemm: the FP32 route multiplies [..., K] @ [K, N] or [B, M, K] @ [B, K, N], "
                         f"got {tuple(a.shape)} @ {tuple(b.shape)}")
    return _FP32Product.apply(_as_fp32(a), _as_fp32(b))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           fp32: bool | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``; ``fp32`` forces the route (None: ``fp32_route``), for tests."""
    if not (fp32_route(x, w) if fp32 is None else fp32):
        return F.linear(x, w, bias)
    y = _fp32_product(x, w.t())
    if bias is not None:
        y = y + _as_fp32(bias)
    return y.to(torch.bfloat16)


def matmul(a: torch.Tensor, b: torch.Tensor, *, fp32: bool | None = None) -> torch.Tensor:
    """``a @ b``; ``fp32`` as in ``linear``."""
    if not (fp32_route(a, b) if fp32 is None else fp32):
        return a @ b
    return _fp32_product(a, b).to(torch.bfloat16)


def bmm(a: torch.Tensor, b: torch.Tensor, *, fp32: bool | None = None) -> torch.Tensor:
    """``torch.bmm(a, b)``; ``fp32`` as in ``linear``."""
    if not (fp32_route(a, b) if fp32 is None else fp32):
        return torch.bmm(a, b)
    return _fp32_product(a, b).to(torch.bfloat16)


class Linear(nn.Linear):
    """``nn.Linear`` whose product is ``gemm.linear`` (same parameters, state dict and ``isinstance``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
