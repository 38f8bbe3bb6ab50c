"""Instruction counts of RAC's CUDA kernels for sm_90, compiled offline with nvcc (no GPU): the selection kernel
(``quads/kernels/csrc/rac_select.cuh``) and the decode's whole operand in one launch (``rac_operand.cuh``, BF16):

    PYTHONPATH=. python scripts/sass_rac_cuda.py [--kernel select|operand|all] [--out FILE [--append]] [--label TEXT]
        [--nvcc nvcc]

Per instantiation of ``rac_select_cuda.CONFIGS`` / ``rac_operand_cuda.CONFIGS`` (log2 of the padded K, warps) it
prints the static SASS instructions, registers, shared memory, spills (local-memory instructions), and the barriers,
warp shuffles and shared-memory loads in the code (loops counted once). The Triton selection it replaces is
``scripts/sass_rac.py``'s (155 barriers in the select kernel at K = 1,024). Static counts are not timings:
``scripts/device_calls/rac_select_cuda_probe.py`` and ``rac_operand_cuda_probe.py`` time them (docs/PERF.md).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_w4a16 import add_output_args, write_rows  # noqa: E402

from quads.kernels import cuda_build, rac_operand_cuda, rac_select_cuda  # noqa: E402

BF16 = "__nv_bfloat16"
# kernel -> (header, the template's name, its extra template arguments, its parameter types, its configs)
KERNELS = {
    "select": ("rac_select.cuh", "select_kernel", "", "const float*, const long long*, long long*, int*, float*, int, "
               "int, int, bool", rac_select_cuda.CONFIGS),
    "operand": ("rac_operand.cuh", "operand_kernel", f", {BF16}, {BF16}", f"const {BF16}*, const long long*, {BF16}*, "
                "float*, float*, long long*, int, int, int, int, long long", rac_operand_cuda.CONFIGS),
}


def compile_case(kernel: str, log_kp: int, warps: int, nvcc: str) -> tuple[str, str]:
    """(SASS text, ptxas log) of one instantiation."""
    from triton.tools.disasm import get_sass

    header, name, targs, sig, _ = KERNELS[kernel]
    with tempfile.TemporaryDirectory() as d:
        src, cubin = Path(d) / "k.cu", Path(d) / "k.cubin"
        src.write_text(f'#include "{cuda_build.CSRC / header}"\n'
                       f"template __global__ void quads_rac::{name}<{log_kp}, {warps}{targs}>({sig});\n")
        log = subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(cubin),
                              str(src)], check=True, capture_output=True, text=True).stderr  # fmt: skip
        return get_sass(cubin.read_bytes()), log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap)
    ap.add_argument("--nvcc", default="nvcc", help="the CUDA compiler (CUDA 12.4 or newer, for sm_90)")
    ap.add_argument("--kernel", choices=(*KERNELS, "all"), default="all", help="which kernel's instantiations")
    args = ap.parse_args(argv)
    rows = []
    cases = [(kernel, lk, w) for kernel in KERNELS if args.kernel in (kernel, "all") for lk, w in KERNELS[kernel][4]]
    for kernel, log_kp, warps in cases:
        sass, log = compile_case(kernel, log_kp, warps, args.nvcc)
        body = [ln for ln in sass.splitlines()[1:] if "\t" in ln]
        ops = collections.Counter(ln.split("\t")[-1].split(" ")[0].rstrip(";") for ln in body)
        regs = re.search(r"Used (\d+) registers", log)
        smem = re.search(r"(\d+) bytes smem", log)
        row = {**({"code": args.label} if args.label else {}), "kernel": f"rac_{kernel}_cuda", "k_padded": 1 << log_kp,
               "warps": warps, "pairs_per_thread": (1 << log_kp) // (32 * warps), "instructions": len(body),
               "registers": int(regs.group(1)) if regs else None, "smem_bytes": int(smem.group(1)) if smem else None,
               "local_memory_instructions": sum(ops[o] for o in ops if o.split(".")[0] in ("LDL", "STL")),
               "barriers": sum(ops[o] for o in ops if o.startswith("BAR")),
               "shuffles": sum(ops[o] for o in ops if o.startswith("SHFL")),
               "shared_loads": sum(ops[o] for o in ops if o.split(".")[0] == "LDS")}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    write_rows(args.out, rows, args.append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
