"""Instruction counts of the W4A16 GEMM kernels' K loop, from their sm_90 SASS, compiled offline (no GPU).

    TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=. python scripts/sass_w4a16.py [--out FILE [--append]] [--label TEXT] [--kernels gemm,grouped,gemv]

(``PYTHONPATH`` may point at another checkout's tree, e.g. ``git archive REV quads | tar -x -C DIR``, to
compile an older version of the kernels with this script.)

Compiles ``quads.kernels.w4a16._gemm_kernel``, ``_gemv_kernel`` and ``_grouped_kernel`` with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` (Triton's bundled ptxas; the pointer, N, K, KT and row-stride arguments
marked divisible by 16, as Triton's launcher specializes them for the benchmark's shapes), finds the
longest loop (the body of the longest backward branch) and the K loop (the shortest one that holds the
MMAs, in the GEMV kernel the FFMAs; the same loop in the dense kernels, in the grouped kernel the longest one is the loop over an
expert's M tiles, which also holds the K loop's prologue and the tile's epilogue), and prints per config:
the loops' instructions, the weight elements each thread decodes per K step, their ratio, the K loop's
global loads (per thread and K step: the loads one thread has in flight at once, by width), registers
and shared memory per block with the blocks and warps that fit on one SM (``resident``; an 8th case field
caps the registers, PTX ``.maxnreg``, as ``w4a16.grouped_gemm(max_registers=...)`` does; a 9th the
grouped kernel's ``sub_k``) and the
longest loop's opcode histogram.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quads.kernels import w4a16

GEMM_SIG = {"x_ptr": "*bf16", "c_ptr": "*i32", "s_ptr": "*i32", "g_ptr": "*fp32", "out_ptr": "*bf16",
            "ws_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "KT": "i32", "stride_xm": "i32"}  # fmt: skip
GROUPED_SIG = {"x_ptr": "*bf16", "rows_ptr": "*i64", "c_ptr": "*i32", "s_ptr": "*i32", "g_ptr": "*fp32",
               "ends_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "scale_ptr": "*bf16", "T": "i32", "N": "i32",
               "K": "i32", "KT": "i32", "E": "i32", "stride_xm": "i32"}  # fmt: skip
CASES = [  # (kernel, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, register cap[, sub_k]]): tuning.json's decode
    # configs first (dense M <= 16; grouped at the 1b decode step and at T=1 on E=128), then neighbours
    ("gemm", 16, 32, 256, 1, 4, 3),
    ("gemm", 16, 32, 256, 2, 4, 3),
    ("grouped", 32, 64, 128, 1, 4, 3),  # the 1b decode step (tuning.json decode, block_m 32 at 16 rows per expert)
    ("grouped", 16, 64, 128, 4, 4, 3),  # T = 1 on E = 128
    ("gemm", 16, 64, 256, 1, 4, 3),
    ("gemm", 16, 128, 128, 1, 4, 3),
    ("gemm", 16, 32, 256, 1, 4, 3, None, 64),  # the K tile in parts of 64 columns (sub_k)
    ("gemm", 16, 64, 256, 1, 4, 3, None, 64),
    ("gemm", 16, 64, 256, 1, 4, 2, None, 64),
    ("gemm", 16, 128, 128, 1, 4, 3, None, 64),
    ("grouped", 32, 64, 256, 1, 8, 3),
    ("grouped", 32, 64, 256, 1, 4, 3),
    # occupancy candidates for the 1b decode step (Nsight Compute: 225 registers, 2 blocks of 4 warps per
    # SM): half the decoded tile, fewer stages, more warps, a smaller M or N tile, a register cap (8th field)
    ("grouped", 32, 64, 64, 1, 4, 3),
    ("grouped", 32, 64, 64, 1, 4, 2),
    ("grouped", 32, 64, 128, 1, 4, 2),
    ("grouped", 32, 64, 128, 1, 8, 3),
    ("grouped", 32, 64, 64, 1, 8, 2),
    ("grouped", 16, 64, 128, 1, 4, 3),
    ("grouped", 32, 32, 128, 1, 4, 3),
    ("grouped", 32, 64, 128, 1, 4, 3, 168),
    ("grouped", 32, 64, 128, 1, 4, 3, 128),
    ("grouped", 32, 64, 64, 1, 4, 3, 128),
    # the K tile decoded and multiplied 64 columns at a time (9th field: sub_k)
    ("grouped", 32, 64, 128, 1, 4, 3, None, 64),
    ("grouped", 32, 64, 128, 1, 4, 2, None, 64),
    ("grouped", 32, 64, 256, 1, 4, 3, None, 64),
    ("grouped", 32, 64, 256, 1, 4, 2, None, 64),
    ("grouped", 32, 64, 128, 1, 8, 3, None, 64),
    # the GEMV kernel (tuning.json w4a16_gemv.small) at M = 1, 2, 4, 8, 16, then neighbours
    ("gemv", 1, 128, 64, 8, 4, 1),
    ("gemv", 2, 128, 64, 8, 4, 1),
    ("gemv", 4, 128, 64, 8, 4, 1),
    ("gemv", 8, 128, 64, 8, 4, 1),
    ("gemv", 16, 128, 64, 8, 4, 1),
    ("gemv", 1, 256, 64, 8, 4, 1),
    ("gemv", 4, 256, 64, 8, 4, 1),
    ("gemv", 1, 128, 128, 8, 4, 1),
    ("gemv", 1, 256, 64, 8, 8, 1),
]


def sass_of(kernel: str, bm: int, bn: int, bk: int, split: int, warps: int, stages: int, maxnreg: int | None = None,
            sub_k: int | None = None) -> str:
    fn, sig = {"gemm": (w4a16._gemm_kernel, GEMM_SIG), "gemv": (w4a16._gemv_kernel, GEMM_SIG),
               "grouped": (w4a16._grouped_kernel, GROUPED_SIG)}[kernel]  # fmt: skip
    div = [i for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n in ("N", "K", "KT", "stride_xm")]
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "EVEN_K": True, "INTERP": False,
              **({"SUB_K": sub_k or bk} if kernel in ("grouped", "gemm") else {}),
              **({"GATHER": False, "SCALE": False} if kernel == "grouped" else {})}  # fmt: skip
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})  # fmt: skip
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    key = (kernel, bm, bn, bk, split, warps, stages, *((maxnreg, sub_k) if sub_k else (maxnreg,) if maxnreg else ()))
    REGISTERS[key] = registers_of(k.asm["cubin"])
    SHARED[key] = k.metadata.shared
    if "sass" in k.asm:
        return k.asm["sass"]
    from triton.tools.disasm import get_sass

    return get_sass(k.asm["cubin"])


REGISTERS: dict[tuple, int | None] = {}  # registers per thread of each compiled case (cuobjdump -res-usage)
SHARED: dict[tuple, int] = {}  # shared memory per block (bytes) of each compiled case


def resident(regs: int | None, warps: int, shared: int) -> dict:
    """Blocks of ``warps`` warps resident per sm_90 SM, by each limit: registers (64K per SM in 4 schedulers
    of 16K; a warp takes its registers in units of 256, i.e. per thread rounded up to 8), shared memory
    (228 KiB per SM, 1 KiB per block kept by the driver, at the largest carveout), 64 warps, 32 blocks."""
    if regs is None:
        return {}
    per_warp = -(-regs // 8) * 8 * 32
    by_regs = (16384 // per_warp) * 4 // warps
    by_smem = 233472 // (shared + 1024)
    blocks = min(by_regs, by_smem, 64 // warps, 32)
    return {"blocks_by_registers": by_regs, "blocks_by_shared": by_smem, "blocks_per_sm": blocks,
            "warps_per_sm": blocks * warps}  # fmt: skip


def registers_of(cubin: bytes) -> int | None:
    """Registers per thread of a cubin, from the ``cuobjdump`` bundled with Triton (None if absent)."""
    import os
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else None


def inner_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the K loop; the shortest is the trap
    after EXIT)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\.?(L\w+):", line))}
    body: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA \.?(L\w+)", line)
        if m and labels.get(m.group(1), i) < i and i + 1 - labels[m.group(1)] > len(body):
            body = lines[labels[m.group(1)] : i + 1]
    return [line.split("\t", 1)[1].strip() for line in body if "\t" in line]


def k_loop(sass: str, marker: str = "MMA") -> list[str]:
    """The instructions of the shortest backward branch's body that holds ``marker`` instructions (the K
    loop: MMAs, or the GEMV's FFMAs)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\.?(L\w+):", line))}
    body: list[str] | None = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA \.?(L\w+)", line)
        if m and labels.get(m.group(1), i) < i:
            cand = lines[labels[m.group(1)] : i + 1]
            if any(marker in c for c in cand) and (body is None or len(cand) < len(body)):
                body = cand
    return [line.split("\t", 1)[1].strip() for line in body or [] if "\t" in line]


