"""Checkpoints of the built-in model: ``model.safetensors`` + ``config.json`` (+ tokenizer), atomic.

``config.json`` = ``{"format_version", "architecture", "model": ModelConfig fields, "extra": {...}}``.
The folder is written next to its destination under a temporary name and renamed into place, so a
crash never leaves a half-written checkpoint. Tied ``lm_head.weight`` is stored once (as the embedding).

``load_model(folder)`` is the one loader of a policy for ``quads train / eval / diagnose``: a quads
checkpoint or a local Hugging Face folder (Qwen3-MoE, OLMoE, Mixtral; ``quads.model.hf``) -> (model,
tokenizer, extra). ``check_model_folder`` checks such a folder cheaply (config, weights headers and
sizes, tokenizer) before any expensive work; a bad folder is a ``UsageError``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quads.errors import UsageError
from quads.io import atomic_dir
from quads.model.config import ModelConfig
from quads.model.tokenizer import load_tokenizer
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


def _read_meta(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"{str(folder)!r} is not a checkpoint: no {CONFIG_FILE} (expected a folder written by "
                         "quads pretrain / quads train, or a Hugging Face model folder)")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def is_hf_folder(folder: str | Path) -> bool:
    """Whether ``folder/config.json`` is a transformers config (it names a ``model_type``)."""
    return "model_type" in _read_meta(folder)


def read_checkpoint_config(folder: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, extra) from ``folder/config.json``, checking format version and architecture.

    A Hugging Face folder gives its ``config_from_hf`` config in the folder's dtype and an empty extra.
    """
    meta = _read_meta(folder)
    if "model_type" in meta:
        from quads.model.hf import config_from_hf, folder_dtype

        try:
            return config_from_hf(meta, folder_dtype(meta)), {}
        except ValueError as e:
            raise UsageError(f"{str(folder)!r}: {e}") from None
    arch = meta.get("architecture")
    if arch != ARCHITECTURE:
        raise UsageError(f"{str(folder)!r}: architecture {arch!r}, expected {ARCHITECTURE!r} (a quads checkpoint) "
                         "or a model_type (a Hugging Face folder)")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise UsageError(f"{str(folder)!r}: format_version {version!r}, this quads reads <= {FORMAT_VERSION}; "
                         "upgrade quads")
    return ModelConfig.from_dict(meta["model"]), meta.get("extra", {})


def load_checkpoint(folder: str | Path, model: MoEForCausalLM | None = None, *,
                    device: torch.device | str | None = None) -> tuple[MoEForCausalLM, dict[str, Any]]:
    """Load a checkpoint; into ``model`` if given (its config must match, dtype aside), else a new one.

    Raises ValueError naming the mismatching config fields (e.g. ``n_experts: checkpoint 8, model 4``).
    """
    if is_hf_folder(folder):
        raise UsageError(f"{str(folder)!r} is a Hugging Face folder; load it with load_model")
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
    state = read_weights(Path(folder) / WEIGHTS_FILE)
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


def check_weights_file(path: str | Path) -> None:
    """A safetensors file whose header parses and whose size is what the header declares.

    Reads only the header, so a truncated or damaged file is found before any expensive work.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{str(path)!r} does not exist; the checkpoint is incomplete")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        raw = f.read(n) if 0 <= n <= size - 8 else b""
    try:
        header = json.loads(raw)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, IndexError, ValueError):
        raise UsageError(f"{str(path)!r} is not a valid safetensors file ({size} bytes, unreadable header); "
                         "the checkpoint is damaged: write or copy it again") from None
    if 8 + n + end != size:
        raise UsageError(f"{str(path)!r} is truncated or damaged: {size} bytes, its header declares "
                         f"{8 + n + end}; write or copy the checkpoint again")


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, checked with ``check_weights_file`` first."""
    check_weights_file(path)
    return load_file(str(path))


def weights_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint or HF folder (an index's shards, else every ``*.safetensors``)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{index}: not a valid safetensors index (expected a weight_map)") from None
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"no *.safetensors weights in {str(folder)!r}; the checkpoint is incomplete")
    return files


def check_model_folder(folder: str | Path, field: str) -> ModelConfig:
    """Cheap checks of a checkpoint or HF folder (config, weights, tokenizer); its ModelConfig.

    Errors are ``UsageError`` prefixed with ``field`` (the flag that named the folder).
    """
    folder = Path(folder)
    try:
        if not folder.is_dir():
            raise UsageError(f"folder {str(folder)!r} does not exist; pass a checkpoint folder (written by quads "
                             "pretrain / quads train) or a Hugging Face model folder")
        cfg, _ = read_checkpoint_config(folder)
        for f in weights_files(folder):
            check_weights_file(f)
        load_tokenizer(folder)
    except ValueError as e:  # UsageError, or the tokenizer's own ValueError (e.g. no eos token)
        raise UsageError(f"{field}: {e}") from None
    return cfg


def load_model(folder: str | Path, dtype: str | None = None, *, device: torch.device | str | None = None,
               field: str = "checkpoint") -> tuple[MoEForCausalLM, Any, dict[str, Any]]:
    """(model, tokenizer, extra) of a quads checkpoint or a Hugging Face folder, in ``dtype`` (default:
    the folder's), on ``device``. The folder is checked first (``check_model_folder``)."""
    check_model_folder(folder, field)
    try:  # what is left to find is a tensor that does not fit the config: the folder's fault too
        if is_hf_folder(folder):
            from quads.model.hf import load_hf_model

            model, tokenizer = load_hf_model(folder, dtype, device=device)
            return model, tokenizer, {}
        cfg, _ = read_checkpoint_config(folder)
        if dtype is not None:
            cfg = dataclasses.replace(cfg, dtype=dtype)
        model, extra = load_checkpoint(folder, MoEForCausalLM(cfg), device=device)
    except ValueError as e:
        raise UsageError(f"{field}: {e}") from None
    return model, load_tokenizer(folder), extra
