"""Land the device calls of ``scripts/gpu_collapse.sh`` (issue 19) in the repository and report the collapse.

    python scripts/collapse_report.py land results/gpu/collapse/<tag> call1/results.tar.gz [call2/... in call order]
    python scripts/collapse_report.py report results/gpu/collapse/<tag>

``land``: per run the latest metrics.jsonl (gzipped when over 64 KiB), config.yaml and log under
``<tag>/runs/``, each call's plan / summary / pick / pretrain / compare files under ``<tag>/calls/<NN>/``;
a tarball whose runs rewrite the landed steps (a run started over instead of continued) is refused
(exit 1, nothing of it written); one landed before is skipped. ``report``: ``<tag>/report/collapse.md``
(the collapse rule, per-recipe and per-run tables), ``collapse.png`` and ``collapse.json`` from the
landed files alone. Definitions: ``quads/experiments/collapse.py``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quads.experiments.collapse import CollapseRule, LandingError, land_all, write_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("land", help="land results.tar.gz files (in call order) in a results folder")
    lp.add_argument("dest", help="results folder, e.g. results/gpu/collapse/<tag>")
    lp.add_argument("tarballs", nargs="+", help="results.tar.gz of gpu_collapse.sh calls, in call order")
    rp = sub.add_parser("report", help="collapse report (markdown, PNG, JSON) of the landed runs")
    rp.add_argument("dest", help="results folder that `land` filled")
    d = CollapseRule()
    rp.add_argument("--frac", type=float, default=d.frac, help="collapsed: below this fraction of the reference")
    rp.add_argument("--min-drop", type=float, default=d.min_drop, help="and at least this far under it (absolute)")
    rp.add_argument("--evals", type=int, default=d.evals, help="held-out pass@1: sustained over the last N evals")
    rp.add_argument("--window", type=int, default=d.window, help="train reward: trailing mean over N steps")
    rp.add_argument("--steps", type=int, default=d.steps, help="train reward: sustained over the last N steps")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "land":
            land_all(args.tarballs, args.dest)
            return 0
        rule = CollapseRule(args.frac, args.min_drop, args.evals, args.window, args.steps)
        command = "python scripts/collapse_report.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        out = write_report(args.dest, rule, command)
    except (LandingError, ValueError) as e:
        print(f"collapse_report.py {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    print((out / "collapse.md").read_text())
    print(f"report: {out / 'collapse.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
