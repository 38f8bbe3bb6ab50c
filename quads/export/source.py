"""Where an export reads from: a training run folder, a ``save_checkpoint`` folder or a Hugging Face folder.

``load_source(path)`` returns an ``ExportSource``: the state dict in Hugging Face Qwen3-MoE naming with the
routed experts fused exactly as ``quads.model`` and transformers 5 store them
(``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H], rows [:I] gate, [I:] up; ``down_proj`` [E, H, I]),
the transformers ``config.json`` dict of the target architecture, the tokenizer files to copy and the
recipe the run trained with (``None`` for a bare checkpoint).

Run folders (``quads train``, see ``quads.rl.trainer``) hold ``config.yaml`` (its ``recipe:`` section: name
and overrides such as ``weight_tile`` / ``targets``) and, once the run finished, ``policy/`` (a
``save_checkpoint`` folder of the final master weights); ``checkpoints/step_N/state.pt`` are training states,
not exportable. The checkpoint used is ``policy`` (or ``final`` / ``latest``) when present, else the
sub-folder with the highest step number in its name. A checkpoint folder is any folder with
``config.json`` and ``*.safetensors``.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from quads.model.checkpoint import read_weights

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
_PREFERRED_CKPT_NAMES = ("policy", "final", "latest")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class ExportSource:
    state_dict: dict[str, torch.Tensor]  # HF Qwen3-MoE names, routed experts fused ([E, 2I, H] / [E, H, I])
    hf_config: dict[str, Any]  # transformers config.json of the target architecture (no quantization_config)
    checkpoint_dir: Path  # the folder the tensors came from
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)  # file name -> content, copied verbatim
    recipe: str | None = None  # recipe name of the training run (None: a bare checkpoint)
    run_config: dict[str, Any] = field(default_factory=dict)  # the run's config.yaml, if any
    recipe_dict: dict[str, Any] | None = None  # the full recipe (Recipe.to_dict()) if the run stored it
    recipe_overrides: dict[str, Any] = field(default_factory=dict)  # get_recipe overrides of the run


def is_checkpoint_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _step_of(path: Path) -> int:
    nums = re.findall(r"\d+", path.name)
    return int(nums[-1]) if nums else -1


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path | None]:
    """``path`` (run folder or checkpoint folder) -> (checkpoint folder, run folder or None)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--checkpoint {path}: no such folder; pass a training run folder or a checkpoint folder")
    if is_checkpoint_dir(path):
        run = path.parent if (path.parent / "config.yaml").is_file() else None
        if run is None and (path.parent.parent / "config.yaml").is_file():
            run = path.parent.parent
        return path, run
    candidates = [p.parent for p in path.rglob("config.json") if is_checkpoint_dir(p.parent)]
    candidates = [c for c in candidates if len(c.relative_to(path).parts) <= 3]
    if not candidates:
        raise ValueError(
            f"--checkpoint {path}: no exportable checkpoint (expected config.json + *.safetensors in the folder or "
            "in a sub-folder such as policy/); a run writes policy/ when it finishes, and the training states "
            "under checkpoints/ are not exportable"
        )
    for name in _PREFERRED_CKPT_NAMES:
        named = [c for c in candidates if c.name == name]
        if named:
            return sorted(named, key=lambda c: len(c.parts))[0], path
    return max(candidates, key=lambda c: (_step_of(c), str(c))), path


def _find_recipe(cfg: Any) -> str | None:
    """The recipe name from a run config.yaml: ``recipe: name`` or ``recipe: {name: ...}``, at any depth."""
    if isinstance(cfg, dict):
        r = cfg.get("recipe")
        if isinstance(r, str):
            return r
        if isinstance(r, dict) and isinstance(r.get("name"), str):
            return r["name"]
        for v in cfg.values():
            found = _find_recipe(v)
            if found:
                return found
    return None


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(read_weights(f))
    return sd


def fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``experts.{e}.{gate,up,down}_proj.weight`` -> fused ``gate_up_proj`` / ``down_proj``."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for k, v in sd.items():
        m = _PER_EXPERT.match(k)
        if m is None:
            out[k] = v
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["kind"], {})[int(m["e"])] = v
    for prefix, kinds in groups.items():
        n = len(kinds.get("down_proj", {}))
        missing = [(kind, e) for kind in ("gate_proj", "up_proj", "down_proj") for e in range(n)
                   if e not in kinds.get(kind, {})]
        if missing or n == 0:
            raise ValueError(f"{prefix}: incomplete per-expert weights (missing {missing[:4]}...)")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]], dim=0) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(n)])
    return out


def _recipe_overrides(cfg: dict[str, Any]) -> dict[str, Any]:
    """``get_recipe`` overrides from the run's ``recipe:`` section (``quads.rl.config.RecipeSection``)."""
    r = cfg.get("recipe")
    if not isinstance(r, dict) or "name" not in r or "rollout" in r:
        return {}
    from quads.rl.config import RecipeSection

    return RecipeSection(**r).overrides()


def _find_recipe_dict(cfg: Any) -> dict[str, Any] | None:
    """A full recipe (``Recipe.to_dict()``: name, trainer, rollout, targets, ...) stored in the run config."""
    if isinstance(cfg, dict):
        r = cfg.get("recipe")
        if isinstance(r, dict) and "rollout" in r:
            return r
        for v in cfg.values():
            found = _find_recipe_dict(v)
            if found:
                return found
    return None


def _hf_folder_from_quads(ckpt: Path, tmp: Path) -> Path:
    """A built-in ``save_checkpoint`` folder -> a BF16-free (master dtype) Qwen3-MoE HF folder in ``tmp``."""
    from quads.model.checkpoint import load_checkpoint
    from quads.model.hf import save_hf_model
    from quads.model.tokenizer import load_tokenizer

    model, _ = load_checkpoint(ckpt)
    tok = load_tokenizer(ckpt) if (ckpt / "tokenizer.json").is_file() else None
    return save_hf_model(model, tok, tmp / "hf", architecture="qwen3_moe")


def load_source(path: str | Path) -> ExportSource:
    """Resolve ``path`` and read it; a built-in checkpoint goes through ``quads.model.hf.save_hf_model``
    (Qwen3-MoE naming, char tokenizer as a ``tokenizers`` file) into a temp folder first."""
    ckpt, run = resolve_checkpoint(path)
    raw = json.loads((ckpt / "config.json").read_text())
    if "model_type" in raw:
        return _load_hf(ckpt, ckpt, run, raw)
    if raw.get("architecture") != "quads_moe":
        raise ValueError(f"{ckpt}/config.json is neither a Hugging Face config (model_type) nor a quads "
                         "checkpoint (architecture quads_moe)")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = _hf_folder_from_quads(ckpt, Path(tmp))
        return _load_hf(hf_dir, ckpt, run, json.loads((hf_dir / "config.json").read_text()))


def _load_hf(folder: Path, ckpt: Path, run: Path | None, raw: dict[str, Any]) -> ExportSource:
    if "quantization_config" in raw:
        raise ValueError(f"{ckpt} is already quantized ({raw['quantization_config'].get('quant_method')}); "
                         "import it with quads.export.load_exported and export the BF16 model")
    if raw["model_type"] != "qwen3_moe":
        raise ValueError(f"{ckpt}: model_type {raw['model_type']!r}; export supports Qwen3-MoE (qwen3_moe)")
    hf_config = dict(raw)
    sd = fuse_experts(load_state_dict(folder))
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" in sd:
        sd.pop("lm_head.weight")
    run_config: dict[str, Any] = {}
    if run is not None and (run / "config.yaml").is_file():
        run_config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    tok = {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
    recipe = _find_recipe(run_config)
    if recipe is None and (ckpt / "config.json").is_file():  # save_checkpoint(extra={"recipe": ...})
        extra = json.loads((ckpt / "config.json").read_text()).get("extra") or {}
        recipe = extra.get("recipe") if isinstance(extra.get("recipe"), str) else None
    return ExportSource(state_dict=sd, hf_config=hf_config, checkpoint_dir=ckpt, tokenizer_files=tok,
                        recipe=recipe, run_config=run_config, recipe_dict=_find_recipe_dict(run_config),
                        recipe_overrides=_recipe_overrides(run_config))
