"""Session-wide test set-up.

Without a GPU, Triton kernels run under Triton's CPU interpreter. Triton reads ``TRITON_INTERPRET``
when a kernel is decorated, so it must be set before any test module (or a module it imports) loads
``quads.kernels``: under pytest-xdist a worker may import the kernels from another test file first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
