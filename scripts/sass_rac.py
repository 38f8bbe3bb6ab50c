"""Instruction counts of RAC's selection kernels (``quads.kernels.rac_select``), from their sm_90 SASS,
compiled offline (no GPU), for both selection methods at the 1b decode shapes (the sort's select kernel
also with its channels sorted in runs of ``SORT_RUNS`` merged by binary search: ``rac_units(sort_run=...)``,
constexpr ``LOG_W``; and the split runs' two kernels, a program per (expert, run) of ``SPLIT_RUNS`` channels:
``rac_units(split_runs=True)``).

    TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=. python scripts/sass_rac.py [--out FILE [--append]] [--label TEXT] [--ks 1024,256]

(``PYTHONPATH=/tmp/t36:.`` compiles with another Triton, e.g. ``pip install --target /tmp/t36 --no-deps
triton==3.6.0``, the H200 runs' version.)

Compiles each kernel with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (Triton's bundled ptxas)
with the constexprs and ``num_warps`` that ``rac_select.rac_units`` launches it with at K, and prints per
kernel: static SASS instructions, registers, shared memory, local-memory (spill) instructions, the
backward branches' loop bodies, the opcode histogram, and an ESTIMATE of the warp-instructions one
expert costs at the 1b decode shape (M = 1024 rows over E = 64 experts, 16 rows each, n = K/2):
``sort``'s select kernel: its static count x warps (the bitonic network is unrolled; each loop, the row
loop included, counted once); ``count``'s rank kernel: (its longest loop body, the compares inside the
block, x ``BLOCK_C / BLOCK_J`` trips + the next longest, the compares with the other channels, x
``(K - BLOCK_C) / BLOCK_J`` trips) x ``K / BLOCK_C`` programs x warps. Static counts are not timings:
the GPU bench decides.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_w4a16 import add_output_args, write_rows  # noqa: E402

from quads.kernels import rac_select as rs  # noqa: E402

ROWS_PER_EXPERT, M = 16, 1024  # the 1b decode shape of bench_kernels.py --only rac: 128 tokens x top-8 / 64 experts
SELECT_SIG = {"r_ptr": "*fp32", "group_ptr": "*i64", "s_ptr": "*i64", "rank_ptr": "*i32", "gmax_ptr": "*fp32",
              "sk_ptr": "*i64", "si_ptr": "*i32", "M": "i32", "K": "i32", "n": "i32", "G": "i32"}  # fmt: skip
SORT_RUNS = (None, 256, 128, 64)  # the select kernel's sorted runs (rac_units' sort_run; None: one run of all K)
SPLIT_RUNS = (256, 128, 64)  # the runs of rac_units(split_runs=True): a program per (group, run), two launches
RUN_SORT_SIG = {"r_ptr": "*fp32", "group_ptr": "*i64", "sk_ptr": "*i64", "si_ptr": "*i32", "cmax_ptr": "*fp32",
                "M": "i32", "K": "i32"}  # fmt: skip
RUN_RANK_SIG = {"r_ptr": "*fp32", "group_ptr": "*i64", "sk_ptr": "*i64", "si_ptr": "*i32", "cmax_ptr": "*fp32",
                "s_ptr": "*i64", "rank_ptr": "*i32", "gmax_ptr": "*fp32", "M": "i32", "K": "i32", "n": "i32",
                "G": "i32"}  # fmt: skip
UNITS_SEL_SIG = {"r_ptr": "*fp32", "group_ptr": "*i64", "s_ptr": "*i64", "rank_ptr": "*i32", "gmax_ptr": "*fp32",
                 "u_ptr": "*bf16", "g_ptr": "*fp32", "M": "i32", "K": "i32", "n": "i32", "G": "i32",
                 "stride_um": "i32"}  # fmt: skip
NORMS_SIG = {"r_ptr": "*fp32", "group_ptr": "*i64", "norms_ptr": "*fp64", "cmax_ptr": "*fp32", "M": "i32", "K": "i32"}
RANK_SIG = {"norms_ptr": "*fp64", "rank_ptr": "*i32", "s_ptr": "*i64", "K": "i32", "n": "i32"}
UNITS_SIG = {"r_ptr": "*fp32", "group_ptr": "*i64", "s_ptr": "*i64", "rank_ptr": "*i32", "cmax_ptr": "*fp32",
             "u_ptr": "*bf16", "g_ptr": "*fp32", "M": "i32", "K": "i32", "n": "i32", "G": "i32", "stride_um": "i32"}


def cases(k: int) -> list[tuple]:
    """(method, name, kernel, signature, constexprs, num_warps, EXACT) as ``rac_units`` launches them at K
    (per-group scales, grouped rows)."""
    kp = triton.next_power_of_2(k)
    n = k // 2
    bn = max(16, triton.next_power_of_2(n))
    bc = min(128, kp)
    select = [
        ("sort", "_rac_select_kernel", rs._rac_select_kernel, SELECT_SIG,
         {"ONE_GROUP": False, "PER_TOKEN": False, "ROWS": max(1, min(8, 4096 // kp)),
          "BLOCK_G": min(2048, triton.next_power_of_2(M)), "LOG_K": kp.bit_length() - 1,
          "LOG_W": 0 if run is None else (kp // run).bit_length() - 1, "INTERP": False},
         max(4, min(16, kp // 128)), False)
        for run in SORT_RUNS if run is None or run < kp
    ]  # fmt: skip
    for run in (r for r in SPLIT_RUNS if r < kp):  # rac_units(split_runs=True, sort_run=run), its default warps
        common = {"ONE_GROUP": False, "PER_TOKEN": False, "BLOCK_G": min(2048, triton.next_power_of_2(M)),
                  "LOG_K": kp.bit_length() - 1, "LOG_L": run.bit_length() - 1}
        warps = max(2, min(8, run // 64))
        select += [
            ("split", "_rac_run_sort_kernel", rs._rac_run_sort_kernel, RUN_SORT_SIG,
             {**common, "ROWS": max(1, min(8, 4096 // kp)), "INTERP": False}, warps, False),
            ("split", "_rac_run_rank_kernel", rs._rac_run_rank_kernel, RUN_RANK_SIG, common, warps, False),
        ]  # fmt: skip
    return select + [
        ("sort", "_rac_units_sel_kernel", rs._rac_units_sel_kernel, UNITS_SEL_SIG,
         {"ONE_GROUP": False, "PER_TOKEN": False, "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": min(kp, 1024),
          "GMAX_PARTS": 1}, 4 if bn <= 1024 else 8, True),
        ("count", "_rac_norms_kernel", rs._rac_norms_kernel, NORMS_SIG,
         {"ONE_GROUP": False, "ROWS": 4, "BLOCK_C": bc}, 4, False),
        ("count", "_rac_rank_kernel", rs._rac_rank_kernel, RANK_SIG, {"BLOCK_C": bc, "BLOCK_J": min(64, bc)}, 4, False),
        ("count", "_rac_units_kernel", rs._rac_units_kernel, UNITS_SIG,
         {"ONE_GROUP": False, "PER_TOKEN": False, "BLOCK_M": 16, "BLOCK_K": max(16, min(128, triton.next_power_of_2(n)))},
         4, True),
    ]  # fmt: skip


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True).stdout


def compile_case(fn, sig: dict, consts: dict, warps: int, exact: bool):
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    opts = {"num_warps": warps, **({"enable_fp_fusion": False} if exact else {})}
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return k, time.time() - t0


def instructions(sass: str) -> list[str]:
    """The instruction lines of ``cuobjdump -sass`` output (``/*addr*/ OPCODE ...;``), without the address."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]+;)", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(ins: list[tuple[int, str]]) -> list[int]:
    """Instructions in the body of each backward branch (``BRA`` to a lower address), longest first."""
    addr = {a: i for i, (a, _) in enumerate(ins)}
    bodies = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA(?:\.\w+)*\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in addr:
            bodies.append(i + 1 - addr[int(m.group(1), 16)])
    return sorted(bodies, reverse=True)


