"""CUDA kernel code built for the host, for CPU tests: g++ on ``tests/csrc/*.cpp`` (no FMA contraction), loaded with
ctypes. ``nvfp4_cast_host.cpp``: the kernels' per-element NVFP4 cast (``quads/kernels/csrc/nvfp4_cast.cuh``);
``rac_kernels_host.cpp``: RAC's CUDA kernels themselves (``rac_operand.cuh``, ``rac_select.cuh``) on
``cuda_host_shim.h``, which runs a block's threads as std::threads with its barriers and warp shuffles emulated.
A test that needs one skips where no host C++ compiler is installed."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from quads.kernels import cuda_build

CSRC = Path(__file__).parent / "csrc"


def build(source: str, out_dir: Path) -> ctypes.CDLL:
    """``tests/csrc/<source>`` as a shared library in ``out_dir``, loaded (the test skips without g++)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler (g++)")
    lib = out_dir / (Path(source).stem + ".so")
    subprocess.run([cxx, "-O1", "-std=c++20", "-pthread", "-ffp-contract=off", "-fPIC", "-shared", "-Wno-unknown-pragmas",
                    "-I", str(CSRC), "-I", str(cuda_build.CSRC), str(CSRC / source), "-o", str(lib)],
                   check=True, capture_output=True, text=True)  # fmt: skip
    return ctypes.CDLL(str(lib))


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    """A tensor's data pointer for a ctypes call (the tensor must be contiguous and stay alive for the call)."""
    return ctypes.c_void_p(t.data_ptr())
