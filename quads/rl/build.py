"""Everything a run needs before its first step, resolved and checked before the run folder is touched.

``resolve(cfg)`` builds the task, the recipe and the policy checkpoint (a quads checkpoint or a Hugging
Face folder; warm-starting the built-in model when none is given) and raises ``ValueError`` naming the
config field on any bad input (device, task sizes and splits, a damaged or tokenizer-less checkpoint),
so a failing run leaves nothing half-written. ``build_models`` then makes the two sides:

- trainer: the policy in ``model.master_dtype`` (the optimizer's master weights), quantized with
  ``recipe.trainer``; its forward runs under ``torch.autocast`` to ``dtype`` when that differs from
  the master dtype (BF16 compute, FP32 master weights, as mixed-precision trainers do);
- rollout: a separate instance in ``dtype``, quantized with ``recipe.rollout``, fed only by
  ``sync_weights`` (copy + re-quantize + bit-exact fingerprint check).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quads.errors import UsageError, check_device
from quads.model.checkpoint import check_model_folder, load_model
from quads.model.config import DTYPES as DTYPE_MAP
from quads.model.config import ModelConfig
from quads.model.transformer import MoEForCausalLM
from quads.quant import Recipe, get_recipe, quantize_model
from quads.rl.config import TRAIN_DTYPES, TrainConfig, WarmStartSection
from quads.tasks import Example, Task, examples_up_to, get_task, require_sandbox

# the compute / master dtypes a job may name (``quads.model.config.DTYPES`` without float16)
DTYPES = {name: DTYPE_MAP[name] for name in TRAIN_DTYPES}


@dataclass
class Resolved:
    """The checked inputs of a run."""

    task: Task
    recipe: Recipe
    checkpoint: Path  # the policy's starting checkpoint (given or warm-started)
    model_config: ModelConfig  # as stored in that checkpoint


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def build_task(cfg: TrainConfig) -> Task:
    task = _build_task(cfg)
    sources = ({e.data_source for s in ("train", "test") for e in task.examples(s)} if cfg.task.name == "dataset"
               else {cfg.task.name})
    require_sandbox(sources, cfg.task.sandbox, "task.sandbox")
    return task


def _build_task(cfg: TrainConfig) -> Task:
    t = cfg.task
    if t.name == "dataset" or t.dataset is not None:
        if t.name != "dataset":
            raise ValueError(f"task.dataset is read only by task.name=dataset, got task.name={t.name!r}; "
                             "pass --task.name dataset (or drop --task.dataset)")
        if t.dataset is None:
            raise ValueError("task.name=dataset needs task.dataset: pass --task.dataset <file.jsonl|.parquet>")
        if not Path(t.dataset).is_file():
            raise ValueError(f"task.dataset: file {t.dataset!r} does not exist; pass an existing "
                             ".jsonl/.json/.parquet file")
        try:
            return get_task("dataset", path=t.dataset, seed=cfg.seed)
        except ValueError as e:
            raise ValueError(f"task.dataset: {e}") from None
    kwargs: dict[str, Any] = {"seed": cfg.seed}
    if t.difficulty is not None:
        kwargs["difficulty"] = t.difficulty
    try:
        return get_task(t.name, **kwargs)
    except ValueError as e:
        raise ValueError(f"task.name / task.difficulty: {e}") from None


def heldout_examples(cfg: TrainConfig, task: Task) -> list[Example]:
    """The held-out prompts of the run's evaluations: the first ``eval_n`` of the test split drawn with
    ``task.eval_seed`` (None: the run's seed, i.e. ``task`` itself). Generated tasks split train and test by
    prompt hash (``quads.tasks.base.split_of``), so a test split drawn with another seed shares no prompt
    with the run's training prompts."""
    if cfg.task.eval_seed is None or cfg.task.eval_seed == cfg.seed:
        return examples_up_to(task, "test", cfg.eval_n)
    fixed = _build_task(dataclasses.replace(cfg, seed=cfg.task.eval_seed))
    return examples_up_to(fixed, "test", cfg.eval_n)


def build_recipe(cfg: TrainConfig) -> Recipe:
    try:
        return get_recipe(cfg.recipe.name, **cfg.recipe.overrides())
    except ValueError as e:
        raise ValueError(f"recipe: {e}") from None


def warm_start_checkpoint(cfg: TrainConfig, task: Task | None = None) -> Path:
    """The cached supervised warm start of the built-in ``model.preset`` on the task (``warm_start_policy``).

    The task's resolved difficulty is passed explicitly, so a change of a task's default level can
    never return a cached warm start of another level.
    """
    difficulty = cfg.task.difficulty if cfg.task.difficulty is not None else getattr(task, "difficulty", None)
    return warm_start_policy(cfg.warm_start, task=cfg.task.name, difficulty=difficulty, preset=cfg.model.preset,
                             seed=cfg.seed, device=cfg.device, threads=cfg.threads or None,
                             progress=cfg.log.progress, max_new_tokens=cfg.rollout.max_new_tokens)


def warm_start_policy(section: WarmStartSection, *, task: str, difficulty: int | None, preset: str, seed: int,
                      device: str, threads: int | None = None, progress: bool = True,
                      max_new_tokens: int | None = None) -> Path:
    """The one path to the cached warm start (``quads.pretrain.warm_start``) for ``quads train``, ``compare``
    and ``diagnose``: every ``section`` field that is a ``PretrainConfig`` field is passed on, and an unset
    ``difficulty`` is resolved to the task's default level, so the same job finds the same cache folder
    (``PretrainConfig.folder()``) whichever command asks. ``eval_size`` is 0 (the callers measure held-out
    pass@1 themselves, through their own recipe) unless ``section.target_pass`` stops the SFT at a
    held-out pass@1: then ``section.eval_size`` prompts are scored at ``section.eval_at``, responses capped at
    ``max_new_tokens`` (the rollout's)."""
    from quads.pretrain import PretrainConfig, warm_start

    if difficulty is None:
        difficulty = getattr(get_task(task, seed=seed), "difficulty", None)
    names = {f.name for f in dataclasses.fields(PretrainConfig)}
    want = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    want |= {"task": task, "difficulty": difficulty, "preset": preset, "seed": seed, "device": device,
             "threads": threads, "progress": progress}
    if section.target_pass is None:
        want |= {"eval_size": 0, "eval_at": [], "max_new_tokens": None}
    else:
        want["max_new_tokens"] = max_new_tokens
    return Path(warm_start(PretrainConfig(**{k: v for k, v in want.items() if k in names and v is not None})))


def resolve(cfg: TrainConfig, *, allow_warm_start: bool = True) -> Resolved:
    """Task, recipe and starting checkpoint, each checked; raises ValueError naming the field."""
    check_device(cfg.device, "device")
    task = build_task(cfg)
    check_splits(cfg, task)
    recipe = build_recipe(cfg)
    if cfg.model.checkpoint is not None:
        ckpt = Path(cfg.model.checkpoint)
        if not ckpt.is_dir():
            raise UsageError(f"model.checkpoint: folder {str(ckpt)!r} does not exist; pass a checkpoint folder "
                             "(written by quads pretrain / quads train), a Hugging Face model folder, or leave it "
                             "unset to warm-start")
    elif cfg.task.name == "dataset":
        raise ValueError("model.checkpoint: the warm start trains on generated tasks only; pass --model.checkpoint "
                         "<folder> to train on a dataset file")
    elif allow_warm_start:
        ckpt = warm_start_checkpoint(cfg, task)
    else:
        raise ValueError("model.checkpoint is unset and warm start is disabled")
    field = "model.checkpoint" if cfg.model.checkpoint is not None else "the warm start (cached)"
    model_config = check_model_folder(ckpt, field)
    return Resolved(task, recipe, ckpt, model_config)


def check_splits(cfg: TrainConfig, task: Task) -> None:
    """The task offers training prompts and a non-empty held-out split (a task that offers fewer than
    ``task.train_size`` trains on all it has: ``examples_up_to``)."""
    where = f"task.dataset {cfg.task.dataset!r}" if cfg.task.name == "dataset" else f"task {cfg.task.name!r}"
    if not examples_up_to(task, "train", 1):
        raise UsageError(f"{where} has no training examples")
    if not examples_up_to(task, "test", 1):  # the held-out eval needs at least one prompt
        n = len(examples_up_to(task, "train", cfg.task.train_size))
        raise UsageError(f"{where} has no held-out (test) examples: none of its {n} examples falls in the "
                         f"held-out split (the split keeps a fixed fraction, {getattr(task, 'test_fraction', '?')}, by prompt hash), so the run "
                         "could not be evaluated; add examples (a few dozen at least)")


def policy_task(cfg: TrainConfig, task: Task) -> dict[str, Any]:
    """What a policy's checkpoint records of its task (in ``extra``), so ``quads eval`` evaluates the same
    task, level and held-out split by default: ``task``, ``difficulty`` (resolved), ``dataset``, and
    ``split_seed`` (a dataset file's train/test split depends on it); the dataset as an absolute path."""
    dataset = str(Path(cfg.task.dataset).resolve()) if cfg.task.dataset else None
    return {"task": cfg.task.name, "difficulty": getattr(task, "difficulty", None), "dataset": dataset,
            "split_seed": cfg.seed}


def load_policy(res: Resolved, dtype: str) -> tuple[MoEForCausalLM, Any]:
    """The starting policy in ``dtype`` and its tokenizer (``quads.model.checkpoint.load_model``)."""
    model, tok, _ = load_model(res.checkpoint, dtype, field="model.checkpoint")
    return model, tok


def build_models(res: Resolved, cfg: TrainConfig) -> tuple[MoEForCausalLM, MoEForCausalLM, Any]:
    """(trainer model, rollout model, tokenizer), quantized, on ``cfg.device``; not yet synced."""
    trainer, tok = load_policy(res, cfg.model.master_dtype)
    rollout = MoEForCausalLM(dataclasses.replace(res.model_config, dtype=cfg.dtype))
    trainer.to(cfg.device)
    rollout.to(cfg.device)
    rollout.requires_grad_(False)
    quantize_model(trainer, res.recipe, side="trainer", verbose=False)
    quantize_model(rollout, res.recipe, side="rollout", verbose=False)
    return trainer, rollout, tok


def autocast(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """Mixed precision for the trainer forward: compute in ``cfg.dtype`` over master-dtype weights."""
    return mixed_precision(cfg.dtype, cfg.model.master_dtype, cfg.device)


def mixed_precision(dtype: str, master_dtype: str, device: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to BF16 over FP32 master weights; no context when both dtypes are the same."""
    if not (dtype == "bfloat16" and master_dtype == "float32"):
        return contextlib.nullcontext()  # same dtype: the weights' own dtype is the compute dtype
    return torch.autocast(device_type=torch.device(device).type, dtype=torch_dtype(dtype))
