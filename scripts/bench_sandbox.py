"""Programs per second of the code sandbox at each isolation level (serial, as the verifier scores).

Runs a code-task program (``def f(x): return x+1`` with 5 tests) ``--n`` times per level, the levels
interleaved round-robin so that a busy machine slows them alike, and prints the median wall time per
program and programs/s for each level as one JSON line, with the machine's load average (a shared
machine's load moves every number). ``--baseline FILE`` also times another
sandbox module (e.g. ``git show main:quads/tasks/sandbox.py > /tmp/old.py``) as "baseline".

    .venv/bin/python scripts/bench_sandbox.py --n 40 [--baseline /tmp/old.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

from quads.tasks import sandbox

PROGRAM = "def f(x): return x+1"
TESTS = [(-3,), (0,), (1,), (7,), (12,)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--baseline", default=None, help="path of another sandbox.py to time as 'baseline'")
    ap.add_argument("--levels", default="full,no-cgroup,process")
    args = ap.parse_args()
    runners = {}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_sandbox", args.baseline)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["baseline_sandbox"] = mod
        spec.loader.exec_module(mod)
        runners["baseline"] = lambda: mod.run_python(PROGRAM, tests=TESTS, limits=mod.SandboxLimits(memory_mb=256))
    for level in args.levels.split(","):
        lim = sandbox.SandboxLimits(memory_mb=256, isolation=level)
        runners[level] = lambda lim=lim: sandbox.run_python(PROGRAM, tests=TESTS, limits=lim)
    times: dict[str, list[float]] = {k: [] for k in runners}
    load_before = os.getloadavg()[0]
    for name, run in runners.items():
        res = run()
        if res.test_results != [("ok", repr(x + 1)) for (x,) in TESTS]:
            raise SystemExit(f"{name}: the program did not pass its tests: {res.reason}")
    for _ in range(args.n):
        for name, run in runners.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    out = {name: {"median_ms": round(1000 * statistics.median(ts), 1),
                  "programs_per_s": round(1 / statistics.median(ts), 1)} for name, ts in times.items()}
    print(json.dumps({"n": args.n, "cpus": os.cpu_count(), "load_avg_1min": [load_before, os.getloadavg()[0]],
                      **out}))


if __name__ == "__main__":
    main()
