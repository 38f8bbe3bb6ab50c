"""``quads bench``: GPU benchmarks of the kernels and of the rollout engine and trainer step.

``quads bench kernels [--quick] [--only quantize,w4a16,moe,w4a4,rac,attention] [--json FILE]`` runs
``benchmarks/bench_kernels.py`` (NVFP4 quantize / RAC quantize / W4A16 / grouped MoE / W4A4 against
cuBLAS BF16 and FP8 in the same run; RAC operands fused vs step by step; decode attention against SDPA). ``quads bench e2e [--quick] [--only rollout,trainer] [--preset
100m] [--device cuda] [--json FILE]`` runs ``benchmarks/bench_e2e.py`` (rollout tokens/s per rollout
precision; W4A16-QAT trainer step against BF16). docs/PERF.md has the method and the numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

SUITES = ("kernels", "e2e")
E2E_QUICK = ["--prompts", "4", "--n", "2", "--new-tokens", "8", "--long-tokens", "16", "--batch", "4", "--seq-len", "32",
             "--reps", "2", "--warmup", "1", "--steps", "3"]


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", nargs="?", default="kernels", choices=SUITES, help="what to benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    parser.add_argument("--only", default=None,
                        help="comma list of sub-suites (kernels: quantize,w4a16,moe,w4a4,rac,attention; e2e: rollout,trainer,profile,vllm; vllm needs the vLLM environment)")
    parser.add_argument("--preset", default="100m", help="e2e: model preset")
    parser.add_argument("--device", default=None, help="e2e: torch device (default cuda when available)")
    parser.add_argument("--experts", default="grouped", help="e2e: rollout expert paths to time (grouped,loop)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` knows), for benchmark records."""
    import platform

    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


MODEL_OVERRIDES = (("hidden", "hidden_size"), ("intermediate", "moe_intermediate_size"), ("experts", "n_experts"),
                   ("layers", "n_layers"), ("vocab", "vocab_size"))


def add_model_overrides(ap: argparse.ArgumentParser, *, vocab: bool = False) -> None:
    """``--hidden --intermediate --experts --layers`` (and ``--vocab``): ModelConfig fields over a preset's."""
    for flag, field in MODEL_OVERRIDES:
        if flag != "vocab" or vocab:
            ap.add_argument(f"--{flag}", type=int, default=0, help=f"override {field} (0 = the preset's)")


def model_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The ModelConfig fields ``add_model_overrides``' flags set (nonzero)."""
    return {field: getattr(args, flag) for flag, field in MODEL_OVERRIDES if getattr(args, flag, 0)}


def add_run_args(ap: argparse.ArgumentParser, *, warmup: int, reps: int, warmup_help: str, reps_help: str) -> None:
    """A timed benchmark's common flags: ``--warmup --reps --threads --device --json`` (``run_args`` after parsing)."""
    import torch

    ap.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    ap.add_argument("--reps", type=int, default=reps, help=reps_help)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="", help="also write the record to this file")


def run_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``add_run_args``' flags checked (a clear error for ``--reps`` < 1 or ``--warmup`` < 0), ``--threads`` applied."""
    import torch

    if args.reps < 1 or args.warmup < 0:
        ap.error(f"expected --reps >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    if args.threads:
        torch.set_num_threads(args.threads)


def timer(device: str):
    """``timed(fn)``: milliseconds of ``fn()`` (the device idle before it starts, finished when it returns):
    CUDA events on a CUDA device, ``perf_counter`` elsewhere; for the benchmarks' step and phase timings."""
    import time

    import torch

    cuda = str(device).startswith("cuda")

    def timed(fn) -> float:
        if not cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    return timed


def _load_bench(name: str = "bench_kernels"):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: `quads bench` runs from a source checkout of quads")
    spec = importlib.util.spec_from_file_location(f"quads_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(args: argparse.Namespace) -> int:
    if args.suite == "e2e":
        argv = ["--preset", args.preset, "--experts", args.experts] + (["--suites", args.only] if args.only else [])
        argv += (["--device", args.device] if args.device else []) + (E2E_QUICK if args.quick else [])
        return _load_bench("bench_e2e").main(argv + (["--json", args.json] if args.json else []))
    argv = (
        ["--only", args.only or "quantize,w4a16,moe,w4a4,rac,attention"]
        + (["--quick"] if args.quick else [])
        + (["--json", args.json] if args.json else [])
    )
    return _load_bench().main(argv)
