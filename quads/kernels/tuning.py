"""Launch configs of the Triton kernels, read from the data file ``tuning.json`` beside this module.

Entries are ``tuning.json[kernel][case]`` = keyword arguments of the kernel's launcher (``block_m``,
``block_k``, ``num_warps``, ...). The benchmark's ``tune`` suite (``benchmarks/bench_kernels.py --only
tune``) times candidate configs by passing them as explicit launcher arguments and writes the fastest
of each case as a file of the same form (``--tuning-out``); copying it over ``tuning.json`` adopts
them, and docs/PERF.md records which run measured which config. A launch config changes speed only:
the quantizers are bit-exact under every config, and a GEMM's split-K changes only the fp32 summation
order, within the GEMM's documented tolerance.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

PATH = Path(__file__).with_name("tuning.json")


@functools.cache
def table() -> dict[str, dict[str, dict]]:
    """The parsed ``tuning.json`` (read once per process)."""
    return json.loads(PATH.read_text())


def case(kernel: str, shape: str, default: str) -> str:
    """``{shape}_{default}`` where ``tuning.json[kernel]`` has that weight shape's own entry (``shape`` as
    ``n{N}_k{K}``: a run measured it), else ``default``."""
    return f"{shape}_{default}" if f"{shape}_{default}" in table()[kernel] else default


def config(kernel: str, case: str, **given) -> dict:
    """The launch config of ``kernel`` for ``case`` (a fresh dict), each of ``given`` that is not None in place
    of the stored value (a launcher's explicit arguments); a clear error if the entry is missing."""
    try:
        cfg = dict(table()[kernel][case])
    except KeyError:
        raise ValueError(
            f"no launch config {kernel}.{case} in {PATH}; restore the file from git or rerun the "
            "benchmark's tune suite (benchmarks/bench_kernels.py --only tune --tuning-out FILE)"
        ) from None
    cfg.update({key: v for key, v in given.items() if v is not None})
    return cfg
