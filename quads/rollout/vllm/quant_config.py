"""``QuadsQuantConfig``: the ``"quads"`` vLLM quantization method, carrying one quads ``Recipe``.

vLLM builds it from the engine's ``hf_overrides={"quantization_config_dict_json": json}`` where the
JSON is ``{"quant_method": "quads", "recipe": Recipe.to_dict() or a preset name, "overrides": {...},
"weight_storage": "packed" | "master"}`` (``engine.quant_overrides``); the same dict also works as
``hf_overrides={"quantization_config": {...}}``. The checkpoint folder needs no ``quantization_config``:
the master weights stay BF16 on disk and are quantized at load time and at every weight push, with the
recipe's rollout ``LinearSpec``. Every key is optional: ``recipe`` defaults to the ``quads`` preset,
``overrides`` are ``get_recipe`` keyword arguments applied to it (e.g. ``{"rac_ratio": 0.25}``),
``weight_storage`` defaults to ``packed``; so ``quantization="quads"`` alone works.

``weight_storage`` (see ``quads.rollout.vllm.weights``): ``packed`` keeps only the NVFP4 codes, E4M3
block scales and FP32 global scales of every quantized weight (0.5625 bytes per weight plus 4 bytes per
unit); ``master`` keeps vLLM's master weights in the model dtype and the rollout operands beside them
(debugging, and the only storage that can switch weight formats with ``set_recipe`` or hold a
non-NVFP4 rollout weight).

Which layers get quads' methods: the recipe's ``targets`` (fnmatch patterns) are matched against
quads / Hugging Face module names, which this module derives from vLLM's layer prefixes:

| vLLM layer (prefix)                                | quads name(s)                                      |
|----------------------------------------------------|----------------------------------------------------|
| ``model.layers.0.mlp.experts.routed_experts``      | ``model.layers.0.mlp.experts``                     |
| ``model.layers.0.block_sparse_moe.experts...``     | ``model.layers.0.mlp.experts`` (Mixtral)           |
| ``model.layers.0.self_attn.qkv_proj`` (fused)      | ``...self_attn.q_proj``, ``k_proj``, ``v_proj``    |
| ``model.layers.0.self_attn.o_proj``                | ``model.layers.0.self_attn.o_proj``                |

A module is targeted when its name or one of its ancestors matches a pattern (as in
``quads.quant.quantize_model``); routers, ``lm_head`` and embeddings never are. A fused vLLM
linear whose shards are partly targeted cannot be split and raises ``ValueError``.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from quads.quant.apply import PROTECTED_NAMES
from quads.quant.recipe import Recipe, get_recipe
from quads.rollout.vllm.weights import STORAGES

QUANT_METHOD_NAME = "quads"  # the name vLLM knows the method by: quantization="quads"

ROUTED_SUFFIX = ".routed_experts"
# the keys of the method's quantization config (a public interface: RL frameworks' configs name them)
CONFIG_KEYS = ("quant_method", "recipe", "overrides", "weight_storage")


def quads_name(prefix: str) -> str:
    """quads / HF module name of a vLLM layer prefix (experts wrapper and Mixtral naming undone)."""
    return prefix.removesuffix(ROUTED_SUFFIX).replace(".block_sparse_moe.", ".mlp.")


def is_targeted(name: str, targets: tuple[str, ...]) -> bool:
    """``name`` or one of its dotted ancestors matches a pattern, and the module is not protected."""
    if name.rsplit(".", 1)[-1] in PROTECTED_NAMES:
        return False
    parts = name.split(".")
    ancestors = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return any(fnmatch.fnmatchcase(a, pat) for a in ancestors for pat in targets)


def quant_overrides(recipe: Recipe, weight_storage: str = "packed") -> dict[str, str]:
    """``hf_overrides`` entry that makes vLLM build ``QuadsQuantConfig(recipe, weight_storage)``."""
    return {"quantization_config_dict_json": json.dumps(
        {"quant_method": QUANT_METHOD_NAME, "recipe": recipe.to_dict(), "weight_storage": weight_storage})}


@register_quantization_config(QUANT_METHOD_NAME)
class QuadsQuantConfig(QuantizationConfig):
    """A recipe's rollout side inside vLLM. Mutable state lives here, shared by all layers of one model:

    ``recipe`` (switchable with ``worker.set_recipe`` among recipes with the same targets) and
    ``sync_ok`` (None before the first verified push, then the result of the last fingerprint check;
    a worker holding ``False`` refuses to run quads layers, see ``methods``). ``weight_storage`` is
    fixed when vLLM builds the model.
    """

    def __init__(self, recipe: Recipe | None = None, weight_storage: str = "packed") -> None:
        super().__init__()
        recipe = get_recipe("quads") if recipe is None else recipe
        if weight_storage not in STORAGES:
            raise ValueError(f"quads quantization_config['weight_storage'] must be one of {list(STORAGES)}, got "
                             f"{weight_storage!r}")
        if weight_storage == "packed" and recipe.rollout.weight != "nvfp4":
            raise ValueError(
                f"quads weight_storage='packed' holds NVFP4 weights, but recipe {recipe.name!r} rolls out with "
                f"weight format {recipe.rollout.weight!r}; set weight_storage='master' in the quantization config"
            )
        self.recipe = recipe
        self.weight_storage = weight_storage
        self.sync_ok: bool | None = None
        self.sync_detail: str = ""

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # pure PyTorch emulation: any device vLLM runs on

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuadsQuantConfig:
        unknown = set(config) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in the quads quantization_config; valid: {list(CONFIG_KEYS)}")
        recipe = config.get("recipe", "quads")
        overrides = config.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"quads quantization_config['overrides'] must be a dict of get_recipe overrides, got {overrides!r}")
        if isinstance(recipe, dict):
            recipe = Recipe.from_dict(recipe)
        elif not isinstance(recipe, str):
            raise ValueError(f"quads quantization_config['recipe'] must be a preset name or Recipe.to_dict(), got {recipe!r}")
        return cls(get_recipe(recipe, **overrides), config.get("weight_storage", "packed"))

    @classmethod
    def from_config_dict_json(cls, text: str) -> QuadsQuantConfig:
        return cls.from_config(json.loads(text))

    def shard_names(self, prefix: str) -> list[str]:
        """quads names of the shards of a (possibly fused) vLLM linear, in output-row order."""
        parent, _, leaf = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(leaf)
        if not shards:
            return [quads_name(prefix)]
        return [quads_name(f"{parent}.{s}" if parent else s) for s in shards]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from quads.rollout.vllm.methods import QuadsFusedMoEMethod, QuadsLinearMethod

        targets = self.recipe.targets
        if isinstance(layer, LinearBase):
            names = self.shard_names(prefix)
            hit = [is_targeted(n, targets) for n in names]
            if not any(hit):
                return UnquantizedLinearMethod()
            if not all(hit):
                raise ValueError(
                    f"vLLM fuses {names} into one layer ({prefix}) but the recipe targets {list(targets)} match "
                    f"only {[n for n, h in zip(names, hit) if h]}; target all of them or none"
                )
            return QuadsLinearMethod(self, names)
        if isinstance(layer, RoutedExperts):
            name = quads_name(prefix)
            if is_targeted(name, targets):
                return QuadsFusedMoEMethod(layer.moe_config, self, name)
            return UnquantizedFusedMoEMethod(layer.moe_config)
        return None
