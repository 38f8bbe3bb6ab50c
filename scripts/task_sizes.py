"""Distinct train / test prompts each built-in task level offers, up to a cap (``quads.tasks.examples_up_to``).

    python scripts/task_sizes.py [--cap 20000] [--seed 0] [--only arithmetic:8,code]

A generated split counts as exhausted when as many draws again as found its last new prompt bring none
(``quads.tasks.base.GeneratedTask``); a level that reaches the cap is shown as ``>= cap``. Also the
demonstrations' (SFT target responses') length in characters over the training prompts drawn: mean,
min and max. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quads.tasks import examples_up_to, get_task  # noqa: E402
from quads.tasks.arithmetic import LEVELS as ARITHMETIC_LEVELS  # noqa: E402
from quads.tasks.countdown import LEVELS as COUNTDOWN_LEVELS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", type=int, default=20000, help="largest count asked per split (the warm start's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated task[:level] cases to run (default: all)")
    args = ap.parse_args()
    cases = ([("arithmetic", d) for d in sorted(ARITHMETIC_LEVELS)]
             + [("countdown", d) for d in sorted(COUNTDOWN_LEVELS)] + [("code", None)])
    if args.only:
        want = {c.strip() for c in args.only.split(",") if c.strip()}
        cases = [(n, lv) for n, lv in cases if n in want or f"{n}:{lv}" in want]
    rows = []
    print("| task | level | train prompts | test prompts | demo chars mean / min / max | seconds |\n"
          "|---|---|---|---|---|---|")
    for name, level in cases:
        task = get_task(name, seed=args.seed, **({} if level is None else {"difficulty": level}))
        t0 = time.perf_counter()
        ex = {split: examples_up_to(task, split, args.cap) for split in ("train", "test")}
        dt = time.perf_counter() - t0
        n = {split: len(v) for split, v in ex.items()}
        chars = [len(task.demonstration(e)) for e in ex["train"]]
        length = {"demo_chars_mean": round(sum(chars) / len(chars), 1), "demo_chars_min": min(chars),
                  "demo_chars_max": max(chars)}
        shown = {k: f">= {v}" if v == args.cap else str(v) for k, v in n.items()}
        print(f"| {name} | {level if level is not None else '-'} | {shown['train']} | {shown['test']} | "
              f"{length['demo_chars_mean']} / {length['demo_chars_min']} / {length['demo_chars_max']} | {dt:.1f} |",
              flush=True)
        rows.append({"task": name, "level": level, **n, **length, "seconds": round(dt, 2)})
    print(json.dumps({"metric": "task_sizes", "cap": args.cap, "seed": args.seed, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
