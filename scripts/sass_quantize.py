"""SASS instructions per element of the NVFP4 quantize kernels for sm_90, compiled offline (no GPU):

    PYTHONPATH=. python scripts/sass_quantize.py [--out FILE [--append]] [--label TEXT]

Compiles ``quads.kernels.nvfp4_quant._nvfp4_quantize_tile_kernel`` (one tile per program, no loop: the whole
kernel runs once per tile) with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` in the launcher's configs
(per token with the row amax in registers, and with a given amax; bf16 input, linear scales, no FMA contraction as
the launcher's ``EXACT``), and prints its instructions per element (the kernel's instruction count over the
elements one thread quantizes), registers and the opcode histogram: the issue-rate side of issue 18's quantize
target (3.0 TB/s needs about 16 instructions per element at the H200's issue rate, docs/PERF.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_w4a16 import add_output_args, compile_sass, kernel_instructions, write_rows  # noqa: E402

from quads.kernels import nvfp4_quant  # noqa: E402

SIG = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8", "sdec_ptr": "*fp32", "M": "i32",
       "K": "i32", "stride_xm": "i32", "stride_amax": "i32", "R": "i32", "Rp": "i32", "Cp": "i32"}  # fmt: skip
CASES = [  # (what, PER_ROW_AMAX, BLOCK_M, BLOCK_K, num_warps): the launcher's per-token tile (whole rows) and amax-known
    ("per token, K 8192", True, 1, 8192, 4),
    ("per token, K 4096", True, 1, 4096, 4),
    ("amax known", False, 1, 2048, 8),
]


def compile_case(per_row: bool, bm: int, bk: int, warps: int) -> tuple[str, int | None]:
    consts = {"PER_ROW_AMAX": per_row, "TILE16": False, "SWIZZLE": False, "BLOCK_M": bm, "BLOCK_K": bk}
    div = [i for i, (n, t) in enumerate(SIG.items()) if t.startswith("*") or n in ("K", "stride_xm")]
    return compile_sass(nvfp4_quant._nvfp4_quantize_tile_kernel, SIG, consts, div, warps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap)
    args = ap.parse_args(argv)
    rows = []
    for what, per_row, bm, bk, warps in CASES:
        sass, regs = compile_case(per_row, bm, bk, warps)
        ins, ops = kernel_instructions(sass)
        per_thread = bm * bk // (32 * warps)
        row = {**({"code": args.label} if args.label else {}), "kernel": "nvfp4_quantize_tile", "case": what,
               "block_m": bm, "block_k": bk, "warps": warps, "instructions": len(ins), "elements_per_thread": per_thread,
               "instructions_per_element": round(len(ins) / per_thread, 2), "registers": regs,
               "opcodes": dict(ops.most_common())}  # fmt: skip
        rows.append(row)
        print(f"{what}: {len(ins)} instructions for {per_thread} elements per thread = {len(ins) / per_thread:.1f} per "
              f"element; {regs} registers")
        print("   ", ", ".join(f"{k} {v}" for k, v in ops.most_common(18)))
    print("triton", triton.__version__)
    write_rows(args.out, rows, args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
