"""``quads diagnose``: where the rollout/trainer log-prob gap comes from (DESIGN.md section 5).

Protocol:
1. sample ONE fixed batch (``prompts`` held-out prompts x ``n_samples``, seed ``seed``) with the rollout
   engine under ``sample_with`` (default the BF16 engine);
2. for every rollout variant of the grid, recompute the rollout-side log-probs of exactly those token
   sequences through the engine's own KV-cache path (``quads.rollout.score``: prefill + decode,
   teacher-forced), with the variant's ``LinearSpec`` on the quantized layers;
3. for every trainer variant, the trainer-side log-probs with ``quads.rl.logprobs`` (one full forward;
   BF16 compute over FP32 master weights under autocast, as ``quads train`` does);
4. per (rollout, trainer) pair: ``quads.metrics.mismatch_metrics`` (gap max/mean, k1, k3, chi2,
   routing difference) and the mean over layers of the per-layer relative output error
   ``||Y_rollout - Y_trainer|| / ||Y_trainer||`` on the same captured inputs
   (``quads.quant.diagnostics.layer_errors``, inputs from a BF16 forward of the batch).

A rollout variant with static RAC selection (``rac_selection: static``) runs with calibrated channel orders,
as a training run's rollouts do after their first weight sync: right after each quantization of the
rollout model to that variant (for sampling and for scoring), one forward over a calibration batch gathers
the residual statistics and sorts the orders (``quads.quant.calibrate_static_channels``). The calibration
batch is the BF16 policy's samples on ``static_calibration_prompts`` training-split prompts (never the
held-out ones scored here), ``n_samples`` each, seed ``seed + 1``; 0 keeps the orders of the weights'
column norms (the prior every order starts from). The per-layer errors replay the layers with fresh
orders (the prior), so for static variants only the log-prob metrics see the calibration. On the vLLM
backend (``rollout_backend: vllm``) static variants keep the prior.

Default grid (one thing changes at a time):
- rollout: ``bf16`` (engine drift, the floor), ``w4a16`` (weight error only), ``w16a4`` (activation
  error only), ``w4a4`` (= RAC ratio 0), ``w4a4+rac<r>`` for every ``rac_ratios`` entry;
- trainer: ``bf16``, ``w4a16-qat`` (QDQ(W) x X), ``w4a4-qat`` (QDQ(W) x QDQ(X)).
A ``--recipe-grid`` YAML replaces it: ``{rollout: {name: {LinearSpec fields}}, trainer: {...}}``.

Note: activation-quantized GEMMs (``act: nvfp4``) accumulate in FP32 (``quads.quant.linear``), the
unquantized ones in the compute dtype; at BF16 this adds a little rounding difference to every
A4 variant beside its quantization error.

The report states, per trainer, the W4A4 row (RAC ratio 0) against the engine-drift floor (the rollout
with the trainer's own spec): k3 and gap mean, and their ratio (``floor_summary``); and, when the
checkpoint carries injected or initialised outlier channels (``quads outliers``, ``quads pretrain
--outliers.*``), which ones (``meta.outliers``).

Outputs in ``out_dir``: ``decomposition.md`` (tables), ``decomposition.jsonl`` (one row per pair),
``layer_errors.json`` (per pair, per layer), ``batch.json`` (what was sampled), ``rac_ratio_gap.png``,
``decomposition_gap.png``, ``layer_errors.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from quads.config import add_dataclass_args, build_config, save_config
from quads.errors import check_device
from quads.io import atomic_write_text, check_output_dir
from quads.metrics.mismatch import mismatch_metrics
from quads.metrics.report import (
    Column,
    cell,
    markdown_table,
    plot_decomposition,
    plot_layer_errors,
    plot_rac_gap,
    table,
    write_markdown,
)
from quads.model.checkpoint import check_model_folder
from quads.quant import LinearSpec, Recipe, calibrate_static_channels, dequantize_model, quantize_model
from quads.quant.diagnostics import layer_errors
from quads.rl.build import DTYPES, mixed_precision, torch_dtype, warm_start_policy
from quads.rl.config import WarmStartSection
from quads.rollout.score import ScoreResult, score_rollout

DEFAULT_TRAINERS = {"bf16": {}, "w4a16-qat": {"weight": "nvfp4"}, "w4a4-qat": {"weight": "nvfp4", "act": "nvfp4"}}


@dataclass
class DiagnoseConfig:
    """``quads diagnose``: the fixed batch, the grid and where to write."""

    checkpoint: str | None = None  # policy checkpoint or Hugging Face folder; None = warm-start `preset` on `task` (cached)
    preset: str = "tiny"  # built-in model preset for the warm start
    task: str = "arithmetic"  # task whose held-out prompts are sampled
    difficulty: int | None = None  # task level; None = the task's default
    prompts: int = 32  # prompts in the fixed batch (held-out split)
    n_samples: int = 4  # samples per prompt
    max_new_tokens: int = 40  # response cap
    temperature: float = 1.0  # sampling temperature (both sides' log-probs use it)
    seed: int = 0  # sampling seed (and task seed)
    sample_with: str = "bf16"  # rollout variant of the grid that samples the fixed batch
    rac_ratios: str = "0.125,0.25,0.5,0.75,1.0"  # RAC ratios of the default grid (0 is the w4a4 row)
    rac_selection: str = "dynamic"  # RAC channel selection of the default grid
    static_calibration_prompts: int = 32  # static RAC variants: training-split prompts whose BF16 samples calibrate the channel orders before sampling and scoring; 0 = the weights' column-norm prior
    recipe_grid: str | None = None  # YAML {rollout: {name: spec}, trainer: {name: spec}}; replaces the default
    dtype: str = "bfloat16"  # compute dtype of both sides (float64 for exactness checks)
    master_dtype: str = "float32"  # trainer weights (bf16 compute runs under autocast over them)
    layer_errors: bool = True  # per-layer relative output errors (one replay per pair)
    probe_tokens: int = 1024  # fixed-size probe for mismatch/logp_gap_max_probe
    device: str = "cpu"
    threads: int = 0  # torch CPU threads; 0 = default
    rollout_backend: str = "quads"  # quads (own KV-cache engine) | vllm (vLLM prefill scoring; pip install quads[vllm])
    warm_start_dir: str | None = None  # warm-start cache root; None = quads train's: $QUADS_CACHE/pretrain or ~/.cache/quads/pretrain
    out_dir: str = "runs/diagnose"  # report folder

    def __post_init__(self) -> None:
        for name in ("prompts", "n_samples", "max_new_tokens", "probe_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.static_calibration_prompts < 0:
            raise ValueError(f"static_calibration_prompts must be >= 0; got {self.static_calibration_prompts}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (log-probs of sampled tokens); got {self.temperature}")
        for name in ("dtype", "master_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DTYPES)}; got {getattr(self, name)!r}")
        if self.rollout_backend not in ("quads", "vllm"):
            raise ValueError(f"rollout_backend must be quads or vllm; got {self.rollout_backend!r}")
        self.ratios()  # validates

    def ratios(self) -> list[float]:
        try:
            rs = [float(r) for r in str(self.rac_ratios).split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"rac_ratios must be comma-separated numbers in (0, 1]; got {self.rac_ratios!r}") from None
        if not all(0 < r <= 1 for r in rs):
            raise ValueError(f"rac_ratios must be in (0, 1] (0 is the w4a4 row); got {self.rac_ratios!r}")
        return rs


@dataclass
class Grid:
    rollout: dict[str, LinearSpec]  # name -> rollout-side spec
    trainer: dict[str, LinearSpec]  # name -> trainer-side spec


def default_grid(cfg: DiagnoseConfig) -> Grid:
    a4 = dict(weight="nvfp4", act="nvfp4")
    rollout = {"bf16": LinearSpec(), "w4a16": LinearSpec.of(weight="nvfp4"), "w16a4": LinearSpec.of(act="nvfp4"),
               "w4a4": LinearSpec.of(**a4)}
    for r in cfg.ratios():
        rollout[f"w4a4+rac{r * 100:g}%"] = LinearSpec.of(**a4, rac_ratio=r, rac_selection=cfg.rac_selection)
    return Grid(rollout, {k: LinearSpec.of(**v) for k, v in DEFAULT_TRAINERS.items()})


def load_grid(path: str) -> Grid:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"recipe_grid: file {path!r} does not exist; pass a YAML file with rollout: and trainer:")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict) or set(data) != {"rollout", "trainer"}:
        raise ValueError(f"recipe_grid {path!r}: expected a mapping with exactly the keys rollout and trainer, "
                         f"each {{name: LinearSpec fields}}; got {sorted(data) if isinstance(data, dict) else data!r}")
    out = {}
    for side in ("rollout", "trainer"):
        if not isinstance(data[side], dict) or not data[side]:
            raise ValueError(f"recipe_grid {path!r}: {side} must be a non-empty mapping name -> spec fields")
        try:
            out[side] = {str(k): LinearSpec.of(**(v or {})) for k, v in data[side].items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"recipe_grid {path!r} ({side}): {e}") from None
    return Grid(out["rollout"], out["trainer"])


def _checkpoint(cfg: DiagnoseConfig) -> Path:
    """``checkpoint``, else the warm start ``quads train`` uses for the same preset, task, level and seed
    (``quads.rl.build.warm_start_policy`` with the default warm-start settings): found in its cache."""
    if cfg.checkpoint is not None:
        check_model_folder(cfg.checkpoint, "checkpoint")
        return Path(cfg.checkpoint)
    return warm_start_policy(WarmStartSection(cache_dir=cfg.warm_start_dir), task=cfg.task, difficulty=cfg.difficulty,
                             preset=cfg.preset, seed=cfg.seed, device=cfg.device, threads=cfg.threads or None)


def _load(ckpt: Path, dtype: str, device: str):
    from quads.model.checkpoint import load_model

    model, tok, _ = load_model(ckpt, dtype, device=device, field="checkpoint")
    return model.requires_grad_(False), tok


def _recipe(name: str, spec: LinearSpec, side: str) -> Recipe:
    return Recipe(name="diagnose-" + name.replace("%", "pct"), **{side: spec})


def _calibration_run(cfg: DiagnoseConfig, model, tok, task) -> Any:
    """The forward that calibrates static RAC orders (module docstring): the BF16 ``model``'s samples on
    ``static_calibration_prompts`` training-split prompts, as one teacher-forced batch -> ``run(model)``."""
    from quads.rl.logprobs import to_sequence_batch
    from quads.rollout import RolloutEngine, SamplingParams

    prompts = [e.prompt for e in task.examples("train", cfg.static_calibration_prompts)]
    params = SamplingParams(n=cfg.n_samples, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            seed=cfg.seed + 1)
    seq = to_sequence_batch(RolloutEngine(model, tok, device=cfg.device).generate(prompts, params), device=cfg.device)

    @torch.no_grad()
    def run(m):
        m(seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids)

    return run


def decompose(cfg: DiagnoseConfig, grid: Grid | None = None, say=print) -> dict[str, Any]:
    """Run the protocol of the module docstring; returns ``{rows, layer_errors, self_check, batch, meta}``."""
    from quads.rl.logprobs import forward_logprobs, to_sequence_batch
    from quads.rollout import RolloutEngine, SamplingParams
    from quads.tasks import get_task

    grid = grid or (load_grid(cfg.recipe_grid) if cfg.recipe_grid else default_grid(cfg))
    if cfg.sample_with not in grid.rollout:
        raise ValueError(f"sample_with {cfg.sample_with!r} is not a rollout variant of the grid; "
                         f"valid: {', '.join(grid.rollout)}")
    check_device(cfg.device, "device")
    check_output_dir(cfg.out_dir, "out_dir")
    if cfg.checkpoint is not None:
        check_model_folder(cfg.checkpoint, "checkpoint")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    ckpt = _checkpoint(cfg)
    rollout, tok = _load(ckpt, cfg.dtype, cfg.device)
    from quads.model.checkpoint import read_checkpoint_config

    outliers = read_checkpoint_config(ckpt)[1].get("outliers")
    trainer, _ = _load(ckpt, cfg.master_dtype if cfg.dtype == "bfloat16" else cfg.dtype, cfg.device)
    task_kw = {"seed": cfg.seed} | ({"difficulty": cfg.difficulty} if cfg.difficulty is not None else {})
    task = get_task(cfg.task, **task_kw)
    examples = task.examples("test", cfg.prompts)
    calibrate = None
    if cfg.static_calibration_prompts and any(s.static_rac for s in grid.rollout.values()):
        calibrate = _calibration_run(cfg, rollout, tok, task)  # the rollout model is still the BF16 policy here

    def quantize_rollout(name: str) -> None:
        quantize_model(rollout, _recipe(name, grid.rollout[name], "rollout"), "rollout", verbose=False)
        if calibrate is not None and grid.rollout[name].static_rac:
            calibrate_static_channels(rollout, calibrate)

    quantize_rollout(cfg.sample_with)
    engine = RolloutEngine(rollout, tok, device=cfg.device, recipe=cfg.sample_with)
    params = SamplingParams(n=cfg.n_samples, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            seed=cfg.seed, record_routing=True)
    batch = engine.generate([e.prompt for e in examples], params)
    scores = [task.score(e, t) for e, t in zip([e for e in examples for _ in range(cfg.n_samples)], batch.texts)]
    mask = batch.response_mask.to(cfg.device)
    P = batch.prompt_len
    say(f"diagnose: fixed batch of {batch.num_samples} samples, {int(mask.sum())} response tokens "
        f"(mean length {batch.response_lengths().float().mean():.1f}), sampled with {cfg.sample_with}")

    roll: dict[str, Any] = {}
    if cfg.rollout_backend == "vllm":
        roll = _vllm_scores(cfg, rollout, tok, batch, grid)
        self_check = math.nan  # the batch was sampled by quads' engine, scored by vLLM: no self-check
    else:
        for name in grid.rollout:
            quantize_rollout(name)
            roll[name] = score_rollout(rollout, batch, cfg.temperature)
        own = roll[cfg.sample_with].logprobs
        self_check = (own - batch.logprobs.to(own.device)).abs().max().item()

    seq = to_sequence_batch(batch, device=cfg.device)
    train: dict[str, Any] = {}
    for name, spec in grid.trainer.items():
        quantize_model(trainer, _recipe(name, spec, "trainer"), "trainer", verbose=False)
        with torch.no_grad(), mixed_precision(cfg.dtype, cfg.master_dtype, cfg.device):
            train[name] = forward_logprobs(trainer, seq, None, cfg.temperature, return_routing=True)

    dequantize_model(rollout)
    ids, amask, pos = seq.input_ids, seq.attention_mask, seq.position_ids
    wd = torch_dtype(cfg.dtype)
    rows, per_layer = [], {}
    for rname, rspec in grid.rollout.items():
        r = roll[rname]
        fed = mask & (r.routing[0, :, P:, 0] >= 0) if r.routing is not None else mask
        for tname, tspec in grid.trainer.items():
            t = train[tname]
            m = mismatch_metrics(t.logprobs, r.logprobs, mask, routing_train=t.routing[:, :, P:],
                                 routing_rollout=r.routing[:, :, P:] if r.routing is not None else None,
                                 routing_mask=fed, probe_tokens=cfg.probe_tokens)
            errs: dict[str, float] = {}
            if cfg.layer_errors:
                errs = layer_errors(rollout, lambda mdl: mdl(ids, attention_mask=amask, position_ids=pos),
                                    tspec, rspec, weight_dtype=wd)
                per_layer[f"{rname}|{tname}"] = errs
            rows.append({"rollout": rname, "trainer": tname, "rollout_spec": rspec.describe(),
                         "trainer_spec": tspec.describe(), "rac_ratio": rspec.rac_ratio if rspec.act == "nvfp4" else None,
                         "gap_max": m["mismatch/logp_gap_max"], "gap_mean": m["mismatch/logp_gap_mean"],
                         "gap_max_probe": m["mismatch/logp_gap_max_probe"], "k1": m["mismatch/k1"],
                         "k3": m["mismatch/k3"], "chi2": m["mismatch/chi2"],
                         "routing_diff": m.get("mismatch/routing_diff", math.nan),
                         "layer_err_mean": (sum(errs.values()) / len(errs)) if errs else math.nan,
                         "tokens": int(m["mismatch/tokens"])})
        say(f"  rollout {rname:<16} " + "  ".join(
            f"{row['trainer']}: gap max {row['gap_max']:.3f} mean {row['gap_mean']:.4f}"
            for row in rows[-len(grid.trainer):]))
    meta = {"checkpoint": str(ckpt), "config": dataclasses.asdict(cfg), "seconds": time.perf_counter() - t_start,
            "samples": batch.num_samples, "response_tokens": int(mask.sum()),
            "mean_response_len": batch.response_lengths().float().mean().item(),
            "reward_mean": sum(s.reward for s in scores) / len(scores),
            "model": rollout.config.to_dict(), "n_params": rollout.num_parameters(), "outliers": outliers,
            "torch": torch.__version__, "device_name": _device_name(cfg.device)}
    return {"rows": rows, "layer_errors": per_layer, "self_check": self_check, "meta": meta,
            "texts": batch.texts[: min(8, len(batch.texts))], "grid": grid}


def _vllm_scores(cfg: DiagnoseConfig, model, tok, batch, grid: Grid) -> dict[str, Any]:
    """Rollout log-probs of the fixed batch from vLLM, one per rollout variant (``quads.rollout.vllm.diagnose``).

    BF16 variants run on vLLM's own layers, so the ``bf16`` row is a real inference engine's drift
    floor; quantized variants run through the ``"quads"`` vLLM method. vLLM returns no expert ids on
    the CPU, so these rows have no routing difference (NaN).
    """
    try:
        from quads.rollout.vllm.diagnose import vllm_rollout_logprobs
    except ImportError as e:
        raise ValueError(f"rollout_backend=vllm needs vLLM ({e}); install it with `pip install quads[vllm]` "
                         "(see docs/VLLM.md) or use rollout_backend=quads") from None
    dequantize_model(model)
    lps = vllm_rollout_logprobs(model, tok, batch, grid.rollout, temperature=cfg.temperature, dtype=cfg.dtype)
    return {name: ScoreResult(logprobs=lp.to(cfg.device), routing=None) for name, lp in lps.items()}


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


# ---------------------------------------------------------------------- report

DECOMPOSITION_COLUMNS: list[Column] = [
    ("rollout", "rollout", "{}"), ("trainer", "trainer", "{}"), ("rollout spec", "rollout_spec", "{}"),
    ("trainer spec", "trainer_spec", "{}"), ("gap max", "gap_max", "{:.3f}"), ("gap mean", "gap_mean", "{:.4f}"),
    ("k3", "k3", "{:.2e}"), ("routing diff", "routing_diff", "{:.3f}"), ("layer err (mean)", "layer_err_mean", "{:.4f}"),
]
_GAP_COLUMNS: list[Column] = [("gap max", "gap_max", "{:.3f}"), ("gap mean", "gap_mean", "{:.4f}"),
                              ("k3", "k3", "{:.2e}"), ("routing diff", "routing_diff", "{:.3f}")]


def decomposition_table(rows: list[dict[str, Any]]) -> str:
    return table(rows, DECOMPOSITION_COLUMNS)


def rac_rows(rows: list[dict[str, Any]], trainer: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the W4A4+RAC rows against ``trainer``, sorted by RAC ratio; the rows whose rollout has the trainer's
    own spec: the engine-drift floor)."""
    rac = sorted((r for r in rows if r["trainer"] == trainer and r["rac_ratio"] is not None
                  and r["rollout_spec"].startswith("W4A4")), key=lambda r: r["rac_ratio"])
    floor = [r for r in rows if r["trainer"] == trainer and r["rollout_spec"] == r["trainer_spec"]]
    return rac, floor


