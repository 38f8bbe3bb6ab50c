"""The decode step's whole W4A4 + RAC activation operand in one CUDA launch (``csrc/rac_operand.cuh``), built on first
use, beside the launches it replaces.

``factored.operands`` computes the operand of rows sorted by expert with few rows per expert (the decode step) as
``group_units`` (the W4A4 term: each expert's amax from its rows' maxima, the NVFP4 cast, the residual) and then
``rac_select.rac_units`` (the RAC term: the per-expert selection, CUDA or Triton, and the gathered residual's cast):
three launches after the row maxima, each a boundary on the step's critical path, with an fp32 residual written and
read back between them. This kernel runs one block per expert through the same four phases (amax, cast and residual
with its norms, the selection's sort, the residual's cast) with block barriers between them, so the operand is one
launch. It writes the same bits (the stacked operand ``[M, 2, K]``, both S_dec as ``[M, 2]``, S); the references are those
launches and the PyTorch steps of ``factored.operands`` (tests/test_rac_operand_cuda.py, GPU only).

It runs where ``tuning.json``'s ``rac_operand.decode`` says ``backend: cuda`` (or the explicit argument) and
``supports`` holds; else the launches run. docs/PERF.md has its timings against them.
Op: ``torch.ops.quads_rac_operand_cuda.rac_operand``; the compiled step sees it through ``quads::rac_operand``
(``factored_quant.rac_operand_op``).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from quads.kernels import cuda_build
from quads.kernels.rac_select_cuda import log_kp

Backend = Literal["launches", "cuda"]  # the decode operand: group_units + rac_units, or this kernel; the same bits
MAX_K = 1024  # the instantiations' largest padded K
EXTENSION = ("rac_operand", "rac_operand.cu")  # cuda_build's (name, source)
# the template instantiations compiled into the extension (rac_operand.cu, the same list): (log2 of the padded K,
# warps), 2**L / (32 warps) = 1, 2, 4 or 8 channels a thread
CONFIGS = ((5, 1), (6, 1), (7, 2), (8, 2), (8, 4), (8, 8), (9, 8), (10, 8), (10, 16))
ZERO_ROWS_PER_BLOCK = 64  # the blocks that write the rows of no group: one per this many rows of M (at least one)


def default_warps(k: int) -> int:
    """2 channels a thread (1 at K <= 32, one warp): 16 warps at K = 1,024, 4 at K = 256."""
    return max(1, (1 << log_kp(k)) // 64)


def _check_backend(backend: str) -> None:
    if backend not in get_args(Backend):
        raise ValueError(f"rac_operand: unknown backend {backend!r}; valid: {', '.join(get_args(Backend))}")


def _builds(k: int, warps: int) -> bool:
    """An instantiated (padded K, warps), a GPU and a compiler, and the extension built (a failed build warns once;
    the launches, the same bits, run instead)."""
    return (log_kp(k), warps) in CONFIGS and available() and cuda_build.try_build(*EXTENSION)


def available() -> bool:
    """A CUDA GPU and a CUDA compiler for the build."""
    return torch.cuda.is_available() and cuda_build.compiler_available()


def _layout_ok(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """x on CUDA, fp32 or BF16 [M, K] with unit stride along K and 16-byte aligned rows (by its storage offset: the
    allocator's blocks are aligned, and a fake tensor under ``torch.compile`` has no address), the stacked operand in
    x's dtype, K a multiple of 16 up to ``MAX_K``."""
    k = x.shape[-1]
    return (x.is_cuda and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and out_dtype == x.dtype
            and x.stride(-1) == 1 and k % 16 == 0 and 0 < k <= MAX_K
            and (x.storage_offset() * x.element_size()) % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0)


def supports(x: torch.Tensor, out_dtype: torch.dtype, warps: int) -> bool:
    """Whether the kernel takes this operand: ``_layout_ok`` and ``_builds``."""
    return _layout_ok(x, out_dtype) and _builds(x.shape[-1], warps)


@torch.compiler.assume_constant_result
def _configured_warps(k: int, backend: str | None, warps: int | None) -> int:
    """The warps of the one launch at this K by the launch config (``backend`` / ``warps`` in place of
    ``tuning.json``'s ``rac_operand.decode``), 0 where the launches run (the config, no such instantiation, no GPU
    or compiler, a failed build). A constant of the compiled step: Dynamo calls it once while tracing."""
    from quads.kernels import tuning

    cfg = tuning.config("rac_operand", "decode", backend=backend, warps=warps)
    _check_backend(cfg["backend"])
    if cfg["backend"] != "cuda":
        return 0
    w = default_warps(k) if cfg["warps"] is None else cfg["warps"]
    return w if _builds(k, w) else 0


def plan(x: torch.Tensor, out_dtype: torch.dtype, *, backend: Backend | None = None, warps: int | None = None
         ) -> int | None:
    """The warps the one-launch kernel runs with for this operand, or None where the launches run: the launch config
    (``tuning.json`` ``rac_operand.decode``; ``backend`` / ``warps`` given in its place) says ``cuda`` and the kernel
    takes the operand (``supports``). ``warps`` None: ``default_warps``. Traceable by Dynamo (the decode step)."""
    if backend is not None:  # checked even where the layout sends the operand to the launches
        _check_backend(backend)
    if not _layout_ok(x, out_dtype):
        return None
    return _configured_warps(x.shape[-1], backend, warps) or None


def operand(x: torch.Tensor, offsets: torch.Tensor, groups: int, out: torch.Tensor, *, n: int, warps: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the stacked operand ``out`` ``[M, 2, K]`` of rows ``x`` ``[M, K]`` sorted by group (``offsets``
    ``[G + 1]`` int64: each group's first row, then that of the rows of no group) -> ``(g [M, 2], S [G, n])``: each
    row's S_dec of the W4A4 term and of the RAC term (``factored.Operands.g``, written by the kernel, no stack), and
    each group's RAC channels, as ``factored.operands`` with ``group_units`` and ``rac_units``."""
    if (log_kp(x.shape[-1]), warps) not in CONFIGS:
        raise ValueError(f"rac_operand_cuda.operand: (log2 padded K, warps) must be one of {CONFIGS}, got "
                         f"{(log_kp(x.shape[-1]), warps)}")
    cuda_build.build(*EXTENSION)
    m = x.shape[0]
    g = torch.empty(m, 2, dtype=torch.float32, device=x.device)
    s = torch.empty(groups, n, dtype=torch.long, device=x.device)
    zero_blocks = max(1, -(-m // ZERO_ROWS_PER_BLOCK))
    torch.ops.quads_rac_operand_cuda.rac_operand(x, offsets, out, g, s, n, groups, warps, zero_blocks)
    return g, s