def compile_sass(fn, signature: dict, consts: dict, divisible: list[int], warps: int, exact: bool = True
                 ) -> tuple[str, int | None]:
    """``(SASS, registers)`` of the Triton kernel ``fn`` compiled offline for sm_90: ``signature`` the non-constexpr
    arguments' types by name, ``divisible`` the indices (in ``fn.arg_names``) of arguments marked divisible by 16 (as the JIT specializes them),
    ``exact``: no FMA contraction (the launchers' ``EXACT``)."""
    from triton.tools.disasm import get_sass

    sig = {n: "constexpr" if n in consts else signature[n] for n in fn.arg_names}  # in the kernel's order
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    opts = {"num_warps": warps, **({"enable_fp_fusion": False} if exact else {})}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return get_sass(k.asm["cubin"]), registers_of(k.asm["cubin"])


def kernel_instructions(sass: str) -> tuple[list[str], collections.Counter]:
    """A whole kernel's instructions (up to its last EXIT: not the trap loop and padding) and their opcode
    histogram (predicates dropped)."""
    ins = [line.split("\t", 1)[1].strip() for line in sass.splitlines() if "\t" in line]
    ins = ins[: max(i for i, x in enumerate(ins) if x.startswith("EXIT")) + 1]
    return ins, collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split(" ")[0] for i in ins)


