"""The grouped W4A16 kernel at the 1b preset's decode shapes, a few calls each, for Nsight Compute.

Launches ``quads.kernels.w4a16.grouped_gemm`` (the launcher's tuned decode config, or the explicit
``--block-*`` / ``--num-*`` / ``--split-k`` arguments) on random packed experts: 1b gate_up (E 64, N 512,
K 1024) and down (E 64, N 1024, K 256), 128 tokens x top-8 routed rows (~16 per expert): the shapes
and data of ``benchmarks/bench_kernels.py``'s ``1b`` MoE rows (``MOE_SHAPES``, ``_moe_data``). Without a profiler it prints each shape's median time
over CUDA-event-timed calls (weights warm in the L2: not the benchmark's number). Under ncu:

    ncu --clock-control none --kernel-name regex:_grouped_kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
        --section WarpStateStats python3 scripts/ncu_grouped.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_kernels import MOE_SHAPES, _events_ms, _moe_data  # noqa: E402

# (E, N, K) of the benchmark's 1b MoE rows, by projection: {"gate_up": (64, 512, 1024), "down": (64, 1024, 256)}
SHAPES = {what.split()[1]: (e, n, k) for e, n, k, _, _, what in MOE_SHAPES if what.startswith("1b ")}


def time_shape(e: int, n: int, k: int, tokens: int, topk: int, calls: int, dev: str, explicit: dict):
    """``grouped_gemm`` on the benchmark's packed experts and routed rows (``_moe_data``): the times of
    ``calls`` calls in us (CUDA events; wall time on the CPU) and the relative error of the last call
    against ``grouped_gemm_reference``."""
    from quads.kernels import w4a16

    data = _moe_data(1, dev, e, n, k, topk, (tokens,))
    packed, (x, ends) = data["moe_w"][0], data["moe_x"][tokens]
    out = []

    def call():
        out[:] = [w4a16.grouped_gemm(x, packed, ends, **explicit)]

    if dev == "cuda":
        times = [ms * 1e3 for ms in _events_ms(call, calls)]
    else:
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1e6)
    ref = w4a16.grouped_gemm_reference(x, packed, ends).float()
    return times, ((out[0].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="gate_up,down",
                    help="comma list of " + ", ".join(SHAPES) + " or E:N:K (e.g. 4:32:128 for a CPU smoke run)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--calls", type=int, default=6, help="calls per shape (ncu: skip the first 2)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a smoke run)")
    for k in ("block-m", "block-n", "block-k", "num-warps", "num-stages", "split-k", "max-registers", "sub-k"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--config", default=None,
                    help="a tuning.json (e.g. the tune suite's --tuning-out): its w4a16_grouped_gemm.decode config, "
                         "explicit arguments on top")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k", "max_registers", "sub_k")
    explicit = {}
    if a.config:
        explicit = {k: v for k, v in json.loads(Path(a.config).read_text())["w4a16_grouped_gemm"]["decode"].items()
                    if v is not None}  # fmt: skip
    explicit.update({k: getattr(a, k) for k in names if getattr(a, k) is not None})
    for name in [s.strip() for s in a.shapes.split(",") if s.strip()]:
        try:
            e, n, k = SHAPES[name] if name in SHAPES else map(int, name.split(":"))
        except ValueError:
            ap.error(f"--shapes: {name!r} is neither one of {', '.join(SHAPES)} nor E:N:K")
        times, err = time_shape(e, n, k, a.tokens, a.topk, a.calls, a.device, explicit)
        print(f"{name}: E {e} N {n} K {k}, {a.tokens * a.topk} rows, {explicit or 'tuned config'}: "
              f"median {statistics.median(times):.1f} us over {a.calls} calls (warm L2); relative error against "
              f"grouped_gemm_reference {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
