"""The CUDA grouped W4A16 decode kernel (``csrc/w4a16_grouped.cuh``), built on first use, beside the Triton one.

``w4a16.grouped_gemm`` runs it when its launch config says ``backend: cuda`` (``tuning.json``
``w4a16_grouped_gemm.decode``, or the explicit argument) and ``supports`` holds; the Triton kernel
(``w4a16._grouped_kernel``) and ``w4a16.grouped_gemm_reference`` stay the references it is tested against
(tests/test_kernels_w4a16_cuda.py, GPU only). Same operand values bit for bit (the decode is ``_decode_pairs``',
with the table built from two roundings where that is exact, see the header), fp32 accumulation on the tensor
cores in another order, one BF16 rounding of the output: within the GEMMs' documented tolerance of the Triton
kernel.

Why a CUDA kernel: the Triton kernel spends 8.8 SASS instructions per weight (run 25, Nsight Compute), much of
it on the decoded tile's round trip through shared memory into ``tl.dot``'s operand layout; here the decode
writes the tensor cores' A fragment in registers (the weights are the A operand, out^T is computed) and the
activations' B fragments are their rows as loaded: 3.4-4.5 instructions per weight in the K loop, compiled
offline (``scripts/sass_w4a16_cuda.py``).

Built by ``cuda_build`` (``torch.utils.cpp_extension.load``: nvcc and ninja, on the device's image) for the current
GPU's architecture, sm_89 or newer (the E4M3 convert); the build directory is PyTorch's extension cache. Ops:
``torch.ops.quads_cuda.w4a16_grouped_decode`` and ``torch.ops.quads_cuda.w4a16_decode`` (the decode alone, for
tests).
"""

from __future__ import annotations

import torch

from quads.kernels import cuda_build

# the template instantiations compiled into the extension (w4a16_grouped.cu, the same list): (feature groups of 16
# per warp, row tiles of 8 per pass, warps per block, warps sharing a feature group's K); runs 28-29 timed and
# tested the ksplit 1 ones
CONFIGS = ((1, 2, 4, 1), (2, 1, 4, 1), (2, 2, 4, 1), (2, 4, 4, 1), (4, 2, 4, 1), (2, 2, 8, 1),
           (2, 1, 4, 4), (2, 2, 4, 4), (2, 4, 4, 4), (1, 4, 4, 4), (2, 2, 4, 2), (2, 4, 8, 4))


def rows_per_pass(rows: int, experts: int, ng: int, warps: int, ksplit: int) -> int:
    """Row tiles of 8 per pass over K (``nt``) when the config leaves it null: the fewest that hold 1.5x the mean
    rows per expert (most experts in one pass: each further pass decodes the expert's weights again), among the
    compiled 1, 2, 4 (run 28: 32 rows per pass at the 1b decode's ~16 rows per expert, 8 at Qwen3's <= 4)."""
    want = -(-3 * rows // (2 * 8 * max(experts, 1)))
    for nt in (1, 2, 4):
        if nt >= want and (ng, nt, warps, ksplit) in CONFIGS:
            return nt
    return max((c[1] for c in CONFIGS if (c[0], c[2], c[3]) == (ng, warps, ksplit)), default=1)


def available(device: torch.device | None = None) -> bool:
    """A CUDA GPU of compute capability >= 8.9 (the E4M3 convert) and a CUDA compiler for the build."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9) and cuda_build.compiler_available()


def build() -> None:
    """Compile and load the extension once per process (``cuda_build.build``)."""
    cuda_build.build("w4a16", "w4a16_grouped.cu")


def supports(x: torch.Tensor, n: int, k: int, ng: int, warps: int, ksplit: int = 1) -> bool:
    """Whether the kernel takes these operands: BF16 rows on a capable GPU, K a multiple of 64 (no padding
    columns), N a multiple of the block's 16 ng (warps / ksplit) features, rows 16-byte aligned."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and k % 64 == 0 and n % (16 * ng * (warps // ksplit)) == 0
            and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and available(x.device))  # fmt: skip


def grouped_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                 ends: torch.Tensor, n: int, k: int, *, ng: int, nt: int, warps: int, ksplit: int = 1) -> torch.Tensor:
    """``w4a16.grouped_gemm``'s product on the CUDA kernel: BF16 ``x`` [T, K] sorted by expert, the packed
    weight's tensors, ``ends`` int32 [E] on the device -> BF16 [T, N] (rows past ``ends[E-1]`` zero)."""
    if (ng, nt, warps, ksplit) not in CONFIGS:
        raise ValueError(f"w4a16_cuda.grouped_gemm: (ng, nt, warps, ksplit) must be one of {CONFIGS}, got "
                         f"{(ng, nt, warps, ksplit)}")
    build()
    return torch.ops.quads_cuda.w4a16_grouped_decode(x, codes, scales, global_scale, ends, n, k, ng, nt, warps, ksplit)


def decode(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The kernel's decode alone: the packed stack's BF16 weight [E, N, Kp] (``w4a16.dequantize``'s values)."""
    build()
    return torch.ops.quads_cuda.w4a16_decode(codes, scales, global_scale)
