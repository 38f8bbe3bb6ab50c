"""The build of quads' CUDA extensions (``csrc/``): nvcc through ``torch.utils.cpp_extension.load``, for the current
GPU's architecture, on first use in a process; PyTorch's extension cache keeps the build between processes."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")


def compiler_available() -> bool:
    """Whether PyTorch finds a CUDA toolkit (nvcc) to build with."""
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


@functools.cache
def build(name: str, source: str) -> None:
    """Compile and load ``csrc/<source>`` as the extension ``quads_cuda_<name>_sm<arch>`` once per process (raises
    with nvcc's output if the build fails); its ops register themselves under ``torch.ops``."""
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    load(name=f"quads_cuda_{name}_sm{arch}", sources=[str(CSRC / source)], extra_include_paths=[str(CSRC)],
         extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-std=c++17"],
         is_python_module=False, verbose=False)  # fmt: skip


@functools.cache
def try_build(name: str, source: str) -> bool:
    """``build``, for a kernel with a Triton twin that computes the same bits: False (and one warning with the
    compiler's error) where the build fails, e.g. an nvcc that does not match PyTorch's CUDA, so that the caller
    runs the Triton kernel instead of failing."""
    try:
        build(name, source)
    except Exception as err:  # noqa: BLE001 - any build or load failure means: use the Triton kernel
        warnings.warn(f"quads: the CUDA extension {name} ({source}) did not build, so its Triton twin runs "
                      f"instead: {err}", RuntimeWarning, stacklevel=2)  # fmt: skip
        return False
    return True
