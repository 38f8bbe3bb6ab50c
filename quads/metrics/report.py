"""Reports: the one module that formats tables and draws plots for ``quads train``, ``compare`` and
``diagnose`` (each of those computes its rows and calls the writers here), and the run report itself: a
markdown summary and PNG plots from ``metrics.jsonl``.

Shared helpers: ``cell`` (a number in a table: ``n/a`` for NaN/None, ``yes``/``no`` for booleans),
``markdown_table``, ``write_markdown`` (sections joined by blank lines, atomic), ``json_safe`` (NaN ->
null), ``finite_mean``, ``smooth``, ``series``, ``nonfinite_keys``; figures: ``pyplot`` (the Agg backend)
and ``save_figure`` (atomic PNG), with one drawing function per report figure (``plot_run_metrics``,
``plot_compare``, ``plot_seed_bands``, ``plot_rac_gap``, ``plot_decomposition``, ``plot_layer_errors``).

Run report (``write_report`` / ``write_compare_report``):

``metrics.jsonl`` holds one JSON object per line with an integer ``step`` and namespaced float metrics
(``reward/mean``, ``eval/pass@1``, ``mismatch/...``, ``loss/...``); several lines may share a step (the
trainer writes eval results in the same line as the step, but the loader merges by step anyway); a landed
copy may be gzipped (``metrics.jsonl.gz``). The keys under ``NONDETERMINISTIC`` (wall-clock times and
throughputs) differ between two identical runs; every other key of a resumed run equals the uninterrupted
run's.

Summary definitions (``summarize``):
- rewards are smoothed with a trailing moving average over ``w = max(1, steps // 10)`` steps;
  ``reward_final`` is the last smoothed value, ``reward_best`` the highest, ``reward_start`` the first.
- ``eval_start`` / ``eval_end``: held-out pass@1 at the first and last evaluated step.
- ``gap_mean``: mean over steps of ``mismatch/logp_gap_mean``; ``gap_max``: max over steps of
  ``mismatch/logp_gap_max``; ``gap_max_step``: mean over steps of ``mismatch/logp_gap_max`` (the
  typical per-step max, which one outlier token does not set); ``gap_max_probe``: mean over steps of ``mismatch/logp_gap_max_probe``;
  ``k3_mean`` / ``k3_final``: mean over steps and last value of ``mismatch/k3``;
  ``seq_gap_mean``: mean over steps of ``mismatch/seq_gap_mean`` (per-response sum of |dlogp|).
- trends: ``k3_slope`` and ``seq_gap_slope``: the least-squares slope (``slope``) over steps of the
  per-step ``mismatch/k3`` and ``mismatch/seq_gap_mean``, per step (positive: the gap grows in training).
- settings (``run_settings``, from the run's ``config.yaml``): the IS correction, mini-batches (optimizer
  steps per PPO epoch) and PPO epochs, the rollout error scale (the mismatch amplifier alpha) and the
  learning rate with its warmup.
- ``collapse`` is reported (with its reason) when any of: the smoothed reward ends below half of its
  best and at least 0.1 under it; held-out pass@1 ends 0.1 or more below its start; a logged loss or
  gap is NaN/Inf.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from quads.io import atomic_write_text

# metric key -> (plot file stem, title); one PNG per entry (gap max and mean share one)
PLOTS: dict[str, tuple[tuple[str, ...], str]] = {
    "reward": (("reward/mean",), "reward (mean over samples)"),
    "eval": (("eval/pass@1",), "held-out pass@1 (greedy)"),
    "gap": (("mismatch/logp_gap_max", "mismatch/logp_gap_mean", "mismatch/logp_gap_max_probe"),
            "|logp_rollout - logp_train|"),
    "k3": (("mismatch/k3",), "k3 KL(rollout || trainer)"),
}
# the panels of ``quads compare``'s figure: (metric key, title), row by row
COMPARE_PANELS = (("reward/mean", "reward (mean over samples)"), ("eval/pass@1", "held-out pass@1 (greedy)"),
                  ("mismatch/logp_gap_max", "gap max |logp_rollout - logp_train|"), ("mismatch/k3", "k3 KL"))
_COLLAPSE_DROP = 0.1
NONDETERMINISTIC = ("time/", "perf/")  # metric prefixes that differ between identical runs


# ---------------------------------------------------------------------- numbers and tables


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that logged ``key`` as a number."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def smooth(ys: list[float], w: int) -> list[float]:
    """Trailing moving average over ``w`` values (fewer at the start)."""
    out = []
    for i in range(len(ys)):
        win = ys[max(0, i - w + 1): i + 1]
        out.append(sum(win) / len(win))
    return out


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs`` over the pairs where both are finite (fp64, centred);
    NaN with fewer than two such pairs or when every ``x`` is the same."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    if len(pts) < 2:
        return math.nan
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else math.nan


def finite_mean(xs: Iterable[Any]) -> float:
    """Mean of the finite numbers in ``xs``; NaN when there are none."""
    f = [x for x in xs if isinstance(x, int | float) and math.isfinite(x)]
    return sum(f) / len(f) if f else math.nan


def nonfinite_keys(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The ``loss/*`` and ``mismatch/logp_gap*`` keys (not the ``_probe`` ones) that some record logged as
    NaN or Inf, sorted: a diverged run."""
    return sorted({k for r in records for k, v in r.items()
                   if (k.startswith("loss/") or k.startswith("mismatch/logp_gap")) and isinstance(v, float)
                   and not math.isfinite(v) and not k.endswith("_probe")})