def estimate(name: str, consts: dict, warps: int, static: int, bodies: list[int], k: int) -> int | None:
    """Warp-instructions per expert at the 1b decode shape (module docstring): an estimate."""
    kp = triton.next_power_of_2(k)
    if name == "_rac_select_kernel":
        return static * warps
    if name in ("_rac_run_sort_kernel", "_rac_run_rank_kernel"):  # one program per run: KP / L of them per expert
        return static * warps * (kp >> consts["LOG_L"])
    if name == "_rac_rank_kernel" and len(bodies) >= 2:
        bc, bj = consts["BLOCK_C"], consts["BLOCK_J"]
        per_program = bodies[0] * (bc // bj) + bodies[1] * ((kp - bc) // bj)  # the block's own j, then the others
        return per_program * (kp // bc) * warps
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap)
    ap.add_argument("--ks", default="1024,256,4096", help="comma list of K (1b: gate_up 1024, down 256)")
    args = ap.parse_args(argv)
    rows = []
    for k in [int(v) for v in args.ks.split(",")]:
        for method, name, fn, sig, consts, warps, exact in cases(k):
            kern, secs = compile_case(fn, sig, consts, warps, exact)
            ins = instructions(_cuobjdump(kern.asm["cubin"], "-sass"))
            res = _cuobjdump(kern.asm["cubin"], "-res-usage")
            reg = re.search(r"REG:(\d+)", res)
            shared = re.search(r"SHARED:(\d+)", res)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split(" ")[0].rstrip(";") for _, t in ins)
            bodies = loops(ins)
            spills = sum(1 for _, t in ins if re.search(r"\b(STL|LDL)", t))
            est = estimate(name, consts, warps, len(ins), bodies, k)
            row = {**({"code": args.label} if args.label else {}), "K": k, "method": method, "kernel": name,
                   "constexprs": consts, "warps": warps, "compile_s": round(secs, 1), "static_instructions": len(ins),
                   "registers": int(reg.group(1)) if reg else None, "shared_bytes": int(shared.group(1)) if shared else None,
                   "local_memory_instructions": spills, "loop_bodies": bodies[:6], "est_warp_instructions_per_expert": est,
                   "opcodes": dict(ops.most_common(24))}  # fmt: skip
            rows.append(row)
            print(f"K={k} {method:5s} {name:22s} warps={warps:2d}: {len(ins):6d} static SASS instructions, "
                  f"{row['registers']} registers, {row['shared_bytes']} B shared, {spills} local-memory instructions, "
                  f"loops {bodies[:6]}, est. {est} warp-instructions per expert, compiled in {secs:.1f} s")  # fmt: skip
            sync = {k: sum(c for o, c in ops.items() if o.startswith(k)) for k in ("BAR", "SHFL", "LDS", "STS", "LDG")}
            row["sync_opcodes"] = sync
            print("   ", ", ".join(f"{o} {c}" for o, c in ops.most_common(14)), "| by prefix:", sync)
    print("triton", triton.__version__)
    write_rows(args.out, rows, args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
