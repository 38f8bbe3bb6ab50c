"""``quads compare``: the same GRPO job under several precision recipes and seeds; one report.

Every run gets the same ``TrainConfig`` (``--train-config`` YAML, then ``--set`` overrides) except
``recipe.name``, ``seed`` and ``out_dir``. The starting policy is resolved once (the cached warm start
of ``model.preset``, with the base config's seed) and passed to every run as ``model.checkpoint``, so
all recipes and seeds start from the same weights and train on the same task data; the seed changes
the training prompts and their order and the engine's sampling. The held-out prompts are the same for
every run: an unset ``task.eval_seed`` is pinned to the base config's ``seed`` (a dataset task has one
held-out split per seed, so its runs are scored on their own seed's records).

``variants`` adds one axis of settings, e.g. a learning-rate sweep: ``"optim.lr=5e-6;optim.lr=2e-5"``
(``;`` between variants, each a ``set``-style list of overrides applied over the shared config). Every
recipe then runs every variant and seed, in the run group ``<recipe>-<tag>`` (the tag: each override's
last key part and value as written, ``-``-joined: ``bf16-lr5e-6``, ``bf16-lr2e-5-warmup_steps20``);
the report's rows are those groups. A variant cannot change what is shared by construction (the seed,
the recipe, the starting checkpoint and its warm start). ``base`` is the shared config alone (the group
``<recipe>``), and a ``<recipe>+<recipe>:`` prefix runs a variant for those recipes only, so one compare
can hold the plain recipes beside an ablation of one of them:
``"base;nvfp4:recipe.rollout_error_scale=4;nvfp4:correction.kind=tis"`` with recipes ``bf16,nvfp4,quads``
runs ``bf16``, ``nvfp4``, ``quads``, ``nvfp4-rollout_error_scale4`` and ``nvfp4-kindtis``.

Each (recipe, variant, seed) is one ``quads train --config <run>.yaml`` subprocess; ``parallel`` of them
run at once. A run that exits non-zero (or passes ``timeout_s``) is reported with its exit code and the tail
of its log; the others go on and the report covers what finished.

Calling ``quads compare`` again on the same ``out_dir`` (with ``reuse`` and ``resume``, the defaults)
skips the runs that logged every planned step and continues the others from their latest checkpoint
(``train.resume``: weights, optimizer, sampler and RNG states, so the metrics equal an uninterrupted
run's); a run without a checkpoint starts again. So a compare larger than one time-limited call
(``train.time_limit_s``, ``timeout_s``; e.g. a GPU lease of 10 minutes) is finished by calling it again,
with ``steps`` the whole run's length. ``train.time_limit_s`` counts afresh in every call.

Report (``out_dir``): ``compare.md`` (per-recipe table over seeds + per-run table + crashes + plots),
``compare.json``, ``compare.png`` (reward, held-out pass@1, gap max and k3 against steps, every recipe
on one figure, mean over seeds), ``runs/<recipe>[-<tag>]-s<seed>/`` (each run's folder, ``metrics.jsonl``),
``report/`` (``quads.metrics.report.write_compare_report`` over every finished run).

Table columns, per recipe over its finished seeds: final reward (smoothed, ``summarize``), held-out
pass@1 at the end (mean, and spread = max - min over seeds), max over steps of the per-step gap max,
mean over steps of the per-step gap mean and of k3, collapse (``summarize``'s rule; the step is the
first at which the rule holds on the records up to that step), rollout tokens/s (mean over steps); the
trend of the gap (least-squares slope per step of k3 and of the per-sequence gap, mean over seeds) and
each run's IS correction, mini-batches and rollout error scale (from its config.yaml; ``run_settings``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from quads.config import add_dataclass_args, build_config, from_dict, save_config, to_dict
from quads.io import atomic_write_text
from quads.metrics.report import (
    COMPARE_PANELS,
    Column,
    finite_mean,
    json_safe,
    load_metrics,
    metrics_file,
    plot_compare,
    run_settings,
    smooth,
    summarize,
    table,
    write_compare_report,
    write_markdown,
)

ALL_RECIPES = "bf16,fp8,nvfp4,w4a16-qat,w4a4-qat,quads"
# TrainConfig fields a variant may not set: compare sets them per run, or resolves them once for all runs
VARIANT_FIXED = ("seed", "out_dir", "resume", "recipe.name", "model.checkpoint", "model.preset")


@dataclass
class CompareConfig:
    """``quads compare``: which recipes and seeds, the shared training config, how to run."""

    recipes: str = ALL_RECIPES  # comma-separated recipe presets
    seeds: str = "0"  # comma-separated seeds; every recipe runs every seed
    train_config: str | None = None  # YAML with TrainConfig fields shared by every run
    set: str = ""  # extra shared TrainConfig overrides: "steps=50,optim.lr=1e-3,rollout.max_new_tokens=48"
    variants: str = ""  # ";"-separated override sets, each a run group per recipe: "optim.lr=5e-6;optim.lr=2e-5" (runs <recipe>-lr5e-6-s<seed> ...); "base" = the shared config alone; a "nvfp4+quads:" prefix limits a variant to those recipes
    parallel: int = 2  # runs at once (processes)
    threads: int = 1  # torch CPU threads per run (train.threads), unless the config sets it
    gpus: str = "auto"  # CUDA devices to spread runs over, e.g. "0,1" (each run sees one); auto: all visible, none: off
    timeout_s: float = 0  # kill a run after this many seconds (0: no limit); it is reported as crashed
    report_only: bool = False  # rebuild the report from the runs already in out_dir (no training, no set-up)
    reuse: bool = True  # skip runs whose folder already holds a finished run (all planned steps logged); false: start every run again
    resume: bool = True  # continue an unfinished run (stopped by train.time_limit_s, killed at timeout_s) from its latest checkpoint
    out_dir: str = "runs/compare"  # report folder; runs go to <out_dir>/runs/<recipe>-s<seed>
    python: str = sys.executable  # interpreter for the run subprocesses

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ValueError(f"parallel must be >= 1; got {self.parallel}")
        if not self.recipe_list() or not self.seed_list():
            raise ValueError(f"need at least one recipe and one seed; got recipes={self.recipes!r} seeds={self.seeds!r}")
        from quads.quant.recipe import PRESETS

        bad = [r for r in self.recipe_list() if r not in PRESETS]
        if bad:
            raise ValueError(f"unknown recipe(s) {bad}; valid: {', '.join(PRESETS)}")
        self.variant_list()  # raises on a malformed one

    def variant_list(self) -> list[tuple[str, dict[str, Any], tuple[str, ...] | None]]:
        """``[(tag, nested overrides, recipes)]`` of ``variants`` (recipes: those a ``<r>+<r>:`` prefix limits
        the variant to, None = all); ``[("", {}, None)]`` (the shared config alone) when unset."""
        out: list[tuple[str, dict[str, Any], tuple[str, ...] | None]] = []
        for text in [v for v in self.variants.split(";") if v.strip()]:
            only = None
            head, sep, rest = text.partition(":")
            if sep and "=" not in head:  # "nvfp4+quads: recipe.rollout_error_scale=4"
                only = tuple(r.strip() for r in head.split("+") if r.strip())
                unknown = [r for r in only if r not in self.recipe_list()]
                if not only or unknown:
                    raise ValueError(f"variants: {text.strip()!r} names recipes {list(only) or head!r} that are "
                                     f"not among the compare's recipes {self.recipe_list()}")
                text = rest
            if text.strip() == "base":  # the shared config alone, as the run group <recipe>
                out.append(("", {}, only))
                continue
            items = [i.strip() for i in text.split(",") if i.strip()]
            keys = [i.partition("=")[0].strip() for i in items]
            fixed = [k for k in keys if k in VARIANT_FIXED or k.startswith("warm_start.")]
            if fixed:
                raise ValueError(f"variants: {fixed} cannot vary within a compare (it sets the recipe, seed and "
                                 "folder of every run and resolves one starting checkpoint); run another compare")
            tag = "-".join(f"{k.rpartition('.')[2]}{i.partition('=')[2].strip()}" for k, i in zip(keys, items))
            if not re.fullmatch(r"[A-Za-z0-9._+-]+", tag):
                raise ValueError(f"variants: {text.strip()!r} gives the run-name tag {tag!r}; use values made of "
                                 "letters, digits and . _ + - (they name the run folders)")
            out.append((tag, _parse_set(text), only))
        tags = [t for t, _, _ in out]
        if len(set(tags)) < len(tags):
            raise ValueError(f"variants: two variants give the same tag ({tags}; 'base' is the shared config's); "
                             "make them differ")
        idle = [r for r in self.recipe_list() if out and not any(o is None or r in o for _, _, o in out)]
        if idle:
            raise ValueError(f"variants: no variant applies to recipe(s) {idle}; add 'base' (the shared config) "
                             "or drop them from recipes")
        return out or [("", {}, None)]

    def groups(self) -> list[tuple[str, str, dict[str, Any]]]:
        """``[(group, recipe, overrides)]``: every recipe x the variants that apply to it; group = ``<recipe>``
        or ``<recipe>-<tag>``."""
        return [(f"{r}-{tag}" if tag else r, r, over) for r in self.recipe_list()
                for tag, over, only in self.variant_list() if only is None or r in only]

    def recipe_list(self) -> list[str]:
        return [r.strip() for r in self.recipes.split(",") if r.strip()]

    def seed_list(self) -> list[int]:
        try:
            return [int(s) for s in str(self.seeds).split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"seeds must be comma-separated integers; got {self.seeds!r}") from None


@dataclass
class RunOutcome:
    name: str  # <group>-s<seed>
    recipe: str
    seed: int
    run_dir: str
    returncode: int | None  # None: not started
    seconds: float
    log_tail: str  # last lines of the run's stdout+stderr when it failed
    reused: bool = False
    resumed_from: int | None = None  # the checkpoint step an unfinished run was continued from
    group: str = ""  # <recipe> or <recipe>-<variant tag> (CompareConfig.groups); "" = the recipe

    @property
    def label(self) -> str:
        return self.group or self.recipe

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _parse_set(text: str) -> dict[str, Any]:
    """"a.b=1,c=x" -> nested {"a": {"b": 1}, "c": "x"} (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for item in [s for s in text.split(",") if s.strip()]:
        if "=" not in item:
            raise ValueError(f"set: expected key=value items separated by commas; got {item!r}")
        key, value = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def base_train_config(cfg: CompareConfig):
    """The shared ``TrainConfig`` (YAML <- set), with the starting checkpoint resolved once."""
    from quads.rl.config import TrainConfig

    data: dict[str, Any] = {}
    if cfg.train_config:
        p = Path(cfg.train_config)
        if not p.is_file():
            raise ValueError(f"train_config: file {cfg.train_config!r} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
    data = _merge(data, _parse_set(cfg.set))
    data.setdefault("threads", cfg.threads)
    base = from_dict(TrainConfig, data, "train config")
    for tag, over, _ in cfg.variant_list():  # every variant's config is valid before anything is resolved or run
        if over:
            try:
                from_dict(TrainConfig, _merge(data, over), f"variant {tag}")
            except ValueError as e:
                raise ValueError(f"variants: {tag}: {e}") from None
    _check_groups(cfg, data)
    if base.task.difficulty is None and base.task.dataset is None:
        # pin the task's current default level: every run (and a rerun later) must see the same prompts
        from quads.rl.build import build_task

        level = getattr(build_task(base), "difficulty", None)
        if isinstance(level, int):
            base = dataclasses.replace(base, task=dataclasses.replace(base.task, difficulty=level))
    if base.task.eval_seed is None and base.task.name != "dataset":
        # one held-out set for every seed of the compare (else each run seed draws its own)
        base = dataclasses.replace(base, task=dataclasses.replace(base.task, eval_seed=base.seed))
    if base.model.checkpoint is None:
        from quads.rl.build import warm_start_checkpoint

        ckpt = warm_start_checkpoint(base)
        base = dataclasses.replace(base, model=dataclasses.replace(base.model, checkpoint=str(ckpt)))
    return base


def _check_groups(cfg: CompareConfig, data: dict) -> None:
    """Every run group's recipe resolves and allows its settings (``microbatch.check_recipe``), before the
    warm start or any run: a group that ``quads train`` would refuse fails the compare, not its runs."""
    from quads.rl import microbatch
    from quads.rl.build import build_recipe
    from quads.rl.config import TrainConfig

    for group, recipe, over in cfg.groups():
        merged = _merge(_merge(data, over), {"recipe": {"name": recipe}})
        try:
            tc = from_dict(TrainConfig, merged, f"run group {group}")
            microbatch.check_recipe(tc, build_recipe(tc))
        except ValueError as e:
            raise ValueError(f"run group {group}: {e}") from None


def plan_runs(cfg: CompareConfig, base) -> list[tuple[str, Any]]:
    """``[(name, TrainConfig)]``: one per (recipe, variant, seed), differing only in recipe, the variant's
    overrides, seed and out_dir; named ``<group>-s<seed>``."""
    from quads.rl.config import TrainConfig

    runs = []
    for group, recipe, over in cfg.groups():
        tc0 = from_dict(TrainConfig, _merge(to_dict(base), over), f"variant {group}") if over else base
        for seed in cfg.seed_list():
            name = f"{group}-s{seed}"
            tc = dataclasses.replace(tc0, recipe=dataclasses.replace(tc0.recipe, name=recipe), seed=seed,
                                     out_dir=str(Path(cfg.out_dir) / "runs" / name), resume=False)
            runs.append((name, tc))
    return runs


def _group(name: str) -> str:
    """``<group>-s<seed>`` -> ``<group>``."""
    return name.rpartition("-s")[0]


def _train_command(python: str, config_path: Path) -> list[str]:
    if importlib.util.find_spec("quads.rl.cli") is not None:
        return [python, "-m", "quads.cli", "train", "--config", str(config_path)]
    # quads.rl.cli not in this build: the same job through the trainer's public API
    code = ("import sys; from quads.config import build_config; from quads.rl.config import TrainConfig; "
            "from quads.rl.trainer import GRPOTrainer; "
            "GRPOTrainer(build_config(TrainConfig, sys.argv[1]), quiet=True).run()")
    return [python, "-c", code, str(config_path)]


def _finished(run_dir: Path, tc) -> bool:
    """The run logged every planned step (or its mismatch guard stopped it with ``guard.action=abort``) and
    wrote its policy; a run that a time limit stopped early is not finished."""
    if not ((run_dir / "policy" / "config.json").is_file() and (run_dir / "metrics.jsonl").is_file()):
        return False
    try:
        recs = load_metrics(run_dir)
    except ValueError:
        return False
    if not recs:
        return False
    last = recs[-1]
    return int(last["step"]) >= tc.steps or (tc.guard.action == "abort" and last.get("guard/tripped") == 1.0)


def _checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's latest complete checkpoint (``quads.rl.checkpoint``), None without one."""
    from quads.rl.checkpoint import latest_checkpoint

    try:
        ckpt = latest_checkpoint(run_dir)
    except ValueError:
        return None
    return None if ckpt is None else int(ckpt.name.rpartition("_")[2])


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _spreadable(tc) -> bool:
    """A run on the default CUDA device (an explicit ``cuda:N`` is left where the user put it)."""
    return str(tc.device) in ("cuda", "cuda:0")


def gpu_list(cfg: CompareConfig, runs: list[tuple[str, Any]]) -> list[str]:
    """The CUDA device ids to spread CUDA runs over (``[]``: leave ``CUDA_VISIBLE_DEVICES`` alone)."""
    if cfg.gpus == "none" or not any(_spreadable(tc) for _, tc in runs):
        return []
    if cfg.gpus != "auto":
        ids = [g.strip() for g in cfg.gpus.split(",") if g.strip()]
        if not ids or not all(g.isdigit() for g in ids):
            raise ValueError(f"gpus must be 'auto', 'none' or comma-separated device ids like '0,1'; got {cfg.gpus!r}")
        return ids
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def launch(cfg: CompareConfig, runs: list[tuple[str, Any]], say=print) -> list[RunOutcome]:
    """Run every planned job, ``cfg.parallel`` at a time; never raises for a failing run.

    CUDA runs are spread over ``gpu_list``: each new run gets the device with the fewest active runs
    (through ``CUDA_VISIBLE_DEVICES``, so it sees that one GPU as ``cuda:0``)."""
    out = Path(cfg.out_dir)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    pending = list(runs)
    gpus = gpu_list(cfg, runs)
    on_gpu: dict[str, str] = {}  # active run -> its device id
    active: dict[str, tuple[subprocess.Popen, float, Any, Path, Any, int | None]] = {}
    outcomes: dict[str, RunOutcome] = {}
    while pending or active:
        while pending and len(active) < cfg.parallel:
            name, tc = pending.pop(0)
            run_dir = Path(tc.out_dir)
            if cfg.reuse and _finished(run_dir, tc):
                outcomes[name] = RunOutcome(name, tc.recipe.name, tc.seed, str(run_dir), 0, 0.0, "", reused=True,
                                            group=_group(name))
                say(f"compare: {name}: reusing the finished run in {run_dir}")
                continue
            start = _checkpoint_step(run_dir) if cfg.reuse and cfg.resume else None
            if start is not None:  # exact resume (quads.rl.trainer): the trainer checks the config is the run's
                tc = dataclasses.replace(tc, resume=True)
                say(f"compare: {name}: continuing the unfinished run in {run_dir} from its step-{start} checkpoint")
            elif run_dir.exists():  # a stale or crashed attempt without a checkpoint: start clean
                import shutil

                shutil.rmtree(run_dir)
            cpath = out / "configs" / f"{name}.yaml"
            save_config(tc, cpath)
            log = open(out / "logs" / f"{name}.log", "a" if start is not None else "w")
            run_env, where = env, ""
            if gpus and _spreadable(tc):
                gpu = min(gpus, key=lambda g: sum(v == g for v in on_gpu.values()))
                on_gpu[name] = gpu
                run_env, where = {**env, "CUDA_VISIBLE_DEVICES": gpu}, f" on GPU {gpu}"
            proc = subprocess.Popen(_train_command(cfg.python, cpath), stdout=log, stderr=subprocess.STDOUT,
                                    env=run_env)
            active[name] = (proc, time.monotonic(), tc, out / "logs" / f"{name}.log", log, start)
            say(f"compare: started {name} (pid {proc.pid}){where}")
        time.sleep(0.5)
        for name in list(active):
            proc, t0, tc, log_path, log, start = active[name]
            rc = proc.poll()
            elapsed = time.monotonic() - t0
            if rc is None and cfg.timeout_s and elapsed > cfg.timeout_s:
                proc.kill()
                rc = proc.wait()
                with open(log_path, "a") as f:
                    f.write(f"\nquads compare: killed after {elapsed:.0f}s (timeout_s={cfg.timeout_s:g})\n")
            if rc is None:
                continue
            log.close()
            del active[name]
            on_gpu.pop(name, None)
            tail = "" if rc == 0 else _tail(log_path)
            outcomes[name] = RunOutcome(name, tc.recipe.name, tc.seed, tc.out_dir, rc, elapsed, tail,
                                        resumed_from=start, group=_group(name))
            say(f"compare: {name} {'finished' if rc == 0 else f'FAILED (exit {rc})'} in {elapsed:.0f}s")
    return [outcomes[name] for name, _ in runs]


# ---------------------------------------------------------------------- summary


def collapse_step(records: list[dict[str, Any]]) -> int | None:
    """The step from which ``summarize``'s collapse rule holds on the records up to every later step
    (so a transient dip early in the run that later recovers does not date the collapse); None when the
    rule does not hold on the whole run."""
    if not records or not summarize(records)["collapse"]:
        return None
    first = len(records)
    for i in range(len(records), 0, -1):
        if not summarize(records[:i])["collapse"]:
            break
        first = i
    return int(records[first - 1]["step"])


def run_summary(run_dir: str) -> dict[str, Any]:
    recs = load_metrics(run_dir)
    s = summarize(recs)
    s["collapse_step"] = collapse_step(recs) if s["collapse"] else None
    s["rollout_tokens_per_s"] = finite_mean([r.get("perf/rollout_tokens_per_s", math.nan) for r in recs])
    s.update(run_settings(run_dir))
    return s


def _values(done: list[dict[str, Any]], key: str) -> str:
    """The distinct values of ``key`` over a recipe's runs, in order, ``/``-joined (``n/a`` when none has it)."""
    vals = list(dict.fromkeys(f"{s[key]:g}" if isinstance(s[key], float) else str(s[key])
                              for s in done if s.get(key) is not None))
    return " / ".join(vals) if vals else "n/a"


def recipe_table(cfg: CompareConfig, outcomes: list[RunOutcome], per_run: dict[str, dict]) -> list[dict[str, Any]]:
    rows = []
    for recipe, _, _ in cfg.groups():  # a recipe, or <recipe>-<variant tag>
        mine = [o for o in outcomes if o.label == recipe]
        done = [per_run[o.name] for o in mine if o.name in per_run]
        ev = [s["eval_end"] for s in done if math.isfinite(s["eval_end"])]
        coll = [(o.seed, per_run[o.name]["collapse_step"]) for o in mine
                if o.name in per_run and per_run[o.name]["collapse"]]
        rows.append({
            "recipe": recipe, "seeds": len(mine), "finished": sum(o.ok for o in mine),
            "steps": min([s["steps"] for s in done], default=0),
            "crashed": [o.name for o in mine if not o.ok],
            "reward_final": finite_mean([s["reward_final"] for s in done]),
            "eval_start": finite_mean([s["eval_start"] for s in done]),
            "eval_end": finite_mean(ev), "eval_end_spread": (max(ev) - min(ev)) if ev else math.nan,
            "gap_max": max([s["gap_max"] for s in done if math.isfinite(s["gap_max"])], default=math.nan),
            "gap_max_step": finite_mean([s["gap_max_step"] for s in done]),
            "gap_mean": finite_mean([s["gap_mean"] for s in done]),
            "k3_mean": finite_mean([s["k3_mean"] for s in done]),
            "k3_slope": finite_mean([s["k3_slope"] for s in done]),
            "seq_gap_mean": finite_mean([s["seq_gap_mean"] for s in done]),
            "seq_gap_slope": finite_mean([s["seq_gap_slope"] for s in done]),
            "correction": _values(done, "correction"),
            "mini_batches": _values(done, "mini_batches_text"),
            "error_scale": _values(done, "error_scale"),
            "collapsed": coll,
            "rollout_tokens_per_s": finite_mean([s["rollout_tokens_per_s"] for s in done]),
        })
    return rows


RECIPE_COLUMNS: list[Column] = [
    ("recipe", "recipe", "{}"),
    ("runs ok", lambda r: f"{r['finished']}/{r['seeds']}", "{}"),
    ("steps", lambda r: r.get("steps", "n/a"), "{}"),
    ("final reward", "reward_final", "{:.3f}"),
    ("held-out pass@1 start", "eval_start", "{:.3f}"),
    ("held-out pass@1 end (mean)", "eval_end", "{:.3f}"),
    ("spread over seeds", "eval_end_spread", "{:.3f}"),
    ("gap max", "gap_max", "{:.3f}"),
    ("gap max (step mean)", "gap_max_step", "{:.3f}"),
    ("gap mean", "gap_mean", "{:.4f}"),
    ("k3 mean", "k3_mean", "{:.2e}"),
    ("k3 slope /step", "k3_slope", "{:.2e}"),
    ("seq gap mean", "seq_gap_mean", "{:.3f}"),
    ("seq gap slope /step", "seq_gap_slope", "{:.2e}"),
    ("IS correction", "correction", "{}"),
    ("mini-batches", "mini_batches", "{}"),
    ("rollout error x", "error_scale", "{}"),
    ("collapsed (seed@step)", lambda r: ", ".join(f"s{s}@{st}" for s, st in r["collapsed"]) or "no", "{}"),
    ("rollout tok/s", "rollout_tokens_per_s", "{:.0f}"),
]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The per-recipe table of ``recipe_table`` rows."""
    return table(rows, RECIPE_COLUMNS)


def recipe_curves(runs: dict[str, list[str]]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """Per recipe, per ``COMPARE_PANELS`` metric: (steps, mean over the recipe's run folders of the finite
    values logged at that step); the reward is smoothed as the report smooths it."""
    curves: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for recipe, dirs in runs.items():
        recs = [load_metrics(d) for d in dirs]
        curves[recipe] = {}
        for key, _ in COMPARE_PANELS:
            by_step: dict[int, list[float]] = {}
            for rr in recs:
                for r in rr:
                    v = r.get(key)
                    if isinstance(v, int | float) and math.isfinite(v):
                        by_step.setdefault(int(r["step"]), []).append(float(v))
            xs = sorted(by_step)
            ys = [sum(by_step[x]) / len(by_step[x]) for x in xs]
            if key == "reward/mean":  # trailing moving average, as the report smooths
                ys = smooth(ys, max(1, len(ys) // 10))
            curves[recipe][key] = (xs, ys)
    return curves


def write_report(cfg: CompareConfig, base, outcomes: list[RunOutcome]) -> Path:
    out = Path(cfg.out_dir)
    per_run = {}
    for o in outcomes:  # failed runs (e.g. killed at timeout_s) still show what they logged
        try:
            recs = run_summary(o.run_dir)
        except ValueError as e:
            if o.ok:  # finished with no metrics: report it as a failure
                o.returncode, o.log_tail = -1, f"no readable metrics: {e}"
            continue
        if recs["steps"] > 0:
            per_run[o.name] = recs
    rows = recipe_table(cfg, outcomes, per_run)
    finished = {o.name: o.run_dir for o in outcomes if o.name in per_run}
    by_recipe: dict[str, list[str]] = {}
    for o in outcomes:
        if o.name in per_run:
            by_recipe.setdefault(o.label, []).append(o.run_dir)
    if finished:
        write_compare_report(finished, out / "report", title="quads compare: every run")
        plot_compare(recipe_curves(by_recipe), out / "compare.png")
    crashed = [o for o in outcomes if not o.ok]
    b = base
    parts = [
        "# quads compare",
        f"Recipes {cfg.recipes}; seeds {cfg.seeds}. Shared config: checkpoint `{b.model.checkpoint}`, task "
        f"{b.task.name} (difficulty {b.task.difficulty}), {b.steps} steps of {b.rollout.prompts_per_step} prompts x "
        f"{b.rollout.n_samples} samples, max_new_tokens {b.rollout.max_new_tokens}, lr {b.optim.lr:g}, dtype "
        f"{b.dtype}, device {b.device}, eval every {b.eval_every} steps on {b.eval_n} held-out prompts, "
        f"IS correction {b.correction.kind}, {b.optim.mini_batches} mini-batch(es) x {b.optim.ppo_epochs} PPO "
        f"epoch(s) per step, rollout error scale {b.recipe.rollout_error_scale:g}. "
        + (f"Variants (one row per recipe x variant, each replacing the shared settings above): `{cfg.variants}`. "
           "Every run's config: `configs/<recipe>-<variant>-s<seed>.yaml`." if cfg.variants.strip()
           else "Every run's config: `configs/<recipe>-s<seed>.yaml`."),
        markdown_table(rows),
        "Columns over the seeds of a recipe that logged steps (a failed run, e.g. one killed at `timeout_s`, counts with what it logged; runs ok counts clean exits; steps = the fewest steps any seed logged, fewer than planned when a run hit train.time_limit_s): final reward = smoothed last reward (mean over seeds); "
        "held-out pass@1 = greedy on the rollout engine, at step 0 and at the end; spread = max - min over "
        "seeds; gap max = max over steps and seeds of the per-step max |logp_rollout - logp_train|; gap max (step "
        "mean) = that per-step max averaged over steps and seeds; gap mean, "
        "k3 = mean over steps and seeds; k3 slope and seq gap slope = least-squares slope over steps of the "
        "per-step k3 and of the per-step mean over responses of sum_t |dlogp| (seq gap), per step, mean over "
        "seeds; IS correction, mini-batches (optimizer steps per PPO epoch) and rollout error x (the mismatch "
        "amplifier alpha) = each run's config.yaml, the distinct values over seeds; collapse rule in `quads/metrics/report.py`; rollout tok/s = sampled "
        "tokens per second of the rollout phase.",
    ]
    if crashed:
        parts.append("## Failed runs\n\n" + "\n\n".join(
            f"- {o.name}: exit {o.returncode} after {o.seconds:.0f}s; log `logs/{o.name}.log`, tail:\n\n```\n"
            f"{o.log_tail}\n```" for o in crashed))
    if finished:
        parts += ["![compare](compare.png)", "Per-run table and per-metric plots: [report/report.md](report/report.md)."]
    write_markdown(out / "compare.md", parts)
    atomic_write_text(out / "compare.json", json.dumps({
        "recipes": [json_safe(r) for r in rows], "runs": {n: json_safe(s) for n, s in per_run.items()},
        "outcomes": [dataclasses.asdict(o) for o in outcomes], "base_config": to_dict(base)}, indent=1) + "\n")
    return out


# ---------------------------------------------------------------------- CLI


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file with CompareConfig fields")
    add_dataclass_args(parser, CompareConfig)


def existing_runs(cfg: CompareConfig) -> tuple[Any, list[RunOutcome]]:
    """``(shared config, outcomes)`` of the runs a previous ``quads compare`` left in ``out_dir``.

    A run counts as finished when its folder holds ``metrics.jsonl`` or ``metrics.jsonl.gz`` (what the report reads); the shared
    config is the first run's saved config (runs differ only in recipe, variant, seed and folder).
    """
    from quads.rl.config import TrainConfig

    out = Path(cfg.out_dir)
    outcomes, base = [], None
    for group, recipe, _ in cfg.groups():
        for seed in cfg.seed_list():
            name = f"{group}-s{seed}"
            run_dir, cpath = out / "runs" / name, out / "configs" / f"{name}.yaml"
            for c in (cpath, run_dir / "config.yaml"):  # the planned config, else the run's resolved one
                if base is None and c.is_file():
                    base = build_config(TrainConfig, str(c))
            ok = metrics_file(run_dir) is not None
            outcomes.append(RunOutcome(name, recipe, seed, str(run_dir), 0 if ok else None, 0.0,
                                       "" if ok else "no metrics.jsonl in the run folder", reused=True, group=group))
    if base is None:
        raise ValueError(f"report_only: no run configs under {out / 'configs'}; run quads compare with "
                         f"--out-dir {cfg.out_dir} first (or point --out-dir at a finished compare)")
    return base, outcomes


def compare(cfg: CompareConfig, say=print) -> tuple[Path, list[RunOutcome]]:
    if cfg.report_only:
        base, outcomes = existing_runs(cfg)
        return write_report(cfg, base, outcomes), outcomes
    base = base_train_config(cfg)
    runs = plan_runs(cfg, base)
    outcomes = launch(cfg, runs, say=say)
    return write_report(cfg, base, outcomes), outcomes


def run(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(CompareConfig, getattr(args, "config", None), args, skip=("config",))
        out, outcomes = compare(cfg, say=lambda s: print(s, file=sys.stderr))
    except ValueError as e:
        print(f"quads compare: {e}", file=sys.stderr)
        return 2
    print((out / "compare.md").read_text().split("\n\n")[2])
    print(f"report: {out / 'compare.md'}")
    n_bad = sum(not o.ok for o in outcomes)
    return 1 if n_bad == len(outcomes) else 0
