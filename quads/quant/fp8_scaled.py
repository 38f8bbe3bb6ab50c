"""FP8 W8A8 rollout GEMMs on FP8 tensor cores: ``torch._scaled_mm`` and ``torch._scaled_grouped_mm``.

The rollout side of the ``fp8`` recipe (``LinearSpec(weight="fp8", act="fp8")``) on a GPU with FP8 tensor
cores. The weight is kept as its E4M3 codes and FP32 decode scales (``fp8.FP8Tensor``: 1 byte an element, no
BF16 copy), quantized at weight sync; the activation is quantized per call (per token for the ``row`` scheme);
the GEMM multiplies the codes and applies both scales to its output:

    y[t, n] = s_x[t] * s_w[n] * sum_k q_x[t, k] * q_w[n, k]          (fp32 accumulation, BF16 output)

Every product ``q_x * q_w`` of two E4M3 values is exact in fp32 (at most 8 significant bits), so this is the
FP8 product itself; its reference is ``fp8.scaled_mm_reference`` (the same codes and scales, fp32 GEMM), and
``reference_grouped`` for expert stacks. Against the emulated path (``quads.quant.fp8_linear``, which the CPU
and the trainer run: fp32 GEMMs of ``QDQ(x)`` and the weight's ``QDQ(W)`` in the recipe's ``weight_dtype``) the
codes and scales are the same bits; the results differ by the fp32 accumulation order, the emulation's rounding
of each dequantized operand (``q * s`` in fp32, then the weight to ``weight_dtype``), and the BF16 rounding of
this GEMM's output. tests/test_fp8_scaled.py bounds both against an fp64 reference.

Where it runs (``supports``): the rollout side, schemes ``row`` (per-output-channel weights, per-token
activations: dense layers and expert stacks) and ``tensor`` (dense layers only; an expert stack's tensor scheme
has one activation scale per expert, which the grouped GEMM cannot take), no mismatch amplifier, BF16
activations, CUDA tensors under a kernel backend other than ``reference`` on Hopper (compute capability 9.x: FP8
tensor cores, and torch's grouped FP8 GEMM with row scales; the GPUs these kernels were verified on). Everywhere
else the emulated path runs.
"""

from __future__ import annotations

import torch

from quads.formats import fp8
from quads.kernels import dispatch
from quads.model import moe
from quads.quant.recipe import LinearSpec

SCHEMES = {2: ("row", "tensor"), 3: ("row",)}  # weight dims -> the schemes the scaled GEMMs take


def supports(spec: LinearSpec, weight_dims: int) -> bool:
    """Whether a rollout weight of ``weight_dims`` dims (2: a linear, 3: an expert stack) under ``spec`` may be
    kept for the scaled GEMMs (the device is asked separately, ``on_tensor_cores``)."""
    return (spec.weight == "fp8" and spec.act == "fp8" and spec.error_scale == 1.0
            and spec.fp8_scheme in SCHEMES.get(weight_dims, ()))


_capabilities: dict[int, tuple[int, int]] = {}  # a plain dict, which a compiled region reads as a constant


def _capability(index: int) -> tuple[int, int]:
    cap = _capabilities.get(index)
    if cap is None:
        cap = _capabilities[index] = torch.cuda.get_device_capability(index)
    return cap


def on_tensor_cores(t: torch.Tensor, weight_dims: int = 2) -> bool:
    """Whether FP8 GEMMs of CUDA tensor ``t`` run on tensor cores here (module docstring): Hopper (compute
    capability 9.x), where both kernels are verified (tests/test_fp8_scaled.py; torch's grouped FP8 GEMM with row
    scales exists for 9.x only); other GPUs keep the emulated path."""
    if not t.is_cuda or dispatch.backend() == "reference":
        return False
    major, _ = _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return major == 9 and (weight_dims == 2 or hasattr(torch, "_scaled_grouped_mm"))


