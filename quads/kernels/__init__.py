"""Triton kernels for NVFP4 on Hopper, each beside the pure-PyTorch reference it matches.

- ``_common.py``: exact E4M3/E2M1/BF16 rounding and decoding helpers (jit), shared by the kernels.
- ``nvfp4_quant.py``: NVFP4 quantize (1x16 / 16x16, per tensor / token / expert, linear or swizzled
  scales) and dequantize; bit-exact with ``quads.formats.nvfp4``.
- ``rac.py``: fused RAC quantize (X, residual channel selection, residual); bit-exact with
  ``quads.quant.rac``.
- ``gemm.py``: W4A16 GEMM (split-K), grouped MoE W4A16, emulated W4A4 (+RAC) GEMM.
- ``dispatch.py``: what the quant layers call; Triton on CUDA, references elsewhere
  (``QUADS_KERNELS=auto|triton|reference``).
"""
