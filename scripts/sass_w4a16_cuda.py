"""Instruction counts of the CUDA grouped W4A16 decode kernel (``quads/kernels/csrc/w4a16_grouped.cuh``) for sm_90,
compiled offline, with no GPU and no nvcc:

    PYTHONPATH=. python scripts/sass_w4a16_cuda.py [--out FILE [--append]] [--label TEXT] [--clang clang-14]

The header is compiled by clang (``-x cuda --cuda-device-only``, its ``QUADS_OFFLINE_SASS`` branch: no CUDA
headers) to PTX for sm_80, the PTX retargeted to sm_90 (PTX ISA 7.8, for the E4M3 convert), assembled by
the ``ptxas`` Triton bundles and disassembled by ``triton.tools.disasm``. The device build uses nvcc (NVVM), whose
code differs in detail, so these counts estimate the kernel's; the registers ptxas reports, likewise. Per
template case (NG feature groups of 16 per warp, NT row tiles of 8, WARPS per block) it prints the K loop (the
shortest backward branch holding the MMAs; the loop is unrolled by two K tiles, so its body covers 2 x 64
columns), compiled without the decode's rare branches (``QUADS_SASS_FAST_PATH``: the table of a block whose
products are subnormal, overflow, NaN or zero; what every block of a real weight runs), the weights one lane
decodes in it (2 tiles x 2 features x 16 x NG), their ratio, the opcode histogram and the registers (of the
full kernel, rare branches included),
against ``scripts/sass_w4a16.py``'s counts for the Triton kernel (8.8 per weight for the whole kernel, 5.2-5.5
in its K loop, run 25's Nsight Compute: 9.20 M warp instructions for 33.5 M weights).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_w4a16 import add_output_args, k_loop, write_rows  # noqa: E402

from quads.kernels import w4a16_cuda  # noqa: E402

HEADER = Path(__file__).resolve().parents[1] / "quads" / "kernels" / "csrc" / "w4a16_grouped.cuh"
SIG = "const uint32_t*, const uint32_t*, const uint32_t*, const float*, const int*, uint32_t*, int, int, int, int, long long"
CASES = [c for c in w4a16_cuda.CONFIGS if c[2] == 4]  # (NG, NT, WARPS, KSPLIT): instantiations the extension builds


def compile_case(ng: int, nt: int, warps: int, ksplit: int, clang: str, fast_path: bool = False) -> tuple[str, int | None, str]:
    """(SASS text, registers, ptxas log) of one instantiation (``fast_path``: without the decode's rare branches)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        src, ptx, cubin = (os.path.join(d, n) for n in ("k.cu", "k.ptx", "k.cubin"))
        fast = "#define QUADS_SASS_FAST_PATH 1\n" if fast_path else ""
        Path(src).write_text(f'#define QUADS_OFFLINE_SASS 1\n{fast}#include "{HEADER}"\n'
                             f"template __global__ void quads_w4a16::grouped_decode_kernel<{ng}, {nt}, {warps}, {ksplit}>({SIG});\n")
        subprocess.run([clang, "-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_80", "-nocudainc", "-nocudalib",
                        "-O3", "-Wno-unknown-cuda-version", "-S", "-o", ptx, src], check=True, capture_output=True)
        text = Path(ptx).read_text()
        text = re.sub(r"^\.version .*$", ".version 7.8", text, flags=re.M)
        Path(ptx).write_text(re.sub(r"^\.target sm_80", ".target sm_90", text, flags=re.M))
        log = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90", "-v", "-o", cubin, ptx], check=True,
                             capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", log)
        from triton.tools.disasm import get_sass

        return get_sass(Path(cubin).read_bytes()), int(regs.group(1)) if regs else None, log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap)
    ap.add_argument("--clang", default="clang-14", help="a clang with the NVPTX target (Debian: apt install clang-14)")
    args = ap.parse_args(argv)
    rows = []
    for ng, nt, warps, ksplit in CASES:
        full, regs, _ = compile_case(ng, nt, warps, ksplit, args.clang)
        sass = compile_case(ng, nt, warps, ksplit, args.clang, fast_path=True)[0]
        body = k_loop(sass, "HMMA")
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split(" ")[0] for i in body)
        weights = 2 * 2 * 16 * ng  # two K tiles per loop trip, two 16-weight blocks per feature group each
        spills = len(re.findall(r"\b(STL|LDL)\b", full))
        row = {**({"code": args.label} if args.label else {}), "kernel": "cuda_grouped_decode", "ng": ng, "nt": nt,
               "warps": warps, "ksplit": ksplit, "k_loop_instructions": len(body), "weights_per_lane": weights,
               "k_loop_instructions_per_weight": round(len(body) / weights, 2), "registers": regs,
               "local_memory_instructions": spills, "opcodes": dict(ops.most_common())}  # fmt: skip
        rows.append(row)
        print(f"NG={ng} NT={nt} warps={warps} ksplit={ksplit}: K loop {len(body)} instructions for {weights} weights per lane = "
              f"{len(body) / weights:.2f} per weight; {regs} registers, {spills} local-memory instructions")
        print("   ", ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    print("triton", triton.__version__, "(its ptxas and disassembler)")
    write_rows(args.out, rows, args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
