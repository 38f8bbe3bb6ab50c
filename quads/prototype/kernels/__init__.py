"""Kernels that the product path does not call yet: the base of the fast-kernel work (issue 18).

Nothing outside ``quads.prototype.kernels``, tests and benchmarks imports these modules; the rollout
and the trainer emulate their GEMMs in PyTorch (``quads.quant``). They are kept, each beside the
reference it matches and checked by ``tests/test_kernels.py`` (CPU interpreter and H200), because the
fast kernels start from them and are measured against them (docs/PERF.md):

- ``gemm.py``: the emulated W4A4 (+RAC) GEMM, the verified version measured in docs/PERF.md runs 4-6
  (the W4A16 GEMMs moved to the product as ``quads.kernels.w4a16``).
- ``rac.py``: fused RAC quantize (X, residual channel selection, residual), bit-exact with
  ``quads.quant.rac``.
- ``linear.py``: the linear-layer entry points over them (Triton on CUDA, references elsewhere, under
  the ``quads.kernels.dispatch`` backend).
"""
