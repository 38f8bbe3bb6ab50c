"""Triton kernels for NVFP4 on Hopper, each beside the pure-PyTorch reference it matches.

- ``dispatch.py``: what the quant layers call; Triton on CUDA, references elsewhere. The backend
  (auto | triton | reference) is ``TrainConfig.kernels``, recorded in the run's ``config.yaml``.
- ``nvfp4_quant.py``: NVFP4 quantize (1x16 / 16x16, per tensor / token / expert, linear or swizzled
  scales) and dequantize; bit-exact with ``quads.formats.nvfp4``.
- ``w4a16.py``: the W4A16 GEMMs (dense and grouped MoE) over NVFP4 weights in a pre-shuffled packed
  layout built at weight-sync time; the rollout's W4A16 layers call them on CUDA.
- ``w4a16_cuda.py`` + ``csrc/``: the grouped W4A16 decode kernel in CUDA (the decode written straight into the
  tensor cores' operand registers), built with nvcc on first use; ``tuning.json``'s grouped ``backend: cuda``
  selects it (the Triton kernel is the default; a weight-shape entry picks CUDA where it measured faster,
  Qwen3-30B-A3B's gate_up, docs/PERF.md).
- ``decode_attention.py``: the rollout's decode-step attention over a fixed-shape KV cache that reads only
  the columns written so far (the engine's default on CUDA: ``RolloutEngine(decode_attention="auto")``).
- ``_common.py``: exact E4M3/E2M1/BF16 rounding and decoding helpers (jit), shared by the kernels.
- ``tuning.py`` + ``tuning.json``: the launch configs, a data file the launchers read.
- ``prototype/``: the W4A4 GEMM and fused-RAC kernels that only tests and benchmarks call so far (the base of
  the fast-kernel work); nothing in the product imports them.
"""
