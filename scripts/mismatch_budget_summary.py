"""Summary of a mismatch-budget sweep (``scripts/mismatch_budget.sh``): one row per (alpha, recipe).

Reads each ``<out>/alpha<a>/compare.json`` (``quads compare``'s per-run statistics) and, when the runs
logged it (``eval_trainer``), the held-out pass@1 of the trainer's own policy from each run's
``metrics.jsonl``; a row is the mean over a recipe's runs (as ``quads compare``'s own table), the trainer's
policy as start and end means and each seed's end. ``--more DIR`` adds the runs of another sweep of the same
alphas (e.g. a further seed run later into its own folder: a finished sweep keeps no checkpoints, so its
seeds cannot be extended in place). Writes ``<out>/summary.jsonl`` (one line per run) and
``<out>/summary.md``.

    python scripts/mismatch_budget_summary.py results/mismatch_budget_chain9 1,2,4,8
    python scripts/mismatch_budget_summary.py results/mismatch_budget_chain9 1,2,4,8 --more results/mismatch_budget_chain9_s2
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from quads.experiments.collapse import TRAINER_EVAL_KEY
from quads.metrics.report import finite_mean, load_metrics, series, table, write_markdown


def trainer_evals(run_dir: Path) -> list[float]:
    """The run's ``eval/trainer_pass@1`` values in step order (empty when it did not log them)."""
    try:
        return series(load_metrics(run_dir), TRAINER_EVAL_KEY)[1]
    except ValueError:  # no metrics file
        return []


def _joined(values: list) -> str:
    return " / ".join(dict.fromkeys(str(v) for v in values if v is not None)) or "n/a"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the sweep's folder (holds alpha<a>/); the summary is written here")
    ap.add_argument("alphas", help="comma-separated alphas, as the sweep ran them")
    ap.add_argument("--more", type=Path, action="append", default=[],
                    help="another sweep's folder of the same alphas whose runs join the rows (repeatable)")
    args = ap.parse_args(argv)
    rows, lines = [], []
    for a in args.alphas.split(","):
        runs: dict[str, list[tuple[str, dict]]] = {}  # recipe -> [(run, its stats + trainer's policy)]
        seeds: dict[str, int] = {}
        for root in [args.out, *args.more]:
            folder = root / f"alpha{a}"
            cmp = json.loads((folder / "compare.json").read_text())
            for o in cmp["outcomes"]:
                seeds[o["group"]] = seeds.get(o["group"], 0) + 1
            for name, st in cmp["runs"].items():
                own = trainer_evals(folder / "runs" / name)
                st = {**st, **({"trainer_start": own[0], "trainer_end": own[-1]} if own else {})}
                lines.append(json.dumps({"alpha": float(a), "run": name, "sweep": str(root), **st}))
                runs.setdefault(name.rsplit("-s", 1)[0], []).append((name, st))
        for recipe, done in runs.items():
            stats = [st for _, st in done]
            row = {"alpha": float(a), "recipe": recipe, "seeds": seeds.get(recipe, len(done)), "finished": len(done)}
            for key in ("k3_mean", "gap_mean", "seq_gap_mean", "k3_slope", "reward_final", "eval_start", "eval_end",
                        "trainer_start", "trainer_end"):
                row[key] = finite_mean(st.get(key) for st in stats)
            ends = [st["trainer_end"] for st in stats if "trainer_end" in st]
            row["trainer_ends"] = ", ".join(f"{e:.2f}" for e in ends) or "n/a"
            row["collapsed"] = [(name.rsplit("-s", 1)[1], st.get("collapse_step")) for name, st in done
                                if st.get("collapse")]
            row["correction"] = _joined([st.get("correction") for st in stats])
            row["mini_batches"] = _joined([st.get("mini_batches_text") for st in stats])
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
        "Rows: the runs of each alpha (`alpha<a>/compare.json`"
        + "".join(f", and `{m}`" for m in args.more) + "), mean over seeds; the trainer's policy "
        f"(when logged): `{TRAINER_EVAL_KEY}` at the first and the last evaluation, mean over seeds and per seed.",
        table(rows, cols)])
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
