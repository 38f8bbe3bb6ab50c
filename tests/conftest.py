"""Session-wide test set-up.

Without a GPU, Triton kernels run under Triton's CPU interpreter. Triton reads ``TRITON_INTERPRET``
when a kernel is decorated, so it must be set before any test module (or a module it imports) loads
``quads.kernels``: under pytest-xdist a worker may import the kernels from another test file first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker is one process per core: one torch thread each, so that two
# workers' OpenMP pools do not oversubscribe the cores (spin-waiting pools slow each other down
# by far more than the lost intra-op parallelism).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Under CI (CI=true) property tests draw the same examples on every run, so a red CI always names a
# reproducible input and never comes from a new random draw; a local run keeps exploring new ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
