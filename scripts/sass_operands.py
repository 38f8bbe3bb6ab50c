"""SASS of the W4A4 (+RAC) activation-operand kernels for sm_90, compiled offline (no GPU):

    PYTHONPATH=. python scripts/sass_operands.py [--out FILE [--append]] [--label TEXT]

Compiles, with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` in the launch configs the 1b decode step uses
(1,024 routed rows over 64 experts; K = 1,024 for gate_up), the kernels of ``factored.operands``:

- ``_quantize_units_kernel`` (grouped: ``group_units``, its group amaxes from the row maxima), and ``_gather_amax_kernel`` with
  the quantize gathering through each expert's order (``rac_static_units``), instructions per element of one pass of
  their loop body (one tile per program at the default config);
- ``_rac_select_kernel`` (RAC's selection, one program per expert: the fp64 channel norms, then the bitonic sort of
  the K (key, channel) pairs, fully unrolled) and ``_rac_units_sel_kernel`` (one row per program): instructions per
  thread, barriers and shared-memory instructions, the issue-side cost of one program.

These are static counts (each loop body once): with a program's trip counts they bound the issue time of a call
from below, the latency side is the GPU's (docs/PERF.md, "Runs 30-34").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_w4a16 import add_output_args, compile_sass, kernel_instructions, write_rows  # noqa: E402

from quads.kernels import factored_quant, rac_select  # noqa: E402

# pointer element types by argument name; the other non-constexpr arguments are i32
PTR = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "group_ptr": "*i64", "offs_ptr": "*i64", "idx_ptr": "*i64", "order_ptr": "*i64", "u_ptr": "*bf16",
       "g_ptr": "*fp32",
       "r_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8", "s_ptr": "*i64", "rank_ptr": "*i32",
       "gmax_ptr": "*fp32", "sk_ptr": "*i64", "si_ptr": "*i32"}  # fmt: skip
# i32 arguments a multiple of 16 at the 1b decode shapes, as the launcher's JIT specializes them
DIV16 = ("M", "K", "W", "n", "stride_xm", "stride_um", "stride_idx", "stride_order", "COLS")
# (what, kernel, constexprs, num_warps, elements per thread in one pass of the body or None, exact: no FMA contraction)
CASES = [
    ("quantize, grouped (group_units, 8 x 128 tile)", factored_quant._quantize_units_kernel,
     {"AMAX_BY": 4, "IDX_BY": 0, "GATHER": False, "RESIDUAL": False, "CODES": False, "BLOCK_M": 8, "BLOCK_K": 128}, 4,
     8 * 128 // 128, True),
    ("quantize, grouped, residual written (RAC's first step)", factored_quant._quantize_units_kernel,
     {"AMAX_BY": 4, "IDX_BY": 0, "GATHER": False, "RESIDUAL": True, "CODES": False, "BLOCK_M": 8, "BLOCK_K": 128}, 4,
     8 * 128 // 128, True),
    ("static RAC: gathered amax (rac_static_units, 4 rows x 256 channels a pass)", factored_quant._gather_amax_kernel,
     {"IDX_BY": 2, "AMAX_BY": 1, "BLOCK_M": 4, "BLOCK_N": 256}, 4, 4 * 256 // 128, True),
    ("static RAC: gathered quantize through the expert's order (8 x 128 tile)", factored_quant._quantize_units_kernel,
     {"AMAX_BY": 1, "IDX_BY": 2, "GATHER": True, "RESIDUAL": False, "CODES": False, "BLOCK_M": 8, "BLOCK_K": 128}, 4,
     8 * 128 // 128, True),
    ("RAC select (K 1024: norms + 4 sorted runs of 256 merged, tuning.json's k1024)", rac_select._rac_select_kernel,
     {"ONE_GROUP": False, "PER_TOKEN": False, "ROWS": 4, "BLOCK_G": 1024, "LOG_K": 10, "LOG_W": 2, "INTERP": False}, 8,
     None, False),
    ("RAC units (one row, n 512 of K 1024)", rac_select._rac_units_sel_kernel,
     {"ONE_GROUP": False, "PER_TOKEN": False, "BLOCK_M": 1, "BLOCK_N": 512, "BLOCK_K": 1024, "GMAX_PARTS": 1}, 4,
     None, True),
]  # fmt: skip


def compile_case(fn, consts: dict, warps: int, exact: bool) -> tuple[str, int | None]:
    names = [n for n in fn.arg_names if n not in consts]
    sig = {n: PTR.get(n, "i32") for n in names}
    return compile_sass(fn, sig, consts, [i for i, n in enumerate(fn.arg_names) if n in PTR or n in DIV16], warps, exact)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap)
    args = ap.parse_args(argv)
    rows = []
    for what, fn, consts, warps, per_thread, exact in CASES:
        sass, regs = compile_case(fn, consts, warps, exact)
        ins, ops = kernel_instructions(sass)
        bars = sum(v for o, v in ops.items() if o.startswith("BAR"))
        smem = sum(v for o, v in ops.items() if o.split(".")[0] in ("LDS", "STS"))
        row = {**({"code": args.label} if args.label else {}), "kernel": fn.fn.__name__, "case": what, "warps": warps,
               "constexprs": consts, "instructions": len(ins), "barriers": bars, "shared_memory_instructions": smem,
               "registers": regs, "opcodes": dict(ops.most_common())}  # fmt: skip
        if per_thread:
            row["elements_per_thread"] = per_thread
            row["instructions_per_element"] = round(len(ins) / per_thread, 2)
        rows.append(row)
        extra = f" = {len(ins) / per_thread:.1f} per element ({per_thread} a thread)" if per_thread else ""
        print(f"{what}: {len(ins)} instructions{extra}; {bars} barriers, {smem} shared-memory; {regs} registers")
        print("   ", ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    print("triton", triton.__version__)
    write_rows(args.out, rows, args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
