"""The mismatch-budget curve (issue 19; docs/RESULTS.md section 3): what an amplified sampler did to the
trained policy, against the mismatch it caused, per token and per sequence, one series per setting.

Each run folder (``config.yaml`` + ``metrics.jsonl[.gz]``, as ``quads train`` writes them) that logged the
trainer's own policy (``eval_trainer``: ``eval/trainer_pass@1``) gives one point: x = its mean k3
(``mismatch/k3``) or its mean per-sequence gap (``mismatch/seq_gap_mean``, the sum of |dlogp| over a
response) over every step, y = the trainer's policy's held-out pass@1 at its last evaluation minus its
first, at the last evaluation step every run of the series reached (runs of one series may stop at
different steps), minus the mean of that change over the series' alpha-1 runs (the unamplified
samplers): what the amplified sampler cost the training, on the setting's own scale. Runs without those
evaluations are skipped (and listed). Writes ``<out>/budget_curve.png`` (per run a small point, per series x recipe x
alpha the mean of its runs a large one; naive NVFP4 at alpha 1 ringed) and ``<out>/budget_curve.json``.

    python scripts/budget_curve.py --out results/budget_curve \\
      --series "level 4, 20 chars (CPU, 60 steps)=results/mismatch_budget_lr5e-5/alpha*/runs/*" \\
      --series "level 9, 62 chars (CPU, 60 steps)=results/mismatch_budget_chain9/alpha*/runs/*,results/mismatch_budget_chain9_s2/alpha*/runs/*" \\
      --series "level 8, 284 chars (GPU, 51-122 steps)=results/gpu/collapse/2026-12-02_chain100m_outliers_amplified/runs/*"
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path
from typing import Any

import yaml

from quads.experiments.collapse import TRAINER_EVAL_KEY
from quads.metrics.report import finite_mean, load_metrics, pyplot, save_figure, series

MARKERS = {"bf16": "o", "nvfp4": "s", "quads": "^"}


def point(run_dir: Path) -> dict[str, Any] | None:
    """One run's point, or None when it did not score the trainer's own policy at least twice."""
    recs = load_metrics(run_dir)
    own = list(zip(*series(recs, TRAINER_EVAL_KEY)))
    if len(own) < 2:
        return None
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    recipe = cfg.get("recipe") or {}

    return {"run": str(run_dir), "recipe": recipe.get("name", "?"), "alpha": float(recipe.get("rollout_error_scale", 1.0)),
            "steps": int(recs[-1]["step"]), "k3": finite_mean(r.get("mismatch/k3") for r in recs),
            "seq_gap": finite_mean(r.get("mismatch/seq_gap_mean") for r in recs),
            "trainer_by_step": own}


def at_step(p: dict[str, Any], step: int) -> float:
    """The trainer's policy's pass@1 at the run's last evaluation at or before ``step``, minus its first."""
    return [v for s, v in p["trainer_by_step"] if s <= step][-1] - p["trainer_by_step"][0][1]


def score(pts: list[dict[str, Any]]) -> int:
    """Set each point's ``change`` (module docstring) and return the common step it is taken at."""
    common = min(p["trainer_by_step"][-1][0] for p in pts)
    base = [at_step(p, common) for p in pts if p["alpha"] == 1.0]
    ref = sum(base) / len(base) if base else 0.0
    for p in pts:
        p["gain"] = at_step(p, common)
        p["change"] = p["gain"] - ref
        p["at_step"] = common
    return common


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--series", action="append", required=True,
                    help='"label=glob[,glob...]" of run folders (repeatable; one colour each)')
    ap.add_argument("--out", type=Path, required=True, help="folder for budget_curve.png and budget_curve.json")
    args = ap.parse_args(argv)
    series: dict[str, list[dict[str, Any]]] = {}
    skipped: list[str] = []
    for spec in args.series:
        label, sep, pattern = spec.partition("=")
        if not sep or not label.strip():
            raise SystemExit(f"--series {spec!r}: expected 'label=glob'")
        dirs = sorted({Path(p) for g in pattern.split(",") for p in glob.glob(g) if Path(p, "config.yaml").is_file()})
        if not dirs:
            raise SystemExit(f"--series {label!r}: no run folder matches {pattern!r}")
        pts = []
        for d in dirs:
            p = point(d)
            (pts.append(p) if p else skipped.append(str(d)))
        if not pts:
            raise SystemExit(f"--series {label!r}: no run scored the trainer's own policy (eval_trainer)")
        common = score(pts)
        series[f"{label.strip()}, at step {common}"] = pts
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for (label, pts), color in zip(series.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
        for p in pts:
            groups.setdefault((p["recipe"], p["alpha"]), []).append(p)
        for ax, key in zip(axes, ("k3", "seq_gap")):
            for (recipe, alpha), g in sorted(groups.items()):
                m = MARKERS.get(recipe, "D")
                ax.scatter([p[key] for p in g], [p["change"] for p in g], color=color, marker=m, s=14, alpha=0.35)
                x = sum(p[key] for p in g) / len(g)
                y = sum(p["change"] for p in g) / len(g)
                naive = recipe == "nvfp4" and alpha == 1.0
                ax.scatter([x], [y], color=color, marker=m, s=70, edgecolors="black" if naive else "none",
                           linewidths=1.5)
                ax.annotate(f"{recipe} x{alpha:g}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        axes[0].scatter([], [], color=color, marker="s", label=label)
    for ax, title in zip(axes, ("mean k3 per token (log)", "mean per-sequence gap, sum_t |dlogp| (log)")):
        ax.set_xscale("log")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("trainer's policy: gain in held-out pass@1\nminus the setting's alpha-1 runs' gain")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("What an amplified rollout did to the trained policy (markers: o bf16, s nvfp4, ^ quads; "
                 "large = mean of a setting's seeds; ringed = naive NVFP4 at alpha 1)", fontsize=9)
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    save_figure(fig, args.out / "budget_curve.png")
    (args.out / "budget_curve.json").write_text(json.dumps({"series": series, "skipped": skipped}, indent=1) + "\n")
    print(f"{sum(map(len, series.values()))} runs in {len(series)} series -> {args.out / 'budget_curve.png'}"
          + (f"; skipped (no trainer's policy evaluations): {len(skipped)}" if skipped else ""))


if __name__ == "__main__":
    main()