def cell(v: Any, fmt: str = "{}") -> str:
    """A table cell: ``n/a`` for None or NaN, ``yes`` / ``no`` for a boolean, else ``fmt.format(v)``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return fmt.format(v)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# a column of ``table``: (header, row key or function of the row, format of ``cell``)
Column = tuple[str, str | Callable[[Mapping[str, Any]], Any], str]


def table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A markdown table with one line per row dict, each column formatted with ``cell``."""
    return markdown_table([c[0] for c in columns],
                          [[cell(get(r) if callable(get) else r[get], fmt) for _, get, fmt in columns] for r in rows])


def json_safe(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` with NaN values as None (JSON null)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def write_markdown(path: str | Path, parts: Iterable[str]) -> Path:
    """The report's sections joined by blank lines, written atomically."""
    path = Path(path)
    atomic_write_text(path, "\n\n".join(parts) + "\n")
    return path


# ---------------------------------------------------------------------- figures


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` as a PNG atomically and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)
    pyplot().close(fig)
    return path


def plot_run_metrics(runs: Mapping[str, list[dict[str, Any]]], keys: tuple[str, ...], title: str,
                     path: Path) -> bool:
    """One PNG; a line per (run, key). Returns False (and writes nothing) when no run has the keys."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    drawn = False
    positive = True
    for name, recs in runs.items():
        for key in keys:
            xs, ys = series(recs, key)
            if not xs:
                continue
            label = name if len(keys) == 1 else f"{name} {key.split('/')[-1]}"
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
            drawn = True
            positive = positive and all(y > 0 for y in ys if math.isfinite(y))
    if not drawn:
        plt.close(fig)
        return False
    if keys[0].startswith("mismatch/") and positive:
        ax.set_yscale("log")  # gaps and k3 span decades (max vs mean, recipe vs recipe)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    return True


def plot_compare(curves: Mapping[str, Mapping[str, tuple[list[int], list[float]]]], path: Path) -> Path:
    """2x2 figure of ``COMPARE_PANELS``: one line per recipe, ``curves[recipe][key] = (steps, values)``."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for recipe, by_key in curves.items():
        for ax, (key, title) in zip(axes.flat, COMPARE_PANELS):
            xs, ys = by_key[key]
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=recipe)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    for ax in axes.flat[2:]:
        ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def seed_band(seeds: Sequence[tuple[list[int], list[float]]]) -> tuple[list[int], list[float], list[float],
                                                                       list[float]]:
    """(steps, mean, min, max) over ``seeds`` (each a ``(steps, values)`` curve) at the steps where every
    seed has a finite value."""
    vals = [{x: y for x, y in zip(xs, ys) if math.isfinite(y)} for xs, ys in seeds]
    common = sorted(set.intersection(*(set(v) for v in vals))) if vals else []
    cols = [[v[x] for v in vals] for x in common]
    return common, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def plot_seed_bands(curves: Mapping[str, Mapping[str, Sequence[tuple[list[int], list[float]]]]],
                    panels: Sequence[tuple[str, str, str]], path: Path,
                    marks: Mapping[str, Sequence[tuple[int, float]]] | None = None) -> Path:
    """One panel per ``(key, title, y scale)`` in ``panels`` (scale ``linear``: from 0; ``log``: when every
    value is positive), side by side; per recipe a line of the mean over its seeds with the min-max band
    shaded (``seed_band``: the steps every seed logged) and each seed's own curve thin (so a seed that ran
    longer still shows); ``curves[recipe][key]`` = the seeds' ``(steps, values)``. ``marks[recipe]`` =
    ``(step, value)`` points drawn as crosses on the first panel (e.g. collapse onsets)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for recipe, by_key in curves.items():
        color = None
        for ax, (key, title, _) in zip(axes[0], panels):
            seeds = by_key.get(key, [])
            if not seeds:  # a metric this recipe's runs did not log
                continue
            xs, mean, lo, hi = seed_band(seeds)
            line = ax.plot(xs, mean, color=color, lw=2, label=f"{recipe} (mean of {len(seeds)})")[0]
            color = line.get_color()
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
            for sx, sy in seeds:
                ax.plot(sx, sy, color=color, lw=0.6, alpha=0.5)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for step, value in (marks or {}).get(recipe, []):
            axes[0][0].plot([step], [value], marker="x", ms=9, mew=2, color=color, ls="none")
    for ax, (key, _, scale) in zip(axes[0], panels):
        ys = [y for by_key in curves.values() for _, sy in by_key.get(key, []) for y in sy if math.isfinite(y)]
        if scale == "log" and ys and min(ys) > 0:
            ax.set_yscale("log")
        elif ys and min(ys) >= 0:
            ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_rac_gap(by_trainer: Mapping[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]], path: Path) -> Path:
    """Gap max and mean against the RAC ratio, a line per trainer, its same-spec floor rows dashed;
    ``by_trainer[trainer] = (RAC rows sorted by ratio, floor rows)`` (rows of ``quads diagnose``)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for tname, (rac, floor) in by_trainer.items():
        for ax, key in zip(axes, ("gap_max", "gap_mean")):
            if rac:
                line = ax.plot([r["rac_ratio"] * 100 for r in rac], [r[key] for r in rac], marker="o",
                               label=f"W4A4+RAC vs trainer {tname}")[0]
                for f in floor:
                    ax.axhline(f[key], ls="--", color=line.get_color(), alpha=0.6,
                               label=f"floor: {f['rollout']} rollout vs trainer {tname}")
    for ax, key in zip(axes, ("max", "mean")):
        ax.set_xlabel("RAC ratio (% of K)")
        ax.set_title(f"{key} |logp_rollout - logp_train|")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_decomposition(rows: list[dict[str, Any]], path: Path) -> Path:
    """Mean gap per rollout variant (bars), one bar group per trainer variant (rows of ``quads diagnose``)."""
    plt = pyplot()
    trainers = list(dict.fromkeys(r["trainer"] for r in rows))
    names = list(dict.fromkeys(r["rollout"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(trainers))
    for j, tname in enumerate(trainers):
        vals = {r["rollout"]: r["gap_mean"] for r in rows if r["trainer"] == tname}
        ax.bar([i + j * width for i in range(len(names))], [vals.get(n, math.nan) for n in names], width,
               label=f"trainer {tname}")
    ax.set_xticks([i + width * (len(trainers) - 1) / 2 for i in range(len(names))], names, rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("mean |logp_rollout - logp_train|")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_layer_errors(errors: Mapping[str, Mapping[str, float]], trainer: str, path: Path) -> Path:
    """Relative output error per quantized layer, a line per rollout variant (``errors[rollout][layer]``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for rname, errs in errors.items():
        ax.plot(range(len(errs)), list(errs.values()), marker="o", label=rname)
    ax.set_xlabel("quantized layer (in model order)")
    ax.set_ylabel(f"relative output error vs trainer {trainer}")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


# ---------------------------------------------------------------------- run report


def metrics_file(run_dir: str | Path) -> Path | None:
    """A run folder's ``metrics.jsonl``, else its gzipped ``metrics.jsonl.gz`` (how results/ commits them),
    else None."""
    for name in ("metrics.jsonl", "metrics.jsonl.gz"):
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    return None


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` (or a gzipped ``metrics.jsonl.gz``) merged by step, sorted by step; a
    torn last line is skipped. ``path``: the file or its run folder."""
    path = Path(path)
    if path.is_dir():
        path = metrics_file(path) or path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"no metrics file at {str(path)!r}; pass a run folder that has metrics.jsonl")
    by_step: dict[int, dict[str, Any]] = {}
    raw = path.read_bytes()
    lines = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode().splitlines()
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


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers of the report table (see the module docstring for each definition)."""
    steps = [int(r["step"]) for r in records]
    _, rew = series(records, "reward/mean")
    w = max(1, len(rew) // 10)
    sm = smooth(rew, w)
    _, ev = series(records, "eval/pass@1")
    _, gmean = series(records, "mismatch/logp_gap_mean")
    _, gmax = series(records, "mismatch/logp_gap_max")
    _, gprobe = series(records, "mismatch/logp_gap_max_probe")
    k3_steps, k3 = series(records, "mismatch/k3")
    seq_steps, seq_gap = series(records, "mismatch/seq_gap_mean")
    s: dict[str, Any] = {
        "steps": max(steps) if steps else 0,
        "reward_start": sm[0] if sm else math.nan,
        "reward_final": sm[-1] if sm else math.nan,
        "reward_best": max(sm) if sm else math.nan,
        "eval_start": ev[0] if ev else math.nan,
        "eval_end": ev[-1] if ev else math.nan,
        "gap_mean": finite_mean(gmean),
        "gap_max": max(gmax) if gmax else math.nan,
        "gap_max_step": finite_mean(gmax),
        "gap_max_probe": finite_mean(gprobe),
        "k3_mean": finite_mean(k3),
        "k3_final": k3[-1] if k3 else math.nan,
        "k3_slope": slope(k3_steps, k3),
        "seq_gap_mean": finite_mean(seq_gap),
        "seq_gap_slope": slope(seq_steps, seq_gap),
    }
    reasons = []
    if sm and s["reward_final"] < 0.5 * s["reward_best"] and s["reward_best"] - s["reward_final"] >= _COLLAPSE_DROP:
        reasons.append(f"reward fell from {s['reward_best']:.3f} (best) to {s['reward_final']:.3f}")
    if len(ev) >= 2 and s["eval_end"] <= s["eval_start"] - _COLLAPSE_DROP:
        reasons.append(f"held-out pass@1 fell from {s['eval_start']:.3f} to {s['eval_end']:.3f}")
    bad = nonfinite_keys(records)
    if bad:
        reasons.append(f"non-finite values in {bad}")
    s["collapse"] = bool(reasons)
    s["collapse_reason"] = "; ".join(reasons) if reasons else "none"
    return s


_COLUMNS: list[Column] = [
    ("run", "run", "{}"),
    ("steps", "steps", "{:d}"),
    ("reward start", "reward_start", "{:.3f}"),
    ("reward final", "reward_final", "{:.3f}"),
    ("reward best", "reward_best", "{:.3f}"),
    ("held-out pass@1 start", "eval_start", "{:.3f}"),
    ("held-out pass@1 end", "eval_end", "{:.3f}"),
    ("gap mean", "gap_mean", "{:.4f}"),
    ("gap max", "gap_max", "{:.3f}"),
    ("gap max (step mean)", "gap_max_step", "{:.3f}"),
    ("gap max (probe)", "gap_max_probe", "{:.3f}"),
    ("k3 mean", "k3_mean", "{:.2e}"),
    ("k3 final", "k3_final", "{:.2e}"),
    ("k3 slope /step", "k3_slope", "{:.2e}"),
    ("seq gap mean", "seq_gap_mean", "{:.3f}"),
    ("seq gap slope /step", "seq_gap_slope", "{:.2e}"),
    ("IS correction", lambda r: r.get("correction"), "{}"),
    ("mini-batches", lambda r: r.get("mini_batches_text"), "{}"),
    ("rollout error x", lambda r: r.get("error_scale"), "{:g}"),
    ("collapse", "collapse", "{}"),
]


def run_settings(run_dir: str | Path) -> dict[str, Any]:
    """What a run was trained with, from its ``config.yaml`` (``{}`` when it has none): ``correction``
    (e.g. ``tis (cap 2)``, ``none``), ``mini_batches``, ``ppo_epochs``, ``mini_batches_text`` (``2`` or
    ``2 x 3 epochs``), ``error_scale`` (the rollout's mismatch amplifier alpha), ``lr_text`` (``2e-05``, or
    ``2e-05 (warmup 20)`` with a linear warmup of 20 optimizer steps; ``n/a`` when the config does not say)."""
    run_dir = Path(run_dir)
    path = (run_dir.parent if run_dir.is_file() else run_dir) / "config.yaml"  # a folder or its metrics.jsonl
    if not path.is_file():
        return {}
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not a YAML config ({e}); restore the run's config.yaml") from None
    corr, optim = cfg.get("correction") or {}, cfg.get("optim") or {}
    kind = corr.get("kind", "tis")  # the defaults of quads.rl.correction.CorrectionConfig
    text = {"none": "none", "tis": f"tis (cap {corr.get('cap', 2.0):g})"}.get(
        kind, f"{kind} [{corr.get('low', 0.5):g}, {corr.get('high', 2.0):g}]")
    mb, ep = int(optim.get("mini_batches", 1)), int(optim.get("ppo_epochs", 1))
    lr, warmup = optim.get("lr"), int(optim.get("warmup_steps", 0))
    lr_text = "n/a" if lr is None else f"{float(lr):g}" + (f" (warmup {warmup})" if warmup else "")
    return {"correction": text, "mini_batches": mb, "ppo_epochs": ep, "lr_text": lr_text,
            "mini_batches_text": f"{mb}" if ep == 1 else f"{mb} x {ep} epochs",
            "error_scale": float((cfg.get("recipe") or {}).get("rollout_error_scale", 1.0))}


def _write(runs: Mapping[str, list[dict[str, Any]]], out_dir: Path, title: str, notes: str,
           settings: Mapping[str, dict[str, Any]]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {name: {**summarize(recs), **settings.get(name, {})} for name, recs in runs.items()}
    figs = []
    for stem, (keys, ptitle) in PLOTS.items():
        if plot_run_metrics(runs, keys, ptitle, out_dir / f"{stem}.png"):
            figs.append(f"![{ptitle}]({stem}.png)")
    collapse = [f"- {n}: {s['collapse_reason']}" for n, s in summaries.items()]
    write_markdown(out_dir / "report.md", [
        f"# {title}",
        notes,
        table([{"run": n, **s} for n, s in summaries.items()], _COLUMNS),
        "Collapse detection (smoothed reward below half its best and 0.1 under it, held-out pass@1 down "
        "0.1 or more, or a NaN/Inf loss or gap):\n" + "\n".join(collapse),
        "Definitions: see `quads/metrics/report.py` and `docs/TRAINING.md`.",
        *figs,
    ])
    atomic_write_text(out_dir / "summary.json", json.dumps(
        {n: json_safe(s) for n, s in summaries.items()}, indent=2) + "\n")
    return out_dir


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, name: str | None = None) -> Path:
    """``run_dir/metrics.jsonl`` -> ``out_dir`` (default ``run_dir/report``) with report.md + PNGs."""
    run_dir = Path(run_dir)
    records = load_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    key = name or run_dir.name
    return _write({key: records}, out, f"quads run report: {key}", f"Run folder: `{run_dir}`.",
                  {key: run_settings(run_dir)})


def write_compare_report(runs: Mapping[str, str | Path], out_dir: str | Path,
                         title: str = "quads compare") -> Path:
    """Several runs (name -> run folder) on one table and one figure per metric."""
    if not runs:
        raise ValueError("write_compare_report needs at least one run (name -> run folder)")
    loaded = {name: load_metrics(p) for name, p in runs.items()}
    return _write(loaded, Path(out_dir), title,
                  "Runs: " + ", ".join(f"{n} (`{p}`)" for n, p in runs.items()) + ".",
                  {name: run_settings(p) for name, p in runs.items()})
