"""``quads eval``: pass@1 and pass@k of a checkpoint on a task's held-out split or a dataset file.

The command parses its flags, loads the policy (``quads.model.checkpoint.load_model``), picks the task
and held-out prompts, and scores them with ``quads.evaluation.evaluate_model`` (``n_samples`` responses
per prompt, greedy when ``temperature`` is 0; the unbiased pass@k estimator of Chen et al. (2021)).
Output: a table and one JSON line (``{"metric": "eval", ...}``).

Without ``--task`` / ``--dataset`` the checkpoint's own task and level are evaluated (``quads train``
and ``quads pretrain`` record them in the checkpoint); the line printed first names what is evaluated
and why. A dataset file is scored on its held-out split, the same hash split training used.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from quads.config import add_dataclass_args, build_config
from quads.errors import UsageError
from quads.evaluation import EvalResult, evaluate_model, pass_at_k
from quads.tasks import Example, Task, get_task, require_sandbox


@dataclass
class EvalConfig:
    checkpoint: str = ""  # checkpoint folder (quads pretrain / train, with its tokenizer) or Hugging Face folder
    task: str | None = None  # a registered task (its held-out split); None = the checkpoint's task, else arithmetic
    difficulty: int | None = None  # task difficulty; None = the checkpoint's level when it is that task, else the default
    dataset: str | None = None  # a jsonl/parquet file instead of a task (its held-out split, as in training)
    split_seed: int | None = None  # seed of a dataset's train/test split; None = the checkpoint's training seed, else 0
    n_prompts: int = 200  # held-out prompts evaluated (the first n of the split)
    n_samples: int = 1  # responses per prompt (n in the estimator)
    k: tuple[int, ...] = (1,)  # the k of pass@k; each <= n_samples
    temperature: float = 0.0  # 0 = greedy
    max_new_tokens: int = 64  # response length cap
    batch_size: int = 64  # prompts per generate call
    recipe: str | None = None  # rollout precision recipe (quads.quant); None = the checkpoint as stored
    seed: int = 0  # sampling seed
    device: str = "cpu"
    sandbox: Literal["full", "no-cgroup", "process"] = "full"  # code isolation, weaker = opt-in (docs/TASKS.md)
    threads: int = 0  # torch CPU threads; 0 = torch default

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch default); got {self.threads}")
        if self.n_prompts < 1 or self.n_samples < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("n_prompts, n_samples, batch_size and max_new_tokens must be >= 1")
        self.k = tuple(sorted(set(int(k) for k in self.k)))
        if not self.k or min(self.k) < 1 or max(self.k) > self.n_samples:
            raise ValueError(f"every k must be in [1, n_samples={self.n_samples}], got {list(self.k)}; "
                             "raise --n-samples or lower --k")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and self.n_samples > 1:
            raise ValueError("greedy decoding (temperature 0) gives n identical samples; set --temperature > 0 "
                             "for n_samples > 1")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file with EvalConfig fields")
    add_dataclass_args(parser, EvalConfig)


def _load(cfg: EvalConfig):
    from quads.errors import check_device
    from quads.model.checkpoint import load_model

    if not cfg.checkpoint:
        raise UsageError("--checkpoint is required (a folder written by quads pretrain / train, or a Hugging Face "
                         "model folder)")
    check_device(cfg.device, "device")
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    model, tokenizer, extra = load_model(cfg.checkpoint, device=cfg.device, field="--checkpoint")
    if cfg.recipe is not None:
        from quads.quant import quantize_model

        quantize_model(model, cfg.recipe, side="rollout", verbose=False)
    return model.eval(), tokenizer, extra


def _task_and_examples(cfg: EvalConfig, extra: dict) -> tuple[Task, list[Example], str]:
    """The task and held-out examples to score; by default the task and level the checkpoint records
    (``extra`` of quads pretrain / train: ``task``, ``difficulty``, ``dataset``, ``split_seed``)."""
    dataset, name, origin = cfg.dataset, cfg.task, "as asked"
    if dataset is None and name is None:
        if extra.get("task") == "dataset" and extra.get("dataset"):
            dataset, origin = extra["dataset"], "the checkpoint's task"
        else:
            name = extra.get("task") or "arithmetic"
            origin = "the checkpoint's task" if extra.get("task") else "the default task (the checkpoint records none)"
    if dataset is not None:
        from quads.tasks import DatasetTask

        seed = cfg.split_seed
        if seed is None:
            trained_on = extra.get("dataset")
            same = trained_on is not None and Path(trained_on).resolve() == Path(dataset).resolve()
            seed = extra.get("split_seed", 0) if same else 0
        if not Path(dataset).is_file():
            raise UsageError(f"--dataset: file {str(dataset)!r} does not exist")
        task = DatasetTask(dataset, seed=seed)
        examples = task.examples("test", cfg.n_prompts)
        if not examples:
            n = len(task.examples("train"))
            what = "holds no records" if n == 0 else f"has no held-out record ({n} training records, split seed {seed})"
            raise UsageError(f"--dataset {dataset} {what}; there is nothing to evaluate: pass a file with more records")
        return task, examples, f"dataset {dataset} held-out split (split seed {seed}; {origin})"
    kwargs = {}
    difficulty = cfg.difficulty  # else the level the checkpoint was trained / warm-started on
    if difficulty is None and extra.get("task") == name:
        difficulty = extra.get("difficulty")
    if difficulty is not None:
        kwargs["difficulty"] = difficulty
    task = get_task(name, **kwargs)
    level = getattr(task, "difficulty", difficulty)
    desc = f"task {name}" + (f" (difficulty {level})" if level is not None else "")
    examples = task.examples("test", cfg.n_prompts)
    if not examples:
        raise UsageError(f"{desc}: the held-out split is empty")
    return task, examples, f"{desc} held-out split ({origin})"


def run(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(EvalConfig, getattr(args, "config", None), args, skip=("config",))
        model, tokenizer, extra = _load(cfg)
        task, examples, desc = _task_and_examples(cfg, extra)
        require_sandbox({e.data_source for e in examples}, cfg.sandbox)
    except ValueError as e:
        print(f"quads eval: {e}", file=sys.stderr)
        return 2
    print(f"quads eval: evaluating {desc}, {len(examples)} prompts", file=sys.stderr)
    res = evaluate_model(model, tokenizer, task, examples, n_samples=cfg.n_samples, ks=cfg.k,
                         temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                         batch_size=cfg.batch_size, seed=cfg.seed, recipe=cfg.recipe)
    print(f"checkpoint {cfg.checkpoint}, {desc}, {res.n_prompts} prompts x {res.n_samples} samples, "
          f"temperature {cfg.temperature:g}, recipe {cfg.recipe or 'as stored'}")
    print(f"{'metric':<10} {'value':>8}")
    for k, v in res.pass_at.items():
        print(f"{f'pass@{k}':<10} {v:>8.4f}")
    if res.reasons:
        print("top failure reasons: " + ", ".join(f"{r} ({c})" for r, c in res.reasons.items()))
    line = {"metric": "eval", "checkpoint": str(Path(cfg.checkpoint)), "source": desc,
            **{f"pass@{k}": round(v, 6) for k, v in res.pass_at.items()},
            "n_prompts": res.n_prompts, "n_samples": res.n_samples, "temperature": cfg.temperature,
            "recipe": cfg.recipe, "mean_response_chars": round(res.mean_response_chars, 2)}
    print(json.dumps(line))
    return 0


__all__ = ["EvalConfig", "EvalResult", "evaluate_model", "pass_at_k", "register", "run"]