def quantize_weight(w: torch.Tensor, spec: LinearSpec, dtype: torch.dtype) -> fp8.FP8Tensor:
    """The weight's codes and scales: ``fp8.quantize`` of ``w.to(dtype)`` (``ops.quantize_weight``'s operand is
    their ``fp8.dequantize(q, dtype)``, bit for bit). ``[N, K]`` or ``[E, N, K]`` (row scheme: scales ``[.., N,
    1]``)."""
    if not supports(spec, w.dim()):
        raise ValueError(f"fp8_scaled keeps FP8 W8A8 weights of schemes {SCHEMES.get(w.dim(), ())} for a "
                         f"{w.dim()}-D weight, got spec {spec.describe()}")
    return fp8.quantize(w.detach().to(dtype), granularity=spec.fp8_scheme)


def linear(x: torch.Tensor, w: fp8.FP8Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` (BF16) times the FP8 weight ``w`` ``[N, K]`` -> ``[..., N]`` in ``x.dtype``: the
    activation quantized with the weight's scheme (per token, or per tensor), then ``torch._scaled_mm`` (BF16
    output) on FP8 tensor cores, ``fp8.scaled_mm_reference`` elsewhere."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        y = x.new_zeros(*x.shape[:-1], w.data.shape[0])
        return y if bias is None else y + bias.to(y.dtype)
    a = fp8.quantize(x2, granularity=w.granularity)
    if on_tensor_cores(x2):
        sb = w.scale if w.scale.dim() == 0 else w.scale.t()  # [] or [1, N]
        y = torch._scaled_mm(a.data, w.data.t(), scale_a=a.scale, scale_b=sb, out_dtype=torch.bfloat16)
    else:
        y = fp8.scaled_mm_reference(a, w)
    y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias.to(y.dtype)


def grouped(xs: torch.Tensor, w: fp8.FP8Tensor, routes: moe.StaticRoutes) -> torch.Tensor:
    """Sorted rows ``xs`` ``[M, K]`` (``moe.static_routes`` order, BF16) times each row's expert weight ``w``
    ``[E, N, K]`` (row scheme) -> ``[M, N]`` in ``xs.dtype``, zero rows at masked slots; no host sync. Each row
    quantized on its own (per token: a sorted row is its token's row), then ``torch._scaled_grouped_mm`` with the
    routes' device offsets on FP8 tensor cores, ``reference_grouped`` elsewhere."""
    if w.granularity != "row" or w.data.dim() != 3:
        raise ValueError(f"fp8_scaled.grouped takes a row-scaled [E, N, K] weight, got {w.granularity} "
                         f"{tuple(w.data.shape)}")
    a = fp8.quantize(xs, granularity="row")
    if on_tensor_cores(xs, 3):
        E, N, _ = w.data.shape
        y = torch._scaled_grouped_mm(a.data, w.data.transpose(-2, -1), a.scale.view(-1), w.scale.view(E, N),
                                     offs=routes.ends, out_dtype=torch.bfloat16)
    else:
        y = reference_grouped(a, w, routes)
    return torch.where(routes.valid[:, None], y, 0.0).to(xs.dtype)  # rows past the last offset are not written


def reference_grouped(a: fp8.FP8Tensor, w: fp8.FP8Tensor, routes: moe.StaticRoutes) -> torch.Tensor:
    """fp32 ``[M, N]``: ``grouped``'s product of the quantized rows ``a`` ``[M, K]`` (row scales) with their
    experts' codes and scales: the padded layout's fp32 ``bmm`` of the codes, then both scales (as
    ``fp8.scaled_mm_reference`` for one weight); zero rows at masked slots."""
    E = w.data.shape[0]
    y = routes.unpad(torch.bmm(routes.pad(a.data.float()), w.data.float().mT))  # [M, N]
    sw = w.scale.squeeze(-1)[routes.expert.clamp_max(E - 1)]  # [M, N]: each row's expert's channel scales
    return y * a.scale * sw

