"""Kernel dispatch: Triton on CUDA tensors, the pure-PyTorch references everywhere else.

The backend is a config field (``TrainConfig.kernels``, recorded in the run's ``config.yaml``), set
once per process with ``set_backend(name)``; ``with kernels(name):`` overrides it inside a block
(tests). ``auto`` (default) uses Triton for CUDA tensors when Triton imports; ``triton`` also runs
the kernels on CPU tensors under Triton's interpreter (tests, where Triton's own ``TRITON_INTERPRET=1``
is set) and raises if Triton is missing; ``reference`` never uses Triton. The Triton modules are
imported on first use, so importing this module costs nothing without a GPU.

The ops here are the ones the product path calls (NVFP4 quantize / dequantize, and the trainer's grouped
weight quantize-dequantize, ``slice_amax`` + ``nvfp4_qdq_group``). They are bit-exact
with their references, so the backend never changes a quantized value. The rollout's W4A16 GEMMs
(``quads.kernels.w4a16``) are chosen by the quant layers under the same backend (``use_triton``); the
W4A4 GEMM and fused-RAC kernels that only tests and benchmarks call live in ``quads.prototype.kernels``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from quads.formats import nvfp4, nvfp4_compat
from quads.formats.constants import NVFP4_BLOCK
from quads.kernels._common import HAS_TRITON, interpreter_on

BACKENDS = ("auto", "triton", "reference")

_default = ["auto"]  # the process's backend (set_backend, from the run's config)
# The innermost open ``kernels()`` block of the process. Plain lists, not a ContextVar: torch.compile
# reads a list item as a constant and guards on it (a compiled function recompiles when the backend
# changes), where a ``ContextVar.get`` is untraceable (Dynamo would skip the whole compiled decode step).
_block: list[str | None] = [None]


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(BACKENDS)}")
    return name


def backend() -> str:
    """The active backend name (the innermost ``kernels()`` block, else the process's ``set_backend``)."""
    return _block[0] or _default[0]


def set_backend(name: str) -> None:
    """Set the process's kernel backend (``TrainConfig.kernels``): auto, triton or reference."""
    _default[0] = _check(name)


@contextlib.contextmanager
def kernels(name: str) -> Iterator[None]:
    """``with kernels("reference"):`` forces a backend inside the block."""
    outer, _block[0] = _block[0], _check(name)
    try:
        yield
    finally:
        _block[0] = outer


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels should run on these tensors under the active backend."""
    b = backend()
    if b == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if b == "triton":
        if not HAS_TRITON:
            raise RuntimeError("kernel backend 'triton' but Triton is not installed; pip install 'quads[kernels]' "
                               "or use backend 'auto'")
        if not (on_cuda or interpreter_on()):
            raise RuntimeError("kernel backend 'triton' needs CUDA tensors, or Triton's CPU interpreter "
                               "(TRITON_INTERPRET=1 set before quads.kernels is imported)")
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
    amax_checked: bool = False,
) -> nvfp4.NVFP4Tensor:
    """NVFP4 quantize in ``mode``: the canonical ``te`` mode is ``nvfp4.quantize`` (Triton on CUDA, same
    bits), the compatibility modes ``nvfp4_compat.quantize``. ``amax_checked``: the caller computed
    ``amax`` itself (``nan_ignoring_amax``: never NaN or negative), so the Triton path skips the check,
    whose two reads of a device tensor are host syncs (two per expert stack per optimizer step in QAT)."""
    if mode != "te":
        return nvfp4_compat.quantize(x, mode=mode, tile=tuple(tile), per_token=per_token, amax=amax)
    if use_triton(x):
        from quads.kernels.nvfp4_quant import nvfp4_quantize as q

        if amax is not None:
            amax = nvfp4.check_amax(amax, x, per_token, validate=not amax_checked)
        return q(x, tile=tile, per_token=per_token, amax=amax)
    return nvfp4.quantize(x, tile=tile, per_token=per_token, amax=amax)


def nvfp4_dequantize(q: nvfp4.NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``nvfp4.dequantize`` (same bits); Triton on CUDA."""
    if use_triton(q.codes) and q.scales.shape[-1] * NVFP4_BLOCK == q.codes.shape[-1] * 2:
        from quads.kernels.nvfp4_quant import nvfp4_dequantize as dq

        return dq(q, dtype)
    return nvfp4.dequantize(q, dtype)


def slice_amax(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """fp32 ``[G, E]``: ``max|w[e]|`` of every expert of every weight of a group (same shape ``[E, N, K]``,
    dtype and device; a 2-D weight ``[N, K]`` is one expert), NaN ignored, +-Inf counted
    (``nvfp4.nan_ignoring_amax``): the global amax of each expert's NVFP4 scale. Triton: one row-amax
    launch for the whole group and a max over each expert's rows (a max is order-free: the same value)."""
    if use_triton(*ws):
        from quads.kernels.weight_qdq import group_amax

        return group_amax(ws)
    return torch.stack([nvfp4.nan_ignoring_amax(w.float(), dim=(-2, -1)).reshape(-1) for w in ws])


def nvfp4_qdq_group(ws: Sequence[torch.Tensor], amax: torch.Tensor, dtype: torch.dtype,
                    tile: tuple[int, int] = (1, 16)) -> torch.Tensor:
    """``[G, *shape]``: the canonical NVFP4 quantize-dequantize of ``w.to(dtype)`` for every weight of a
    group, expert e of weight g with the global amax ``amax[g, e]`` (``slice_amax`` of the cast weights);
    Triton: one launch for the group, no codes written (``quads.kernels.weight_qdq``); same bits."""
    if use_triton(*ws):
        from quads.kernels.weight_qdq import nvfp4_qdq_group as qdq
    else:
        from quads.kernels.weight_qdq import nvfp4_qdq_group_reference as qdq
    return qdq(ws, amax, dtype, tuple(tile))
