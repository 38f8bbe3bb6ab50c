"""Checkpoints of the built-in model: ``model.safetensors`` + ``config.json`` (+ tokenizer), atomic.

``config.json`` = ``{"format_version", "architecture", "model": ModelConfig fields, "extra": {...}}``.
The folder is written next to its destination under a temporary name and renamed into place, so a
crash never leaves a half-written checkpoint. Tied ``lm_head.weight`` is stored once (as the embedding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quads.io import atomic_dir
from quads.model.config import ModelConfig
from quads.model.transformer import MoEForCausalLM

FORMAT_VERSION = 1
ARCHITECTURE = "quads_moe"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_IGNORED_FIELDS = ("dtype",)  # a checkpoint may be loaded into a model of another dtype (values are cast)


def save_checkpoint(model: MoEForCausalLM, folder: str | Path, extra: dict[str, Any] | None = None, *,
                    tokenizer: Any | None = None) -> Path:
    """Write ``model`` (and ``tokenizer`` if it has ``save(folder)``) to ``folder`` atomically."""
    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        meta = {"format_version": FORMAT_VERSION, "architecture": ARCHITECTURE,
                "model": model.config.to_dict(), "extra": extra or {}}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if tokenizer is not None and hasattr(tokenizer, "save"):
            tokenizer.save(tmp)
    return folder


def read_checkpoint_config(folder: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, extra) from ``folder/config.json``, checking format version and architecture."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} is not a quads checkpoint: no {CONFIG_FILE}")
    meta = json.loads(path.read_text())
    arch = meta.get("architecture")
    if arch != ARCHITECTURE:
        raise ValueError(f"{str(folder)!r}: architecture {arch!r}, expected {ARCHITECTURE!r}; "
                         "for a Hugging Face folder use quads.model.hf.load_hf_model")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"{str(folder)!r}: format_version {version!r}, this quads reads <= {FORMAT_VERSION}; "
                         "upgrade quads")
    return ModelConfig.from_dict(meta["model"]), meta.get("extra", {})


def load_checkpoint(folder: str | Path, model: MoEForCausalLM | None = None, *,
                    device: torch.device | str | None = None) -> tuple[MoEForCausalLM, dict[str, Any]]:
    """Load a checkpoint; into ``model`` if given (its config must match, dtype aside), else a new one.

    Raises ValueError naming the mismatching config fields (e.g. ``n_experts: checkpoint 8, model 4``).
    """
    cfg, extra = read_checkpoint_config(folder)
    if model is None:
        model = MoEForCausalLM(cfg)
    else:
        have = getattr(model, "config", None)
        if not isinstance(have, ModelConfig):
            raise ValueError(f"load_checkpoint: expected a MoEForCausalLM, got {type(model).__name__}")
        a, b = cfg.to_dict(), have.to_dict()
        diff = [f"{k}: checkpoint {a[k]!r}, model {b.get(k)!r}" for k in a
                if k not in _IGNORED_FIELDS and a[k] != b.get(k)]
        if diff:
            raise ValueError(f"checkpoint {str(folder)!r} does not fit this model; mismatching fields: "
                             + "; ".join(diff))
    state = load_file(str(Path(folder) / WEIGHTS_FILE))
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(folder)!r}: missing tensors {sorted(missing)[:8]}, unexpected "
                         f"{sorted(unexpected)[:8]}")
    model.load_state_dict(state, strict=True)
    if device is not None:
        model.to(device)
    return model, extra
