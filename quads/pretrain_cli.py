"""``quads pretrain``: parse a ``PretrainConfig``, train or fetch its cached warm start, print the result.

The warm start itself is ``quads.pretrain`` (library).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from quads.config import add_dataclass_args, build_config
from quads.pretrain import PretrainConfig, warm_start


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file with PretrainConfig fields")
    add_dataclass_args(parser, PretrainConfig)


def run(args: argparse.Namespace) -> int:
    from quads.model.checkpoint import read_checkpoint_config

    try:
        cfg = build_config(PretrainConfig, getattr(args, "config", None), args, skip=("config",))
    except ValueError as e:
        print(f"quads pretrain: {e}", file=sys.stderr)
        return 2
    cached = (cfg.folder() / "config.json").is_file()
    try:
        folder = warm_start(cfg)
    except ValueError as e:
        print(f"quads pretrain: {e}", file=sys.stderr)
        return 2
    model_cfg, extra = read_checkpoint_config(folder)
    res = extra.get("pretrain_result", {})
    print(f"{'cached' if cached else 'trained'} checkpoint: {folder}")
    steps = res.get("stopped_at_step", cfg.steps)
    reached = f" (target_pass {cfg.target_pass} reached at step {steps})" if "stopped_at_step" in res else ""
    print(f"task {cfg.task} difficulty {extra.get('difficulty')}, {cfg.preset} preset with max_seq_len "
          f"{model_cfg.max_seq_len}, {steps} steps{reached}, final ce {res.get('final_ce', float('nan')):.4f}, "
          f"held-out greedy pass@1 {res.get('heldout_pass@1')}")
    print(json.dumps({"metric": "pretrain", "checkpoint": str(folder), "cached": cached,
                      **{k: v for k, v in res.items() if k != "loss_history"},
                      **({"outliers_result": extra["outliers_result"]} if "outliers_result" in extra else {}),
                      **dataclasses.asdict(cfg)}))
    return 0
