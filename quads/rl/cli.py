"""``quads train [--config YAML] [--section.field VALUE ...]``: GRPO with a quantized rollout engine.

Flags map one to one onto ``TrainConfig`` fields (``--optim.lr 1e-4``, ``--recipe.name bf16``,
``--correction.kind icepop``); YAML files hold the same nested keys. With ``--resume true`` and no
``--config``, the run folder's own ``config.yaml`` is the base, so ``quads train --out-dir RUN --resume
true`` continues a crashed run (from step 0 when it stopped before its first checkpoint). Exit codes: 0 done,
2 bad input, 3 guard abort (mismatch guard, or a non-finite loss with ``guard.nonfinite=abort``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quads.config import add_dataclass_args, build_config
from quads.rl.config import TrainConfig


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="YAML", help="YAML file with TrainConfig fields")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or step messages")
    add_dataclass_args(parser, TrainConfig)


def load_config(args: argparse.Namespace) -> TrainConfig:
    """defaults <- YAML (``--config``, or the run's config.yaml when resuming) <- flags."""
    yaml_path = getattr(args, "config", None)
    if yaml_path is None and str(getattr(args, "resume", "")).lower() in ("1", "true", "yes", "on"):
        out = getattr(args, "out_dir", None)
        if out is not None and (Path(out) / "config.yaml").is_file():
            yaml_path = Path(out) / "config.yaml"
    return build_config(TrainConfig, yaml_path, args, skip=("config", "quiet"))


def run(args: argparse.Namespace) -> int:
    from quads.rl.trainer import GRPOTrainer

    try:
        cfg = load_config(args)
        trainer = GRPOTrainer(cfg, quiet=args.quiet)
    except ValueError as e:
        print(f"quads train: {e}", file=sys.stderr)
        return 2
    print(f"quads train: run folder {trainer.run_dir}; policy {trainer.res.checkpoint}; recipe "
          f"{trainer.res.recipe.name} (trainer {trainer.res.recipe.trainer.describe()}, rollout "
          f"{trainer.res.recipe.rollout.describe()}); task {cfg.task.name}", file=sys.stderr)
    code = _train(trainer)
    if trainer.dist.enabled:  # a torchrun rank ends without interpreter finalization (distributed.end_process)
        from quads.rl import distributed

        distributed.end_process(code)
    return code


def _train(trainer) -> int:
    from quads.rl.trainer import GuardError

    try:
        res = trainer.run()
    except GuardError as e:
        print(f"quads train: {e}", file=sys.stderr)
        return 3
    last = res.last
    print(f"done: {res.steps} steps in {trainer.run_dir}")
    print(f"held-out pass@1: {res.eval_start:.3f} at the start of RL -> {res.eval_end:.3f} at the end")
    print(f"last step: reward {last.get('reward/mean', float('nan')):.3f}, gap mean "
          f"{last.get('mismatch/logp_gap_mean', float('nan')):.4f}, gap max "
          f"{last.get('mismatch/logp_gap_max', float('nan')):.3f}, k3 {last.get('mismatch/k3', float('nan')):.2e}")
    print(f"report: {res.report_dir / 'report.md'}")
    print(f"policy: {res.policy_dir}")
    print(json.dumps({"metric": "train", "run_dir": str(res.run_dir), "steps": res.steps,
                      "eval_start": res.eval_start, "eval_end": res.eval_end,
                      "reward_last": last.get("reward/mean"), "gap_mean_last": last.get("mismatch/logp_gap_mean"),
                      "k3_last": last.get("mismatch/k3")}))
    return 0
