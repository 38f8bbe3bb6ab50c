"""RAC's channel selection as a CUDA kernel (``csrc/rac_select.cuh``), built on first use, beside the Triton one.

``rac_select.rac_units`` runs it in place of ``_rac_select_kernel`` (the sort path's first launch, one run) when its
launch config says ``select_backend: cuda`` (``tuning.json`` ``rac_select``, per padded K, or the explicit argument)
and ``supports`` holds; it writes the same ``S``, ``rank`` and ``gmax`` bit for bit, and the Triton units kernel that
follows is unchanged. The Triton kernel and the PyTorch reference (``factored.operands`` under the reference
backend) stay the references it is tested against (tests/test_rac_select_cuda.py, GPU only).

Why a CUDA kernel: the selection is one program per expert: the fp64 norms over the expert's rows, then the bitonic
sort of its K (key, channel) pairs. In Triton each compare-and-swap step of the sort is a reshape and a reduction over
a pair axis (155 barriers at K = 1,024); here the pairs stay in registers, partners up to 32 E positions apart are
exchanged by warp shuffles and only the farther ones through shared memory (``scripts/sass_rac_cuda.py``, sm_90
offline), and 16 rows' loads are in flight while the norms are summed. Its timings against the Triton selection, and
the forms tried and removed, are in docs/PERF.md (runs 79-81).

Built by ``cuda_build`` (``torch.utils.cpp_extension.load``: nvcc and ninja, on the device's image) for the current
GPU's architecture; the build directory is PyTorch's extension cache. Op: ``torch.ops.quads_rac_cuda.rac_select``.
"""

from __future__ import annotations

import torch

from quads.kernels import cuda_build

MAX_K = 1024  # the instantiations' largest padded K
EXTENSION = ("rac_select", "rac_select.cu")  # cuda_build's (name, source)
# the template instantiations compiled into the extension (rac_select.cu, the same list): (log2 of the padded K,
# warps), 2**L / (32 warps) = 1, 2, 4 or 8 pairs a thread
CONFIGS = ((5, 1), (6, 1), (6, 2), (7, 1), (7, 2), (7, 4), (8, 1), (8, 2), (8, 4), (8, 8), (9, 2), (9, 4), (9, 8),
           (9, 16), (10, 4), (10, 8), (10, 16), (10, 32))


def log_kp(k: int) -> int:
    """log2 of the padded K the kernel sorts: the next power of two, at least 32 (one warp)."""
    return max(5, (k - 1).bit_length())


def default_warps(k: int) -> int:
    """4 pairs a thread where K allows (at least one warp): 8 warps at K = 1,024, 2 at K = 256."""
    return max(1, (1 << log_kp(k)) // 128)


def available() -> bool:
    """A CUDA GPU and a CUDA compiler for the build."""
    return torch.cuda.is_available() and cuda_build.compiler_available()


def build() -> None:
    """Compile and load the extension once per process (``cuda_build.build``)."""
    cuda_build.build(*EXTENSION)


def supports(r: torch.Tensor, group: torch.Tensor | None, warps: int) -> bool:
    """Whether the kernel takes this selection: rows in groups (``group`` int64 [M]), a CUDA fp32 residual with K a
    multiple of 16 up to ``MAX_K``, 16-byte aligned, an instantiated (padded K, warps), and the extension built (a
    failed build warns once; the Triton selection, the same bits, runs instead)."""
    k = r.shape[-1]
    return (group is not None and r.is_cuda and group.dtype == torch.long and k % 16 == 0 and 0 < k <= MAX_K
            and r.data_ptr() % 16 == 0 and (log_kp(k), warps) in CONFIGS and available()
            and cuda_build.try_build(*EXTENSION))  # fmt: skip


def select(r: torch.Tensor, group: torch.Tensor, s: torch.Tensor, rank: torch.Tensor, gmax: torch.Tensor, *, n: int,
           groups: int, per_token: bool, warps: int) -> None:
    """Writes ``s`` int64 [G, n], ``rank`` int32 [G, K] and (unless ``per_token``) ``gmax`` fp32 [G], as
    ``rac_select._rac_select_kernel`` with one run (its docstring); ``r`` fp32 [M, K], ``group`` int64 [M]."""
    if (log_kp(r.shape[-1]), warps) not in CONFIGS:
        raise ValueError(f"rac_select_cuda.select: (log2 padded K, warps) must be one of {CONFIGS}, got "
                         f"{(log_kp(r.shape[-1]), warps)}")
    build()
    torch.ops.quads_rac_cuda.rac_select(r, group, s, rank, gmax, n, groups, per_token, warps)
