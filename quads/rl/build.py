"""Everything a run needs before its first step, resolved and checked before the run folder is touched.

``resolve(cfg)`` builds the task, the recipe and the policy checkpoint (warm-starting the built-in
model when none is given) and raises ``ValueError`` naming the config field on any bad input, so a
failing run leaves nothing half-written. ``build_models`` then makes the two sides:

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

from quads.model.checkpoint import load_checkpoint, read_checkpoint_config
from quads.model.config import ModelConfig
from quads.model.tokenizer import load_tokenizer
from quads.model.transformer import MoEForCausalLM
from quads.quant import Recipe, get_recipe, quantize_model
from quads.rl.config import TrainConfig
from quads.tasks import Task, examples_up_to, get_task

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class Resolved:
    """The checked inputs of a run."""

    task: Task
    recipe: Recipe
    checkpoint: Path  # the policy's starting checkpoint (given or warm-started)
    model_config: ModelConfig  # as stored in that checkpoint


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def build_task(cfg: TrainConfig) -> Task:
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


def build_recipe(cfg: TrainConfig) -> Recipe:
    try:
        return get_recipe(cfg.recipe.name, **cfg.recipe.overrides())
    except ValueError as e:
        raise ValueError(f"recipe: {e}") from None


def warm_start_checkpoint(cfg: TrainConfig, task: Task | None = None) -> Path:
    """The cached supervised warm start of the built-in ``model.preset`` on the task.

    The task's resolved difficulty is passed explicitly, so a change of a task's default level can
    never return a cached warm start of another level.
    """
    from quads.pretrain import PretrainConfig, warm_start

    difficulty = cfg.task.difficulty if cfg.task.difficulty is not None else getattr(task, "difficulty", None)
    want = {"preset": cfg.model.preset, "model": cfg.model.preset, "task": cfg.task.name,
            "difficulty": difficulty, "dataset": cfg.task.dataset, "steps": cfg.warm_start.steps,
            "lr": cfg.warm_start.lr, "batch_size": cfg.warm_start.batch_size,
            "train_size": cfg.warm_start.train_size, "seed": cfg.seed,
            "device": cfg.device, "cache_dir": cfg.warm_start.cache_dir, "threads": cfg.threads or None,
            "progress": cfg.log.progress,
            "eval_size": 0}  # quads train measures held-out pass@1 itself, through the rollout recipe
    names = {f.name for f in dataclasses.fields(PretrainConfig)}
    kwargs = {k: v for k, v in want.items() if k in names and v is not None}
    return Path(warm_start(PretrainConfig(**kwargs)))


def resolve(cfg: TrainConfig, *, allow_warm_start: bool = True) -> Resolved:
    """Task, recipe and starting checkpoint, each checked; raises ValueError naming the field."""
    task = build_task(cfg)
    if not task.examples("train", 1):
        raise ValueError(f"task {cfg.task.name!r} has no training examples")
    if not examples_up_to(task, "test", 1):  # the held-out eval needs at least one prompt
        raise ValueError(f"task {cfg.task.name!r} has no held-out (test) examples: a prompt is held out when its "
                         "hash falls in the test fraction (10%); give the dataset more records")
    recipe = build_recipe(cfg)
    if cfg.model.checkpoint is not None:
        ckpt = Path(cfg.model.checkpoint)
        if not ckpt.is_dir():
            raise ValueError(f"model.checkpoint: folder {str(ckpt)!r} does not exist; pass a checkpoint folder "
                             "(written by quads pretrain / quads train) or leave it unset to warm-start")
    elif cfg.task.name == "dataset":
        raise ValueError("model.checkpoint: the warm start trains on generated tasks only; pass --model.checkpoint "
                         "<folder> to train on a dataset file")
    elif allow_warm_start:
        ckpt = warm_start_checkpoint(cfg, task)
    else:
        raise ValueError("model.checkpoint is unset and warm start is disabled")
    try:
        model_config, _ = read_checkpoint_config(ckpt)
    except ValueError as e:
        raise ValueError(f"model.checkpoint: {e}") from None
    return Resolved(task, recipe, ckpt, model_config)


def load_policy(res: Resolved, dtype: str) -> tuple[MoEForCausalLM, Any]:
    """The starting policy in ``dtype`` and its tokenizer."""
    mcfg = dataclasses.replace(res.model_config, dtype=dtype)
    model, _ = load_checkpoint(res.checkpoint, MoEForCausalLM(mcfg))
    try:
        tok = load_tokenizer(res.checkpoint)
    except ValueError as e:
        raise ValueError(f"model.checkpoint: {e}; save the checkpoint with its tokenizer") from None
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
    if not (cfg.dtype == "bfloat16" and cfg.model.master_dtype == "float32"):
        return contextlib.nullcontext()  # same dtype: the weights' own dtype is the compute dtype
    return torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch_dtype(cfg.dtype))
