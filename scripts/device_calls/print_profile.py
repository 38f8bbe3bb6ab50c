"""Print the decode-step profile rows of a ``bench_e2e.py --suites profile`` JSON: per recipe the step time and
kernel count, then the GPU kernels taking the most time a step (us a step, calls a step, name).

    python3 scripts/device_calls/print_profile.py FILE [--top N]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=20, help="kernels per recipe")
    args = ap.parse_args()
    d = json.load(open(args.file))
    for r in d["rows"] if isinstance(d, dict) else d:
        print(r["recipe"], r["graphs"], r["compile"], round(r.get("decode_ms_per_step", 0), 2),
              r.get("gpu_kernels_per_step"), r.get("error", ""))  # fmt: skip
        for name, calls, us in r.get("top_per_step_us", [])[: args.top]:
            print("   ", round(us, 1), calls, name[:110])


if __name__ == "__main__":
    main()
