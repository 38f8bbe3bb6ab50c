"""The grouped W4A16 kernel at the 1b preset's decode shapes, a few calls each, for Nsight Compute.

Launches ``quads.kernels.w4a16.grouped_gemm`` (the launcher's tuned decode config, or the explicit
``--block-*`` / ``--num-*`` / ``--split-k`` arguments) on random packed experts: 1b gate_up (E 64, N 512,
K 1024) and down (E 64, N 1024, K 256), 128 tokens x top-8 routed rows (~16 per expert), as
``benchmarks/bench_kernels.py``'s ``1b`` MoE rows. Without a profiler it prints each shape's median time
over CUDA-event-timed calls (weights warm in the L2: not the benchmark's number). Under ncu:

    ncu --clock-control none --kernel-name regex:_grouped_kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
        --section WarpStateStats python3 scripts/ncu_grouped.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"gate_up": (64, 512, 1024), "down": (64, 1024, 256)}  # (E, N, K)


def main(argv: list[str] | None = None) -> int:
    from quads.kernels import nvfp4_quant, w4a16

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="gate_up,down",
                    help="comma list of " + ", ".join(SHAPES) + " or E:N:K (e.g. 4:32:128 for a CPU smoke run)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--calls", type=int, default=6, help="calls per shape (ncu: skip the first 2)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a smoke run)")
    for k in ("block-m", "block-n", "block-k", "num-warps", "num-stages", "split-k"):
        ap.add_argument(f"--{k}", type=int, default=None)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    dev = a.device
    explicit = {k: getattr(a, k) for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k")}
    explicit = {k: v for k, v in explicit.items() if v is not None}
    g = torch.Generator(device="cpu").manual_seed(0)
    for name in [s.strip() for s in a.shapes.split(",") if s.strip()]:
        try:
            e, n, k = SHAPES[name] if name in SHAPES else map(int, name.split(":"))
        except ValueError:
            ap.error(f"--shapes: {name!r} is neither one of {', '.join(SHAPES)} nor E:N:K")
        w = (torch.randn(e, n, k, device=dev) * 0.02).bfloat16()
        packed = w4a16.pack(nvfp4_quant.nvfp4_quantize(w, amax=w.float().abs().amax(dim=(-2, -1), keepdim=True)))
        ids = torch.stack([torch.randperm(e, generator=g)[: a.topk] for _ in range(a.tokens)]).flatten()
        ends = torch.cumsum(torch.bincount(ids, minlength=e), 0).to(torch.int32).to(dev)
        x = torch.randn(a.tokens * a.topk, k, device=dev).bfloat16()
        times = []
        for _ in range(a.calls):
            if dev == "cuda":
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                y = w4a16.grouped_gemm(x, packed, ends, **explicit)
                t1.record()
                torch.cuda.synchronize()
                times.append(t0.elapsed_time(t1) * 1e3)
            else:
                t = time.perf_counter()
                y = w4a16.grouped_gemm(x, packed, ends, **explicit)
                times.append((time.perf_counter() - t) * 1e6)
        ref = w4a16.grouped_gemm_reference(x, packed, ends)
        err = ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
        print(f"{name}: E {e} N {n} K {k}, {a.tokens * a.topk} rows, {explicit or 'tuned config'}: "
              f"median {statistics.median(times):.1f} us over {a.calls} calls (warm L2); relative error against "
              f"grouped_gemm_reference {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
