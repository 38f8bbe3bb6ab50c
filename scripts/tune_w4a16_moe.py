"""Launch-config sweep of the grouped W4A16 kernel (``quads.kernels.w4a16.grouped_gemm``) at the MoE
decode shapes of the engine benchmark (1b preset: E=64, top-8, T=128 tokens; gate_up N=512 K=1024,
down N=1024 K=256) against ``torch._grouped_mm`` over BF16 weights, CUDA graphs over cold weights.

    PYTHONPATH=. python3 scripts/tune_w4a16_moe.py --out $OUT/tune_moe.jsonl [--workers 14]

Configs are compiled first by worker processes (Triton's disk cache is shared), then timed here; one
JSON line per (shape, config) and the best per shape last, in ``tuning.json``'s key names."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

SHAPES = {"1b gate_up": (64, 512, 1024), "1b down": (64, 1024, 256)}
T, TOPK = 128, 8
SPACE = list(itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (4, 8), (2, 3, 4), (16, 32)))  # bn bk sk nw ns bm


def data(e: int, n: int, k: int, nsets: int, seed: int = 0):
    from quads.kernels import w4a16
    from quads.quant import ops

    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(T, e, device="cuda", generator=g).topk(TOPK, dim=-1).indices
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    ends = counts.cumsum(0).to(torch.int32)
    x = (torch.randn(T * TOPK, k, device="cuda", generator=g)).bfloat16()
    sets = []
    for _ in range(nsets):
        w = (torch.randn(e, n, k, device="cuda", generator=g) * 0.02).bfloat16()
        sets.append((w, w4a16.pack(ops.nvfp4_quantize_weight(w))))
    return x, ends, sets


def call(x, ends, packed, cfg):
    from quads.kernels import w4a16

    bn, bk, sk, nw, ns, bm = cfg
    return w4a16.grouped_gemm(x, packed, ends, block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=ns,
                              block_m=bm)


def warm(cfgs) -> int:
    bad = 0
    for e, n, k in SHAPES.values():
        x, ends, sets = data(e, n, k, 1)
        for cfg in cfgs:
            try:
                call(x, ends, sets[0][1], cfg)
            except Exception:
                bad += 1
    torch.cuda.synchronize()
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args()
    from bench_kernels import time_graph

    t0 = time.time()
    if args.workers:
        with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as ex:
            bad = sum(ex.map(warm, [SPACE[i::args.workers] for i in range(args.workers)]))
        print(f"compiled {len(SPACE)} configs x {len(SHAPES)} shapes in {time.time() - t0:.0f} s ({bad} failed)",
              flush=True)
    out = open(args.out, "w")
    for name, (e, n, k) in SHAPES.items():
        x, ends, sets = data(e, n, k, 8)
        base = time_graph([lambda w=w, x=x, ends=ends: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends) for w, _ in sets])
        ref = torch._grouped_mm(x, sets[0][0].transpose(-2, -1), offs=ends)
        rows = []
        for cfg in SPACE:
            try:
                t = time_graph([lambda p=p, x=x, ends=ends, cfg=cfg: call(x, ends, p, cfg) for _, p in sets])
            except Exception as exc:
                print(f"{name} {cfg}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
                continue
            row = {"shape": name, "cfg": dict(zip(("block_n", "block_k", "split_k", "num_warps", "num_stages",
                                                   "block_m"), cfg)), "us": t * 1e6, "x_vs_grouped_mm": base / t}
            rows.append(row)
            out.write(json.dumps(row) + "\n")
        best = min(rows, key=lambda r: r["us"])
        y = call(x, ends, sets[0][1], tuple(best["cfg"].values()))
        err = float((y.float() - ref.float()).abs().max())  # vs BF16 weights (not the quantized ones): a sanity check
        summary = {"shape": name, "grouped_mm_us": base * 1e6, "best": best, "n_configs": len(rows), "max_abs_vs_bf16_w": err}
        out.write(json.dumps({"summary": summary}) + "\n")
        out.flush()
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
