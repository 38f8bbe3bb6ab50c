"""``quads outliers``: inject activation outlier channels into an existing checkpoint, function-preserving.

Reads ``checkpoint`` (a quads checkpoint or a Hugging Face MoE folder), applies
``quads.model.outliers.inject_checked`` (scale ``channels`` of the chosen RMSNorm gains by ``scale``,
divide the matching weight columns by it; the logits are checked on a probe batch) and writes a new
checkpoint to ``out_dir`` whose ``config.json`` records ``extra.outliers`` (the settings) and
``extra.outliers_result`` (the check). The warm start does the same with ``quads pretrain
--outliers.mode inject``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from quads.config import add_dataclass_args, build_config, to_dict


@dataclass
class OutliersCommandConfig:
    """``quads outliers``: where from, where to, and the outlier channels."""

    checkpoint: str = ""  # source checkpoint folder (quads or Hugging Face MoE)
    out_dir: str = ""  # folder of the new checkpoint (must not hold a checkpoint already)
    channels: list[int] = field(default_factory=list)  # hidden channels made outliers, in every layer
    scale: float = 32.0  # gain factor s (a power of two keeps the BF16 function bit for bit)
    sites: list[str] = field(default_factory=lambda: ["mlp"])  # norms scaled: mlp (router + experts), attn (q/k/v)
    device: str = "cpu"  # where the model is loaded and the function check runs (cpu, cuda, cuda:1 ...)

    def __post_init__(self) -> None:
        if not self.checkpoint or not self.out_dir:
            raise ValueError("--checkpoint and --out-dir are required (the source checkpoint and the new folder)")
        self.outliers()  # validates

    def outliers(self):
        from quads.model.outliers import OutlierConfig

        return OutlierConfig(mode="inject", channels=list(self.channels), scale=self.scale, sites=list(self.sites))


def probe_ids(tokenizer, extra: dict, device: str):
    """Input ids [B, L] for the function check: the checkpoint's task's training demonstrations when its
    ``extra`` names a built-in task, else a fixed seeded batch of ids."""
    import torch

    from quads.pretrain import collate, encode_sft
    from quads.tasks import examples_up_to, get_task

    name = extra.get("task")
    if name and name != "dataset":
        kw = {"difficulty": extra["difficulty"]} if extra.get("difficulty") is not None else {}
        task = get_task(name, **kw)
        seqs = [encode_sft(tokenizer, e.prompt, task.demonstration(e)) for e in examples_up_to(task, "train", 8)]
        return collate(seqs, tokenizer.pad_id)[0].to(device)
    gen = torch.Generator().manual_seed(0)
    return torch.randint(min(4, tokenizer.vocab_size - 1), tokenizer.vocab_size, (4, 64), generator=gen).to(device)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file with the fields below")
    add_dataclass_args(parser, OutliersCommandConfig)


def run(args: argparse.Namespace) -> int:
    from quads.errors import UsageError, check_device
    from quads.io import check_output_dir
    from quads.model.checkpoint import load_model, save_checkpoint
    from quads.model.outliers import inject_checked

    try:
        cfg = build_config(OutliersCommandConfig, getattr(args, "config", None), args, skip=("config",))
        check_device(cfg.device, "device")
        check_output_dir(cfg.out_dir, "out_dir")
        if (Path(cfg.out_dir) / "config.json").exists():
            raise ValueError(f"out_dir {cfg.out_dir!r} already holds a checkpoint; pass a new folder")
        model, tok, extra = load_model(cfg.checkpoint, device=cfg.device)
        if extra.get("outliers", {}).get("mode", "none") != "none":
            raise ValueError(f"{cfg.checkpoint!r} already has injected outliers ({extra['outliers']}); start from "
                             "the checkpoint without them")
        out = cfg.outliers()
        check = inject_checked(model, out, probe_ids(tok, extra, cfg.device))
    except (ValueError, UsageError) as e:
        print(f"quads outliers: {e}", file=sys.stderr)
        return 2
    extra = {**extra, "outliers": to_dict(out), "outliers_result": {**check, "base_checkpoint": cfg.checkpoint}}
    folder = save_checkpoint(model, cfg.out_dir, extra, tokenizer=tok)
    print(f"checkpoint with outliers: {folder}; channels {out.channels} x{out.scale:g} at {', '.join(out.sites)}; "
          f"max |logit change| {check['max_abs_logit_change']:.3g}")
    print(json.dumps({"metric": "outliers", "checkpoint": str(folder), **to_dict(out), **check}))
    return 0
