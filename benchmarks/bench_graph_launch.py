"""What one kernel boundary costs inside a CUDA graph: a chain of N dependent tiny kernels, captured once, replayed.

The 1b decode step is ~650-850 kernels in one graph (runs 20-41's profiles), most of them a few microseconds of
work, so the per-boundary cost (the next kernel's launch and ramp behind the previous one's drain) bounds the
step from below. Each kernel reads the previous one's output (a true dependency) and does almost nothing:

- ``triton``: one Triton kernel of ``--programs`` programs, launched plainly;
- ``triton_pdl``: the same kernel with Programmatic Dependent Launch (``launch_pdl=True``): it may start while the
  previous one drains and waits for its results at ``gdc_wait`` (sm_90+; Triton >= 3.4);
- ``torch``: ``x.add_(1)`` (an ATen elementwise kernel);
- ``mixed``: Triton kernels launched with PDL alternating with ATen kernels (PDL helps only where the next kernel
  asks for it).

Prints one JSON row per variant: microseconds per replay and per kernel (median of ``--reps`` replays).
``python3 benchmarks/bench_graph_launch.py --n 256 --json out.json``. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(x_ptr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible past this point
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x_ptr + i, v + 1.0)


def chain(kind: str, x: torch.Tensor, n: int, programs: int, block: int) -> None:
    for j in range(n):
        if kind == "torch" or (kind == "mixed" and j % 2):
            x.add_(1.0)
        else:
            pdl = kind in ("triton_pdl", "mixed")
            _step_kernel[(programs,)](x, PDL=pdl, BLOCK=block, launch_pdl=pdl)


def time_graph(kind: str, n: int, programs: int, block: int, reps: int) -> dict:
    x = torch.zeros(programs * block, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(kind, x, n, programs, block)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(kind, x, n, programs, block)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ok = bool((x == n).all())  # every kernel saw its predecessor's result
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    us = statistics.median(times)
    return {"kind": kind, "kernels": n, "programs": programs, "block": block, "us_per_replay": us,
            "us_per_kernel": us / n, "chain_correct": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=256, help="kernels in the chain")
    ap.add_argument("--programs", default="1,132,1024", help="programs per Triton kernel, comma list")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for programs in (int(p) for p in args.programs.split(",")):
        for kind in ("triton", "triton_pdl", "torch", "mixed"):
            try:
                row = time_graph(kind, args.n, programs, args.block, args.reps)
            except Exception as e:  # noqa: BLE001 (a Triton without PDL: record why)
                row = {"kind": kind, "programs": programs, "error": f"{type(e).__name__}: {e}"[:300]}
            print("row", json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