def rac_table(rows: list[dict[str, Any]], trainer: str) -> str:
    """Gap against RAC ratio for one trainer, plus the engine-drift floor rows."""
    rac, floor = rac_rows(rows, trainer)
    labels = ([f"{r['rac_ratio'] * 100:g}%" for r in rac]
              + [f"{r['rollout']} rollout, same spec as the trainer (engine-drift floor)" for r in floor])
    return markdown_table([f"RAC ratio (trainer {trainer})", *(c[0] for c in _GAP_COLUMNS)],
                          [[label, *(cell(r[key], fmt) for _, key, fmt in _GAP_COLUMNS)]
                           for label, r in zip(labels, rac + floor)])


def floor_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trainer: the W4A4 rollout (RAC ratio 0) against the engine-drift floor (the rollout with the
    trainer's own spec): ``{trainer, w4a4, floor, k3, floor_k3, k3_ratio, gap_mean, floor_gap_mean}``;
    trainers whose floor is the W4A4 rollout itself (``w4a4-qat``) have no row."""
    out = []
    for trainer in dict.fromkeys(r["trainer"] for r in rows):
        rac, floor = rac_rows(rows, trainer)
        w4a4 = [r for r in rac if r["rac_ratio"] == 0]
        if not w4a4 or not floor or w4a4[0]["rollout"] == floor[0]["rollout"]:
            continue  # no W4A4 row, no floor, or the W4A4 rollout is this trainer's floor (w4a4-qat)
        w, f = w4a4[0], floor[0]
        out.append({"trainer": trainer, "w4a4": w["rollout"], "floor": f["rollout"], "k3": w["k3"],
                    "floor_k3": f["k3"], "k3_ratio": w["k3"] / f["k3"] if f["k3"] > 0 else math.inf,
                    "gap_mean": w["gap_mean"], "floor_gap_mean": f["gap_mean"]})
    return out


def layer_table(per_layer: dict[str, dict[str, float]], trainer: str) -> str:
    cols = [k for k in per_layer if k.endswith(f"|{trainer}")]
    if not cols:
        return ""
    return markdown_table(["layer", *(c.split("|")[0] for c in cols)],
                          [[layer, *(cell(per_layer[c].get(layer), "{:.4f}") for c in cols)]
                           for layer in per_layer[cols[0]]])


def plots(result: dict[str, Any], out: Path) -> list[str]:
    """The report's figures (``quads.metrics.report``); their file names."""
    rows, per_layer = result["rows"], result["layer_errors"]
    trainers = list(dict.fromkeys(r["trainer"] for r in rows))
    plot_rac_gap({t: rac_rows(rows, t) for t in trainers}, out / "rac_ratio_gap.png")
    plot_decomposition(rows, out / "decomposition_gap.png")
    made = ["rac_ratio_gap.png", "decomposition_gap.png"]
    if per_layer:
        t0 = trainers[0]
        errors = {key.split("|")[0]: errs for key, errs in per_layer.items()
                  if key.split("|")[1] == t0 and key.split("|")[0] != "bf16"}
        plot_layer_errors(errors, t0, out / "layer_errors.png")
        made.append("layer_errors.png")
    return made


def write_report(result: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, meta = result["rows"], result["meta"]
    atomic_write_text(out / "decomposition.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_text(out / "layer_errors.json", json.dumps(result["layer_errors"], indent=1) + "\n")
    atomic_write_text(out / "batch.json", json.dumps({"meta": meta, "self_check_max_abs": result["self_check"],
                                                     "first_texts": result["texts"]}, indent=1) + "\n")
    figs = plots(result, out)
    trainers = list(dict.fromkeys(r["trainer"] for r in rows))
    c = meta["config"]
    parts = [
        "# quads diagnose: decomposition of the rollout/trainer log-prob gap",
        f"Checkpoint `{meta['checkpoint']}` ({meta['n_params']:,} parameters, {meta['model']['n_layers']} layers, "
        f"{meta['model']['n_experts']} experts, top-{meta['model']['top_k']}), task {c['task']}, one fixed batch "
        f"of {meta['samples']} samples ({c['prompts']} held-out prompts x {c['n_samples']}, seed {c['seed']}, "
        f"temperature {c['temperature']}) sampled with the `{c['sample_with']}` engine: "
        f"{meta['response_tokens']} response tokens, mean length {meta['mean_response_len']:.1f}, mean reward "
        f"{meta['reward_mean']:.3f}. Compute dtype {c['dtype']}, device {meta['device_name']}, torch {meta['torch']}.",
        (f"Engine self-check: teacher-forced scoring with the sampling variant reproduces the engine's own "
         f"log-probs to max |diff| = {result['self_check']:.3g} (0 = bit for bit)."
         if c.get("rollout_backend", "quads") == "quads" else
         "Rollout backend: vLLM. The fixed batch was sampled by quads' engine; each rollout variant's log-probs "
         "of those tokens come from vLLM prefills (BF16 variants on vLLM's own layers, quantized ones through "
         "the `quads` vLLM method). vLLM returns no expert ids on the CPU, so routing diff is n/a."),
        f"Each row: rollout log-probs ({'engine KV-cache path, teacher-forced' if c.get('rollout_backend', 'quads') == 'quads' else 'vLLM'}) vs trainer log-probs (one full "
        "forward) on the same tokens. gap = |logp_rollout - logp_train| over response tokens; k3 = "
        "mean(rho - log rho - 1); routing diff = fraction of (token, layer) expert sets that differ; layer err "
        "= mean over quantized layers of ||Y_rollout - Y_trainer|| / ||Y_trainer|| on identical inputs.",
        decomposition_table(rows),
    ]
    if meta.get("outliers"):
        o = meta["outliers"]
        parts.append(f"The checkpoint carries activation outlier channels ({o['mode']}): channels {o['channels']} "
                     f"x{o['scale']:g} at the {', '.join(o['sites'])} norm(s) (quads.model.outliers).")
    summary = floor_summary(rows)
    if summary:
        parts.append("W4A4 (RAC ratio 0) against the engine-drift floor:\n\n" + "\n".join(
            f"- trainer {s['trainer']}: W4A4 k3 {s['k3']:.2e} = {s['k3_ratio']:.3g} x the floor ({s['floor']} "
            f"rollout, k3 {s['floor_k3']:.2e}); gap mean {s['gap_mean']:.4f} vs {s['floor_gap_mean']:.4f}"
            for s in summary))
    for tname in trainers:
        t = rac_table(rows, tname)
        if t.count("\n") > 1:
            parts.append(t)
    if result["layer_errors"]:
        parts.append(f"Per-layer relative output error against the `{trainers[0]}` trainer:\n\n"
                     + layer_table(result["layer_errors"], trainers[0]))
    parts += [f"![{f}]({f})" for f in figs]
    write_markdown(out / "decomposition.md", parts)
    return out


def load_result(out_dir: str | Path) -> dict[str, Any]:
    """The result dict of an earlier run from its files (to rewrite the report with ``write_report``)."""
    out = Path(out_dir)
    rows = [json.loads(line) for line in (out / "decomposition.jsonl").read_text().splitlines() if line.strip()]
    b = json.loads((out / "batch.json").read_text())
    return {"rows": rows, "layer_errors": json.loads((out / "layer_errors.json").read_text()),
            "self_check": b["self_check_max_abs"], "meta": b["meta"], "texts": b["first_texts"]}


# ---------------------------------------------------------------------- CLI

def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file with DiagnoseConfig fields")
    add_dataclass_args(parser, DiagnoseConfig)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(DiagnoseConfig, getattr(args, "config", None), args, skip=("config",))
        result = decompose(cfg, say=lambda s: print(s, file=sys.stderr))
    except ValueError as e:
        print(f"quads diagnose: {e}", file=sys.stderr)
        return 2
    out = write_report(result, cfg.out_dir)
    save_config(cfg, out / "config.yaml")
    print(decomposition_table(result["rows"]))
    for s in floor_summary(result["rows"]):
        print(f"trainer {s['trainer']}: W4A4 k3 {s['k3']:.2e} = {s['k3_ratio']:.3g} x the floor ({s['floor']}, "
              f"k3 {s['floor_k3']:.2e})")
    print(f"report: {out / 'decomposition.md'}")
    return 0