def add_output_args(ap: argparse.ArgumentParser) -> None:
    """The sass scripts' output options: --out (JSON lines), --append, --label (a 'code' field for every row)."""
    ap.add_argument("--out", default=None, help="also write the rows as JSON lines here")
    ap.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    ap.add_argument("--label", default=None, help="a 'code' field for every row (which version was compiled)")


def write_rows(path: str | None, rows: list[dict], append: bool) -> None:
    """The rows as JSON lines in ``path`` (appended or replacing it; nothing when ``path`` is None)."""
    if path:
        with open(path, "a" if append else "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap)
    ap.add_argument("--kernels", default="gemm,grouped,gemv", help="comma list of the kernels to compile")
    args = ap.parse_args(argv)
    rows = []
    for case in [c for c in CASES if c[0] in args.kernels.split(",")]:
        kernel, bm, bn, bk, split, warps, stages = case[:7]
        maxnreg = case[7] if len(case) > 7 else None
        sub_k = case[8] if len(case) > 8 else None
        sass = sass_of(*case)
        body, kbody = inner_loop(sass), k_loop(sass, "FFMA" if kernel == "gemv" else "MMA")
        loads = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split(" ")[0] for i in kbody
                                    if re.search(r"\b(LDG|LDGSTS)", i))  # fmt: skip
        spills = len(re.findall(r"\b(STL|LDL)\b", sass))
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split(" ")[0] for i in body)
        per_thread = bn * bk // (32 * warps)  # weight elements decoded per thread per K step
        row = {**({"code": args.label} if args.label else {}), "kernel": kernel, "block_m": bm, "block_n": bn,
               "block_k": bk, "split_k": split, "warps": warps, "stages": stages, "loop_instructions": len(body), "elements_per_thread": per_thread,
               "instructions_per_element": round(len(body) / per_thread, 2), "k_loop_instructions": len(kbody),
               "k_loop_instructions_per_element": round(len(kbody) / per_thread, 2),
               "k_loop_global_loads": dict(loads.most_common()), "local_memory_instructions": spills,
               "registers": REGISTERS.get(case), "max_registers": maxnreg, "sub_k": sub_k, "shared_bytes": SHARED.get(case),
               **resident(REGISTERS.get(case), warps, SHARED.get(case, 0)),
               "opcodes": dict(ops.most_common())}  # fmt: skip
        rows.append(row)
        print(f"{kernel:8s} BM={bm} BN={bn} BK={bk} split={split} warps={warps}: {len(body)} instructions in the longest loop, "
              f"{per_thread} weights per thread per K step, {len(body) / per_thread:.2f} per weight; K loop alone "
              f"{len(kbody)}, {len(kbody) / per_thread:.2f} per weight; its global loads "
              f"{dict(loads.most_common())}; {spills} local-memory (spill) instructions; "
              f"{REGISTERS.get(case)} registers{f' (cap {maxnreg})' if maxnreg else ''}{f', sub_k {sub_k}' if sub_k else ''}, "
              f"{SHARED.get(case)} B shared, "
              f"{row.get('blocks_per_sm')} blocks = {row.get('warps_per_sm')} warps per SM")  # fmt: skip
        print("   ", ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    print("triton", triton.__version__)
    write_rows(args.out, rows, args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
