"""Summary of a mismatch-budget sweep (``scripts/mismatch_budget.sh``): one row per (alpha, recipe).

Reads each ``<out>/alpha<a>/compare.json`` (``quads compare``'s per-recipe means over seeds) and, when the
runs logged it (``eval_trainer``), the held-out pass@1 of the trainer's own policy from each run's
``metrics.jsonl`` (start and end, mean over seeds, and each seed's end). Writes ``<out>/summary.jsonl`` (one
line per run) and ``<out>/summary.md``.

    python scripts/mismatch_budget_summary.py results/mismatch_budget_chain9 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from quads.metrics.report import table, write_markdown

TRAINER_KEY = "eval/trainer_pass@1"


def trainer_evals(run_dir: Path) -> list[float]:
    """The run's ``eval/trainer_pass@1`` values in step order (empty when it did not log them)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r[TRAINER_KEY] for r in recs if TRAINER_KEY in r]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the sweep's folder (holds alpha<a>/)")
    ap.add_argument("alphas", help="comma-separated alphas, as the sweep ran them")
    args = ap.parse_args(argv)
    rows, lines = [], []
    for a in args.alphas.split(","):
        folder = args.out / f"alpha{a}"
        cmp = json.loads((folder / "compare.json").read_text())
        ends: dict[str, list[tuple[float, float]]] = {}
        for name, s in cmp["runs"].items():
            own = trainer_evals(folder / "runs" / name)
            extra = {"trainer_start": own[0], "trainer_end": own[-1]} if own else {}
            lines.append(json.dumps({"alpha": float(a), "run": name, **s, **extra}))
            if own:
                ends.setdefault(name.rsplit("-s", 1)[0], []).append((own[0], own[-1]))
        for r in cmp["recipes"]:
            row = {"alpha": float(a), **{k: (math.nan if v is None else v) for k, v in r.items()}}
            seeds = ends.get(r["recipe"], [])
            row["trainer_start"] = sum(s for s, _ in seeds) / len(seeds) if seeds else math.nan
            row["trainer_end"] = sum(e for _, e in seeds) / len(seeds) if seeds else math.nan
            row["trainer_ends"] = ", ".join(f"{e:.2f}" for _, e in seeds) or "n/a"
            rows.append(row)
    (args.out / "summary.jsonl").write_text("\n".join(lines) + "\n")
    cols = [("alpha", "alpha", "{:g}"), ("recipe", "recipe", "{}"),
            ("runs ok", lambda r: f"{r['finished']}/{r['seeds']}", "{}"),
            ("k3 mean", "k3_mean", "{:.2e}"), ("gap mean", "gap_mean", "{:.4f}"),
            ("seq gap mean", "seq_gap_mean", "{:.3f}"), ("k3 slope /step", "k3_slope", "{:.2e}"),
            ("final reward", "reward_final", "{:.3f}"), ("held-out start", "eval_start", "{:.3f}"),
            ("held-out end", "eval_end", "{:.3f}")]
    if any(not math.isnan(r["trainer_end"]) for r in rows):
        cols += [("trainer's policy start", "trainer_start", "{:.3f}"), ("trainer's policy end", "trainer_end", "{:.3f}"),
                 ("trainer's policy end per seed", "trainer_ends", "{}")]
    cols += [("collapsed", lambda r: ", ".join(f"s{s}@{t}" for s, t in r["collapsed"]) or "no", "{}"),
             ("IS correction", "correction", "{}"), ("mini-batches", "mini_batches", "{}")]
    write_markdown(args.out / "summary.md", [
        "# Mismatch budget: rollout quantization error x alpha",
        "Rows: quads compare of each alpha (`alpha<a>/compare.md`), mean over seeds; the trainer's policy "
        f"(when logged): `{TRAINER_KEY}` at the first and the last evaluation, mean over seeds and per seed.",
        table(rows, cols)])
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
