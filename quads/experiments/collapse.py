"""The collapse experiment (issue 19, ``scripts/gpu_collapse.sh``): land its device calls in the repository
and judge every run by one written-down collapse rule.

Landing (``land``): each device call returns ``results.tar.gz`` (per run ``runs/<group>-s<seed>/``
with ``metrics.jsonl`` and ``config.yaml``; the group is the recipe, or ``<recipe>-<tag>`` for a variant of a
sweep, e.g. ``bf16-lr5e-6``: ``quads compare --variants``, ``logs/<run>.log``, and the call's ``env.txt``, ``plan.txt``,
``summary.txt``, ``pick.txt``, ``pretrain.log``, ``compare.log``, ``compare.md``, ``compare.json``).
Tarballs are landed in call order into one folder ``<dest>``:

- ``runs/<run>/``: the latest copy of each run's files (a later call that continued a run,
  ``CONTINUE=1``, holds all of its steps), ``logs/<run>.log`` the latest compare log of the run;
- ``calls/<NN>/``: the call's own text files, one folder per call, plus ``source.txt`` (the tarball's
  name and sha256; a tarball landed before is skipped);
- a file over ``GZIP_OVER`` bytes is stored gzipped (``metrics.jsonl.gz``; ``load_metrics`` reads both).

A tarball is refused (``LandingError``, nothing of it written) when one of its runs disagrees with the
landed copy: a resumed run must extend the landed one, so it has every landed step, and at each step the
two share its record is the same but for the wall-clock keys (``NONDETERMINISTIC``). A run started
over on a fresh machine (the device forgets ``runs/`` between leases) rewrites its steps and is refused;
land such a call under another ``<dest>``.

The collapse rule (``CollapseRule``, ``judge``), conservative: a run has collapsed when, at its end,

1. its held-out greedy pass@1 has stayed below ``frac`` (0.5) of its value at the start of RL and at
   least ``min_drop`` (0.1) under it, at each of its last ``evals`` (2) evaluations: the rollout
   engine's score (criterion ``eval``), or the trainer's own policy's when the run logged it
   (``eval_trainer``, criterion ``trainer``: under the mismatch amplifier the sampler's score falls with
   alpha while the trained policy may not); or
2. its train reward (``reward/mean``, trailing mean over ``window`` = 10 steps) has stayed below ``frac``
   of its running best (over full windows only) and at least ``min_drop`` under it, at each of its last
   ``steps`` (20) steps; or
3. a loss or log-prob gap went NaN/Inf (``nonfinite_keys``).

A run that fell and recovered by its end is not counted; a run too short for a criterion (fewer than
``evals`` evaluations after the start, fewer than ``steps`` full reward windows) cannot meet it. The
onset is the first step of the sustained stretch (the earliest onset over the criteria met). The
per-sequence gap is ``mismatch/seq_gap_mean`` (mean over responses of sum_t |logp_train - logp_rollout|,
``quads.metrics.mismatch``); its trend is the least-squares ``slope`` per step over every step, and over
the steps before the onset.

Report (``write_report``): ``<dest>/report/collapse.md`` (the rule, a per-group and a per-run table; the
group rows state each group's learning rate from its runs' ``config.yaml`` and its held-out gain: the mean
of the last ``TAIL_EVALS`` evaluations minus the start),
``collapse.png`` (held-out pass@1, per-sequence gap and train reward over steps, ``plot_seed_bands``),
``collapse.json``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quads.io import atomic_dir, atomic_write, atomic_write_text
from quads.metrics.report import (
    NONDETERMINISTIC,
    Column,
    finite_mean,
    json_safe,
    load_metrics,
    metrics_file,
    nonfinite_keys,
    plot_seed_bands,
    run_settings,
    series,
    slope,
    smooth,
    table,
    write_markdown,
)

GZIP_OVER = 1 << 16  # landed files larger than this (bytes) are stored gzipped (the repository's size)
TAIL_EVALS = 3  # held-out pass@1 at the end of a run: the mean of its last this many evaluations after the start
CALL_FILES = ("env.txt", "plan.txt", "summary.txt", "pick.txt", "pretrain.log", "compare.log", "compare.md",
              "compare.json")
EVAL_KEY, GAP_KEY, REWARD_KEY = "eval/pass@1", "mismatch/seq_gap_mean", "reward/mean"
TRAINER_EVAL_KEY = "eval/trainer_pass@1"  # the trainer's own policy (``eval_trainer``), when the runs logged it
PANELS = ((EVAL_KEY, "held-out pass@1 (greedy)", "linear"),
          (GAP_KEY, "per-sequence gap: sum_t |dlogp| (trailing mean)", "log"),
          (REWARD_KEY, "train reward (trailing mean)", "linear"))
TRAINER_PANEL = (TRAINER_EVAL_KEY, "held-out pass@1, the trainer's own policy", "linear")  # when logged


class LandingError(ValueError):
    """A tarball that cannot be landed: its runs rewrite the landed ones, or it is not a collapse call."""


# ---------------------------------------------------------------------- landing


def _comparable(rec: dict[str, Any]) -> dict[str, Any]:
    """A record without its wall-clock keys, NaN as a string (NaN != NaN)."""
    return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()
            if not k.startswith(NONDETERMINISTIC)}


def check_extends(name: str, landed: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """Raise ``LandingError`` unless ``new`` (a later call's records of run ``name``) extends ``landed``."""
    old = {int(r["step"]): r for r in landed}
    now = {int(r["step"]): r for r in new}
    missing = sorted(set(old) - set(now))
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise LandingError(f"run {name}: the tarball lacks landed steps {missing[:5]}{more} (landed up to step "
                           f"{max(old)}, the tarball up to {max(now, default=0)}): it was started over, not "
                           "continued (or the tarballs are out of call order); land this call under another tag")
    for step in sorted(old):
        a, b = _comparable(old[step]), _comparable(now[step])
        if a != b:
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise LandingError(f"run {name}: step {step} differs from the landed record in {keys[:6]} "
                               f"(landed {[a.get(k) for k in keys[:3]]}, tarball {[b.get(k) for k in keys[:3]]}): "
                               "a resumed run must extend the landed one, not rewrite it; land this call under "
                               "another tag")


def _store(src: Path, dst_dir: Path) -> Path:
    """Copy ``src`` into ``dst_dir`` (gzipped, ``.gz`` appended, when over ``GZIP_OVER``), removing the other
    form of the same file; returns the written path."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    plain, packed = dst_dir / src.name, dst_dir / f"{src.name}.gz"
    if src.stat().st_size > GZIP_OVER:
        atomic_write(packed, lambda p: p.write_bytes(gzip.compress(src.read_bytes(), mtime=0)))
        plain.unlink(missing_ok=True)
        return packed
    atomic_write(plain, lambda p: shutil.copyfile(src, p))
    packed.unlink(missing_ok=True)
    return plain


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def landed_calls(dest: Path) -> dict[str, str]:
    """sha256 -> call folder name of the tarballs landed in ``dest``."""
    out = {}
    for src in sorted((dest / "calls").glob("*/source.txt")):
        for line in src.read_text().splitlines():
            if line.startswith("sha256: "):
                out[line.split(": ", 1)[1]] = src.parent.name
    return out


def land(tarball: str | Path, dest: str | Path, say=print) -> str | None:
    """Land one ``results.tar.gz`` in ``dest``; returns its call folder name (None: landed before)."""
    tarball, dest = Path(tarball), Path(dest)
    if not tarball.is_file():
        raise LandingError(f"no tarball at {str(tarball)!r}; pass the results.tar.gz of a gpu_collapse.sh call")
    sha = _sha256(tarball)
    seen = landed_calls(dest)
    if sha in seen:
        say(f"{tarball}: landed before as calls/{seen[sha]}; skipped")
        return None
    with tempfile.TemporaryDirectory(prefix="collapse-land-") as tmp:
        try:
            with tarfile.open(tarball) as tf:
                tf.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError) as e:
            raise LandingError(f"{tarball}: not a readable tar.gz ({e})") from None
        root = Path(tmp)
        if not (root / "plan.txt").is_file() and not (root / "pretrain.log").is_file():
            raise LandingError(f"{tarball}: no plan.txt or pretrain.log inside; not a gpu_collapse.sh call")
        runs = sorted(p for p in (root / "runs").glob("*") if (p / "metrics.jsonl").is_file())
        for run in runs:  # check every run before writing anything
            if (dest / "runs" / run.name).is_dir():
                check_extends(run.name, load_metrics(dest / "runs" / run.name), load_metrics(run))
        call = f"{len(list((dest / 'calls').glob('*/source.txt'))) + 1:02d}"
        with atomic_dir(dest / "calls" / call) as cdir:
            for name in CALL_FILES:
                if (root / name).is_file():
                    _store(root / name, cdir)
            atomic_write_text(cdir / "source.txt", f"tarball: {tarball.name}\nsha256: {sha}\n"
                              f"runs: {', '.join(r.name for r in runs) or 'none'}\n")
        for run in runs:
            for f in sorted(p for p in run.iterdir() if p.is_file()):
                _store(f, dest / "runs" / run.name)
            log = root / "logs" / f"{run.name}.log"
            if log.is_file():
                _store(log, dest / "logs")
        say(f"{tarball}: landed as calls/{call} ({len(runs)} runs: "
            + ", ".join(f"{r.name} to step {load_metrics(r)[-1]['step']}" for r in runs) + ")")
        return call


# ---------------------------------------------------------------------- the collapse rule


@dataclass(frozen=True)
class CollapseRule:
    """When a run counts as collapsed (module docstring); every threshold is met at the run's end."""

    frac: float = 0.5  # below this fraction of the reference (pass@1 at the start; the reward's running best)
    min_drop: float = 0.1  # and at least this much (absolute) under the reference
    evals: int = 2  # held-out pass@1: at each of the last this many evaluations
    window: int = 10  # train reward (and the plotted gap): trailing mean over this many steps
    steps: int = 20  # train reward: at each of the last this many steps

    def __post_init__(self) -> None:
        if not 0 < self.frac < 1 or self.min_drop < 0 or min(self.evals, self.window, self.steps) < 1:
            raise ValueError(f"CollapseRule: need 0 < frac < 1, min_drop >= 0, evals, window, steps >= 1; "
                             f"got {self}")

    def text(self) -> str:
        return (f"collapsed = at the run's end, (1) held-out pass@1 < {self.frac:g} x its start value and "
                f"<= start - {self.min_drop:g} at each of the last {self.evals} evaluations (the rollout "
                "engine's score; the same for the trainer's own policy when the runs logged it), or (2) the train "
                f"reward (trailing mean over {self.window} steps) < {self.frac:g} x its running best (full "
                f"windows) and <= best - {self.min_drop:g} at each of the last {self.steps} steps, or (3) a NaN/Inf "
                "loss or log-prob gap; onset = first step of that sustained stretch; a run that recovered by its "
                "end is not collapsed")


def _sustained(steps: list[int], below: list[bool], need: int) -> int | None:
    """The first step of the trailing all-``below`` stretch when it has at least ``need`` entries, else None."""
    n = 0
    while n < len(below) and below[len(below) - 1 - n]:
        n += 1
    return steps[len(steps) - n] if n >= need else None


@dataclass
class Verdict:
    """One run judged by a ``CollapseRule``, with the numbers of the report table."""

    steps: int  # last step logged
    evals: int  # held-out evaluations, the start included
    eval_start: float
    eval_best: float
    eval_last: float
    eval_tail: float  # mean of the last TAIL_EVALS evaluations after the start (fewer when the run has fewer)
    reward_best: float  # best trailing-mean reward over full windows
    reward_last: float
    gap_start: float  # per-sequence gap: mean over the first / last ``window`` steps
    gap_last: float
    gap_slope: float  # least-squares slope per step of the per-sequence gap, every step
    gap_slope_before: float  # the same over the steps before the onset (every step when not collapsed)
    collapsed: bool
    onset: int | None
    criteria: str  # which of "eval", "trainer", "reward", "nonfinite" held, or "none"
    trainer_start: float = math.nan  # held-out pass@1 of the trainer's own policy (NaN: not logged)
    trainer_last: float = math.nan


def _eval_onset(steps: list[int], ev: list[float], rule: CollapseRule) -> int | None:
    """Onset of a sustained held-out collapse of ``ev`` (the start, then later evaluations), else None."""
    if len(ev) <= rule.evals or ev[0] <= 0:  # the start plus at least ``evals`` later evaluations
        return None
    below = [v < rule.frac * ev[0] and v <= ev[0] - rule.min_drop for v in ev[1:]]
    return _sustained(steps[1:], below, rule.evals)


def judge(records: list[dict[str, Any]], rule: CollapseRule = CollapseRule()) -> Verdict:
    ev_steps, ev = series(records, EVAL_KEY)
    rw_steps, rw = series(records, REWARD_KEY)
    gap_steps, gap = series(records, GAP_KEY)
    own_steps, own = series(records, TRAINER_EVAL_KEY)
    onsets: dict[str, int | None] = {"eval": _eval_onset(ev_steps, ev, rule),
                                     "trainer": _eval_onset(own_steps, own, rule)}
    sm = smooth(rw, rule.window)[rule.window - 1:]  # full windows only
    sm_steps = rw_steps[rule.window - 1:]
    best, low = -math.inf, []
    for v in sm:
        best = max(best, v)
        low.append(v < rule.frac * best and v <= best - rule.min_drop)
    if sm:
        onsets["reward"] = _sustained(sm_steps, low, rule.steps)
    bad = nonfinite_keys(records)
    if bad:
        onsets["nonfinite"] = min(int(r["step"]) for r in records if nonfinite_keys([r]))
    met = {k: s for k, s in onsets.items() if s is not None}
    onset = min(met.values()) if met else None
    before = [(x, y) for x, y in zip(gap_steps, gap) if onset is None or x < onset]
    w = rule.window
    return Verdict(
        steps=int(records[-1]["step"]) if records else 0, evals=len(ev),
        eval_start=ev[0] if ev else math.nan, eval_best=max(ev) if ev else math.nan,
        eval_last=ev[-1] if ev else math.nan, eval_tail=finite_mean(ev[1:][-TAIL_EVALS:]),
        reward_best=max(sm) if sm else math.nan, reward_last=sm[-1] if sm else math.nan,
        gap_start=finite_mean(gap[:w]), gap_last=finite_mean(gap[-w:]),
        gap_slope=slope(gap_steps, gap),
        gap_slope_before=slope([x for x, _ in before], [y for _, y in before]),
        collapsed=bool(met), onset=onset, criteria=", ".join(sorted(met)) or "none",
        trainer_start=own[0] if own else math.nan, trainer_last=own[-1] if own else math.nan)


# ---------------------------------------------------------------------- the report


def split_name(name: str) -> tuple[str, int]:
    """``"nvfp4-s2"`` -> ``("nvfp4", 2)``, ``"bf16-lr5e-6-s0"`` -> ``("bf16-lr5e-6", 0)``: (group, seed) of
    ``quads compare``'s run folder names."""
    group, sep, seed = name.rpartition("-s")
    if not group or not sep or not seed.isdigit():
        raise ValueError(f"run folder {name!r} is not named <group>-s<seed> (quads compare's run names)")
    return group, int(seed)


RUN_COLUMNS: list[Column] = [
    ("run", "run", "{}"),
    ("steps", "steps", "{:d}"),
    ("evals", "evals", "{:d}"),
    ("pass@1 start", "eval_start", "{:.3f}"),
    ("pass@1 best", "eval_best", "{:.3f}"),
    ("pass@1 last", "eval_last", "{:.3f}"),
    (f"pass@1 last {TAIL_EVALS} (mean)", "eval_tail", "{:.3f}"),
    ("reward best", "reward_best", "{:.3f}"),
    ("reward last", "reward_last", "{:.3f}"),
    ("seq gap first", "gap_start", "{:.3f}"),
    ("seq gap last", "gap_last", "{:.3f}"),
    ("seq gap slope /step", "gap_slope", "{:.2e}"),
    ("slope before onset", "gap_slope_before", "{:.2e}"),
    ("collapsed", "collapsed", "{}"),
    ("onset step", "onset", "{}"),
    ("criteria", "criteria", "{}"),
]
TRAINER_COLUMNS: list[Column] = [  # added when a run logged eval/trainer_pass@1 (eval_trainer)
    ("trainer's policy pass@1 start", "trainer_start", "{:.3f}"),
    ("trainer's policy pass@1 last", "trainer_last", "{:.3f}"),
]
RECIPE_COLUMNS: list[Column] = [
    ("group", "recipe", "{}"),
    ("lr", "lr", "{}"),
    ("seeds", "seeds", "{}"),
    ("steps reached", "steps", "{}"),
    ("collapsed (seed@onset)", lambda r: ", ".join(f"s{s}@{o}" for s, o in r["collapsed"]) or "none", "{}"),
    ("pass@1 start (mean)", "eval_start", "{:.3f}"),
    ("pass@1 last (mean)", "eval_last", "{:.3f}"),
    (f"pass@1 last {TAIL_EVALS} (mean)", "eval_tail", "{:.3f}"),
    ("gain (mean)", "gain", "{:+.3f}"),
    ("seq gap slope /step (mean)", "gap_slope", "{:.2e}"),
    ("slope before onset (collapsed seeds)", "gap_slope_before", "{:.2e}"),
    ("gap rising before onset (collapsed seeds)", "rising", "{}"),
]


def load_runs(dest: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Run name -> records of every landed run under ``dest/runs``, sorted by group then seed."""
    root = Path(dest) / "runs"
    dirs = [p for p in root.glob("*") if metrics_file(p) is not None]
    if not dirs:
        raise ValueError(f"no landed runs under {str(root)!r}; land a call first (scripts/collapse_report.py land)")
    return {p.name: load_metrics(p) for p in sorted(dirs, key=lambda p: split_name(p.name))}


def recipe_rows(verdicts: dict[str, Verdict], settings: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per group (recipe, or recipe-variant) over its seeds; ``settings``: run name -> ``run_settings``."""
    by: dict[str, list[tuple[int, Verdict]]] = {}
    lrs: dict[str, list[str]] = {}
    for name, v in verdicts.items():
        recipe, seed = split_name(name)
        by.setdefault(recipe, []).append((seed, v))
        lr = (settings or {}).get(name, {}).get("lr_text")
        if lr is not None and lr not in lrs.setdefault(recipe, []):
            lrs[recipe].append(lr)
    rows = []
    for recipe, vs in by.items():
        steps = [v.steps for _, v in vs]
        rows.append({
            "recipe": recipe, "lr": " / ".join(lrs.get(recipe, [])) or "n/a", "seeds": ",".join(str(s) for s, _ in vs),
            "steps": f"{min(steps)}" if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}",
            "collapsed": [(s, v.onset) for s, v in vs if v.collapsed],
            "eval_start": finite_mean([v.eval_start for _, v in vs]),
            "eval_last": finite_mean([v.eval_last for _, v in vs]),
            "eval_tail": finite_mean([v.eval_tail for _, v in vs]),
            "gain": finite_mean([v.eval_tail - v.eval_start for _, v in vs]),
            "gap_slope": finite_mean([v.gap_slope for _, v in vs]),
            "gap_slope_before": finite_mean([v.gap_slope_before for _, v in vs if v.collapsed]),
            "rising": f"{sum(v.gap_slope_before > 0 for _, v in vs if v.collapsed)}/{sum(v.collapsed for _, v in vs)}",
        })
    return rows


Curve = tuple[list[int], list[float]]  # (steps, values)


def curves(runs: dict[str, list[dict[str, Any]]], window: int) -> dict[str, dict[str, list[Curve]]]:
    """``curves[recipe][key]`` = per seed ``(steps, values)`` of ``PANELS``' keys; the gap and the reward as
    trailing means over ``window`` steps."""
    out: dict[str, dict[str, list[Curve]]] = {}
    for name, recs in runs.items():
        recipe, _ = split_name(name)
        for key, _, _ in (*PANELS, TRAINER_PANEL):
            xs, ys = series(recs, key)
            if key not in (EVAL_KEY, TRAINER_EVAL_KEY):
                ys = smooth(ys, window)
            if xs:  # the trainer's policy only where the run logged it
                out.setdefault(recipe, {}).setdefault(key, []).append((xs, ys))
    return out


def write_report(dest: str | Path, rule: CollapseRule = CollapseRule(), command: str = "") -> Path:
    """``dest/report/``: collapse.md, collapse.png, collapse.json from the runs landed in ``dest``."""
    dest = Path(dest)
    runs = load_runs(dest)
    verdicts = {name: judge(recs, rule) for name, recs in runs.items()}
    out = dest / "report"
    marks: dict[str, list[tuple[int, float]]] = {}
    for name, v in verdicts.items():
        if v.onset is not None:
            ev = dict(zip(*series(runs[name], EVAL_KEY)))
            at = [s for s in ev if s >= v.onset]
            marks.setdefault(split_name(name)[0], []).append((at[0], ev[at[0]]) if at else (v.onset, v.eval_last))
    trainer = any(not math.isnan(v.trainer_last) for v in verdicts.values())
    panels = (PANELS[0], TRAINER_PANEL, *PANELS[1:]) if trainer else PANELS
    plot_seed_bands(curves(runs, rule.window), panels, out / "collapse.png", marks)
    rows = recipe_rows(verdicts, {name: run_settings(dest / "runs" / name) for name in runs})
    calls = sorted(p.name for p in (dest / "calls").glob("*") if p.is_dir())
    write_markdown(out / "collapse.md", [
        f"# Collapse runs: {dest.name}",
        f"Landed calls: {', '.join(calls) or 'none'} (`calls/<NN>/`: plan, summary, logs of each call); runs "
        f"`runs/<group>-s<seed>/metrics.jsonl[.gz]` (group: the recipe, or `<recipe>-<variant>` of a sweep)."
        + (f" Made by `{command}`." if command else ""),
        f"Rule: {rule.text()}.",
        table(rows, RECIPE_COLUMNS),
        table([{"run": n, **asdict(v)} for n, v in verdicts.items()],
              RUN_COLUMNS + (TRAINER_COLUMNS if trainer else [])),
        "Columns: lr = the groups' learning rate (with its linear warmup in optimizer steps) from the runs' "
        f"config.yaml; pass@1 = held-out greedy pass@1 (`eval/pass@1`; start = step 0, the start of RL; last {TAIL_EVALS} = "
        f"mean of the last {TAIL_EVALS} evaluations after the start; gain = that minus the start, mean over seeds); reward = "
        f"`reward/mean`, trailing mean over {rule.window} steps, best over full windows; "
        "trainer's policy pass@1 (when logged) = the same prompts decoded with the trainer's own weights and "
        "forward (`eval/trainer_pass@1`, `eval_trainer`); seq gap = "
        f"`mismatch/seq_gap_mean` (mean over responses of sum_t |logp_train - logp_rollout|), first / last = mean "
        f"over the first / last {rule.window} steps, slope = least-squares slope per step (before onset: the "
        "steps before the collapse onset; every step when none). Figure: mean over seeds (steps every seed "
        "logged), min-max band shaded, each seed thin; crosses = collapse onsets (the first evaluation from "
        "the onset); the trainer's policy has its own panel when logged.",
        "![collapse](collapse.png)",
    ])
    atomic_write_text(out / "collapse.json", json.dumps({
        "rule": asdict(rule), "recipes": [json_safe(r) for r in rows],
        "runs": {n: json_safe(asdict(v)) for n, v in verdicts.items()}}, indent=1) + "\n")
    return out


def land_all(tarballs: Sequence[str | Path], dest: str | Path, say=print) -> list[str | None]:
    """``land`` each tarball in order (call order); stops at the first refused one (those before stay)."""
    return [land(t, dest, say=say) for t in tarballs]
