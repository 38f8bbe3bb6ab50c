"""``quads bench``: GPU benchmarks (kernels now; engine and trainer later).

``quads bench kernels [--quick] [--only quantize,w4a16,sweep,moe,w4a4] [--json FILE]`` runs
``benchmarks/bench_kernels.py`` (NVFP4 quantize / RAC quantize / W4A16 / grouped MoE / W4A4 against
cuBLAS BF16 and FP8 in the same run; docs/PERF.md has the method and the numbers).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

SUITES = ("kernels",)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", nargs="?", default="kernels", choices=SUITES, help="what to benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    parser.add_argument("--only", default="quantize,w4a16,moe,w4a4,sweep", help="comma list of kernel suites")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def _load_bench_kernels():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: `quads bench` runs from a source checkout of quads")
    spec = importlib.util.spec_from_file_location("quads_bench_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(args: argparse.Namespace) -> int:
    argv = (
        ["--only", args.only]
        + (["--quick"] if args.quick else [])
        + (["--json", args.json] if args.json else [])
    )
    return _load_bench_kernels().main(argv)
