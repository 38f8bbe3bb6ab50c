"""Run reports: a markdown summary and PNG plots from ``metrics.jsonl``.

``metrics.jsonl`` holds one JSON object per line with an integer ``step`` and namespaced float metrics
(``reward/mean``, ``eval/pass@1``, ``mismatch/...``, ``loss/...``); several lines may share a step (the
trainer writes eval results in the same line as the step, but the loader merges by step anyway).

Summary definitions (``summarize``):
- rewards are smoothed with a trailing moving average over ``w = max(1, steps // 10)`` steps;
  ``reward_final`` is the last smoothed value, ``reward_best`` the highest, ``reward_start`` the first.
- ``eval_start`` / ``eval_end``: held-out pass@1 at the first and last evaluated step.
- ``gap_mean``: mean over steps of ``mismatch/logp_gap_mean``; ``gap_max``: max over steps of
  ``mismatch/logp_gap_max``; ``gap_max_step``: mean over steps of ``mismatch/logp_gap_max`` (the
  typical per-step max, which one outlier token does not set); ``gap_max_probe``: mean over steps of ``mismatch/logp_gap_max_probe``;
  ``k3_mean`` / ``k3_final``: mean over steps and last value of ``mismatch/k3``.
- ``collapse`` is reported (with its reason) when any of: the smoothed reward ends below half of its
  best and at least 0.1 under it; held-out pass@1 ends 0.1 or more below its start; a logged loss or
  gap is NaN/Inf.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quads.io import atomic_write_text

# metric key -> (plot file stem, title); one PNG per entry (gap max and mean share one)
PLOTS: dict[str, tuple[tuple[str, ...], str]] = {
    "reward": (("reward/mean",), "reward (mean over samples)"),
    "eval": (("eval/pass@1",), "held-out pass@1 (greedy)"),
    "gap": (("mismatch/logp_gap_max", "mismatch/logp_gap_mean", "mismatch/logp_gap_max_probe"),
            "|logp_rollout - logp_train|"),
    "k3": (("mismatch/k3",), "k3 KL(rollout || trainer)"),
}
_COLLAPSE_DROP = 0.1


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` merged by step, sorted by step; a torn last line is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"no metrics file at {str(path)!r}; pass a run folder that has metrics.jsonl")
    by_step: dict[int, dict[str, Any]] = {}
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # a crash mid-append; the run resumes from its checkpoint
            raise ValueError(f"{path}:{i + 1}: not a JSON line: {line[:80]!r}") from None
        if "step" not in rec:
            raise ValueError(f"{path}:{i + 1}: record has no 'step' field")
        by_step.setdefault(int(rec["step"]), {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _smooth(ys: list[float], w: int) -> list[float]:
    out = []
    for i in range(len(ys)):
        win = ys[max(0, i - w + 1): i + 1]
        out.append(sum(win) / len(win))
    return out


def _finite_mean(ys: list[float]) -> float:
    f = [y for y in ys if math.isfinite(y)]
    return sum(f) / len(f) if f else math.nan


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers of the report table (see the module docstring for each definition)."""
    steps = [int(r["step"]) for r in records]
    _, rew = _series(records, "reward/mean")
    w = max(1, len(rew) // 10)
    sm = _smooth(rew, w)
    _, ev = _series(records, "eval/pass@1")
    _, gmean = _series(records, "mismatch/logp_gap_mean")
    _, gmax = _series(records, "mismatch/logp_gap_max")
    _, gprobe = _series(records, "mismatch/logp_gap_max_probe")
    _, k3 = _series(records, "mismatch/k3")
    s: dict[str, Any] = {
        "steps": max(steps) if steps else 0,
        "reward_start": sm[0] if sm else math.nan,
        "reward_final": sm[-1] if sm else math.nan,
        "reward_best": max(sm) if sm else math.nan,
        "eval_start": ev[0] if ev else math.nan,
        "eval_end": ev[-1] if ev else math.nan,
        "gap_mean": _finite_mean(gmean),
        "gap_max": max(gmax) if gmax else math.nan,
        "gap_max_step": _finite_mean(gmax),
        "gap_max_probe": _finite_mean(gprobe),
        "k3_mean": _finite_mean(k3),
        "k3_final": k3[-1] if k3 else math.nan,
    }
    reasons = []
    if sm and s["reward_final"] < 0.5 * s["reward_best"] and s["reward_best"] - s["reward_final"] >= _COLLAPSE_DROP:
        reasons.append(f"reward fell from {s['reward_best']:.3f} (best) to {s['reward_final']:.3f}")
    if len(ev) >= 2 and s["eval_end"] <= s["eval_start"] - _COLLAPSE_DROP:
        reasons.append(f"held-out pass@1 fell from {s['eval_start']:.3f} to {s['eval_end']:.3f}")
    bad = [k for r in records for k, v in r.items()
           if (k.startswith("loss/") or k.startswith("mismatch/logp_gap")) and isinstance(v, float)
           and not math.isfinite(v) and not k.endswith("_probe")]
    if bad:
        reasons.append(f"non-finite values in {sorted(set(bad))}")
    s["collapse"] = bool(reasons)
    s["collapse_reason"] = "; ".join(reasons) if reasons else "none"
    return s


_COLUMNS = [
    ("steps", "steps", "{:d}"),
    ("reward_start", "reward start", "{:.3f}"),
    ("reward_final", "reward final", "{:.3f}"),
    ("reward_best", "reward best", "{:.3f}"),
    ("eval_start", "held-out pass@1 start", "{:.3f}"),
    ("eval_end", "held-out pass@1 end", "{:.3f}"),
    ("gap_mean", "gap mean", "{:.4f}"),
    ("gap_max", "gap max", "{:.3f}"),
    ("gap_max_step", "gap max (step mean)", "{:.3f}"),
    ("gap_max_probe", "gap max (probe)", "{:.3f}"),
    ("k3_mean", "k3 mean", "{:.2e}"),
    ("k3_final", "k3 final", "{:.2e}"),
    ("collapse", "collapse", "{}"),
]


def _fmt(v: Any, fmt: str) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return fmt.format(v)


def _table(rows: Mapping[str, dict[str, Any]]) -> str:
    head = "| run | " + " | ".join(c[1] for c in _COLUMNS) + " |"
    sep = "|" + "---|" * (len(_COLUMNS) + 1)
    body = [f"| {name} | " + " | ".join(_fmt(s[k], f) for k, _, f in _COLUMNS) + " |" for name, s in rows.items()]
    return "\n".join([head, sep, *body])


def _plot(runs: Mapping[str, list[dict[str, Any]]], keys: tuple[str, ...], title: str, path: Path) -> bool:
    """One PNG; a line per (run, key). Returns False (and writes nothing) when no run has the keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    drawn = False
    positive = True
    for name, recs in runs.items():
        for key in keys:
            xs, ys = _series(recs, key)
            if not xs:
                continue
            label = name if len(keys) == 1 else f"{name} {key.split('/')[-1]}"
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
            drawn = True
            positive = positive and all(y > 0 for y in ys if math.isfinite(y))
    if drawn:
        if keys[0].startswith("mismatch/") and positive:
            ax.set_yscale("log")  # gaps and k3 span decades (max vs mean, recipe vs recipe)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=100)
        tmp.replace(path)
    plt.close(fig)
    return drawn


def _write(runs: Mapping[str, list[dict[str, Any]]], out_dir: Path, title: str, notes: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {name: summarize(recs) for name, recs in runs.items()}
    figs = []
    for stem, (keys, ptitle) in PLOTS.items():
        if _plot(runs, keys, ptitle, out_dir / f"{stem}.png"):
            figs.append(f"![{ptitle}]({stem}.png)")
    collapse = [f"- {n}: {s['collapse_reason']}" for n, s in summaries.items()]
    text = "\n\n".join([
        f"# {title}",
        notes,
        _table(summaries),
        "Collapse detection (smoothed reward below half its best and 0.1 under it, held-out pass@1 down "
        "0.1 or more, or a NaN/Inf loss or gap):\n" + "\n".join(collapse),
        "Definitions: see `quads/metrics/report.py` and `docs/TRAINING.md`.",
        *figs,
    ]) + "\n"
    atomic_write_text(out_dir / "report.md", text)
    atomic_write_text(out_dir / "summary.json", json.dumps(
        {n: {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.items()}
         for n, s in summaries.items()}, indent=2) + "\n")
    return out_dir


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, name: str | None = None) -> Path:
    """``run_dir/metrics.jsonl`` -> ``out_dir`` (default ``run_dir/report``) with report.md + PNGs."""
    run_dir = Path(run_dir)
    records = load_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    return _write({name or run_dir.name: records}, out, f"quads run report: {name or run_dir.name}",
                  f"Run folder: `{run_dir}`.")


def write_compare_report(runs: Mapping[str, str | Path], out_dir: str | Path,
                         title: str = "quads compare") -> Path:
    """Several runs (name -> run folder) on one table and one figure per metric."""
    if not runs:
        raise ValueError("write_compare_report needs at least one run (name -> run folder)")
    loaded = {name: load_metrics(p) for name, p in runs.items()}
    return _write(loaded, Path(out_dir), title,
                  "Runs: " + ", ".join(f"{n} (`{p}`)" for n, p in runs.items()) + ".")
