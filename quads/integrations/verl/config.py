"""The verl config entries that run one quads recipe, written from one ``Recipe`` (both sides agree).

``verl_config(recipe)`` is the nested dict to merge into a verl PPO config (YAML), and
``hydra_overrides(recipe)`` the same as Hydra command-line overrides for ``verl.trainer.main_ppo``
(``shell_overrides``: each quoted for a shell command line):

| entry | what it does |
|---|---|
| ``actor_rollout_ref.actor.strategy: quads_fsdp2`` | verl builds ``QuadsFSDPEngine`` (FSDP2 + quads' trainer QAT) |
| ``actor_rollout_ref.actor.fsdp_config._target_``, ``quads_recipe``, ``quads_recipe_overrides`` | the trainer's recipe (``QuadsFSDPEngineConfig``) |
| ``actor_rollout_ref.rollout.engine_kwargs.vllm.quantization: quads`` | vLLM's quantization method ``quads`` (registered by quads' ``vllm.general_plugins`` entry point) |
| ``actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.quantization_config`` | ``{quant_method: quads, recipe: ...}``: the recipe vLLM's ``QuadsQuantConfig.from_config`` reads (a preset name, or ``Recipe.to_dict()`` when fields differ from the preset, e.g. the RAC ratio) |
| ``actor_rollout_ref.rollout.calculate_log_probs: true`` | the rollout's log-probs, which verl's ``rollout_corr/*`` and quads' ``mismatch/*`` compare |

A recipe whose trainer side is BF16 (``bf16``, ``fp8``, ``nvfp4``) keeps verl's ``fsdp2`` strategy; a
recipe whose rollout side is BF16 (``bf16``) leaves vLLM unquantized (its own BF16 layers).
``rollout.quantization`` stays null: verl accepts only fp8 / torchao / ascend there, and its
``engine_kwargs`` are passed to vLLM after (and over) verl's own arguments.
"""

from __future__ import annotations

from typing import Any

from quads.quant.recipe import PRESETS, Recipe

STRATEGY = "quads_fsdp2"  # quads.integrations.verl.engine.STRATEGY (kept here so this module needs no verl)
ENGINE_CONFIG_TARGET = "quads.integrations.verl.engine.QuadsFSDPEngineConfig"
QUANT_METHOD = "quads"  # quads.rollout.vllm.quant_config.QUANT_METHOD_NAME


def _recipe_value(recipe: Recipe) -> str | dict:
    """A preset's name when ``recipe`` equals that preset, else the full ``Recipe.to_dict()``."""
    return recipe.name if PRESETS.get(recipe.name) == recipe else recipe.to_dict()


def _preset_overrides(recipe: Recipe) -> dict[str, Any]:
    """The overrides with ``get_recipe(recipe.name, **overrides) == recipe``."""
    base = PRESETS.get(recipe.name)
    if base is None:
        raise ValueError(f"verl_config: recipe name {recipe.name!r} is not a preset ({', '.join(PRESETS)}); "
                         "start from a preset with get_recipe(name, **overrides)")
    out: dict[str, Any] = {}
    for side in ("trainer", "rollout"):
        a, b = getattr(base, side).to_dict(), getattr(recipe, side).to_dict()  # flat forms, JSON-safe
        out.update({f"{side}_{k}": v for k, v in b.items() if a[k] != v})
    for k in ("targets", "weight_dtype", "expert_path"):
        if getattr(base, k) != getattr(recipe, k):
            v = getattr(recipe, k)
            out[k] = list(v) if isinstance(v, tuple) else v
    return out


def verl_config(recipe: Recipe) -> dict:
    """Nested verl config entries (module docstring) for ``recipe``; merge under the PPO config root."""
    actor: dict[str, Any] = {}
    if not recipe.trainer.is_identity:
        actor = {"strategy": STRATEGY, "fsdp_config": {
            "_target_": ENGINE_CONFIG_TARGET, "quads_recipe": recipe.name,
            "quads_recipe_overrides": _preset_overrides(recipe)}}
    else:
        actor = {"strategy": "fsdp2"}
    rollout: dict[str, Any] = {"calculate_log_probs": True}
    if not recipe.rollout.is_identity:
        rollout["engine_kwargs"] = {"vllm": {
            "quantization": QUANT_METHOD,
            "hf_overrides": {"quantization_config": {"quant_method": QUANT_METHOD, "recipe": _recipe_value(recipe)}},
        }}
    return {"actor_rollout_ref": {"actor": actor, "rollout": rollout}}


def _hydra_value(v: Any) -> str:
    """Hydra override grammar: dicts ``{k:v}``, lists ``[a,b]``, quoted strings, lowercase booleans."""
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if v is None:
        return "null"
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


# keys that exist in verl's default PPO config (set with ``key=value``); the others are added (``+key=value``)
_EXISTING = {"actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.fsdp_config._target_",
             "actor_rollout_ref.rollout.calculate_log_probs"}
_DICT_LEAVES = {"quads_recipe_overrides", "quantization_config"}  # written as one Hydra dict each


def hydra_overrides(recipe: Recipe) -> list[str]:
    """``verl_config(recipe)`` as Hydra command-line overrides, one per entry."""
    out: list[str] = []

    def walk(prefix: str, node: dict) -> None:
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict) and k not in _DICT_LEAVES:
                walk(key, v)
            elif not (k == "quads_recipe_overrides" and not v):
                out.append(f"{'' if key in _EXISTING else '+'}{key}={_hydra_value(v)}")

    walk("", verl_config(recipe))
    return out


def shell_overrides(recipe: Recipe) -> list[str]:
    """``hydra_overrides`` quoted for a POSIX shell command line (double quotes: bash would otherwise
    brace-expand ``{a:1,b:2}`` into two words and strip Hydra's single quotes)."""
    out = []
    for o in hydra_overrides(recipe):
        bad = set(o) & set('"$`\\!')
        if bad:
            raise ValueError(f"override {o!r} holds {sorted(bad)}, which a double-quoted shell word changes; "
                             "use --format yaml")
        out.append(f'"{o}"')
    return out
