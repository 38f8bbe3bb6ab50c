"""``quantize_model`` / ``dequantize_model``: swap a model's targeted modules in place.

Targets are fnmatch patterns on module names (``Recipe.targets``, default ``*.mlp.experts``). A
matched module becomes:
- ``QuantizedExperts`` when it holds 3-D ``gate_up_proj`` / ``down_proj`` parameters (the built-in
  model, transformers 5 Qwen3-MoE / OLMoE / Mixtral);
- ``QuantizedLinear`` when it is an ``nn.Linear``;
- otherwise (e.g. an ``nn.ModuleList`` of per-expert MLPs, older layouts, or a whole decoder layer)
  every expert stack and every ``nn.Linear`` inside it is swapped as above.
Always kept as they are, even when a pattern matches: routers (modules named ``gate`` or ``router``),
embeddings (``nn.Embedding``, the model's input embeddings), ``lm_head`` (the output embeddings) and
norms (never ``nn.Linear``, so never swapped).

Calling ``quantize_model`` on an already quantized model re-applies cleanly: the previous swap is
undone first (the same parameters are kept), then the new recipe and side are applied.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from quads.quant.layers import QuantizedExperts, QuantizedLinear, _QuantizedBase, link_stores
from quads.quant.recipe import Recipe, get_recipe

PROTECTED_NAMES = ("gate", "router", "lm_head", "embed_tokens")


@dataclass
class QuantizedModuleInfo:
    name: str  # module name in the model
    kind: str  # "experts" or "linear"
    spec: str  # e.g. "W4A4+RAC0.5(dynamic)"
    n_params: int  # parameters of the module (all quantized with the spec)


@dataclass
class QuantSummary:
    """What ``quantize_model`` did."""

    recipe: str
    side: str
    spec: str
    modules: list[QuantizedModuleInfo] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)  # matched by a pattern but kept unquantized
    n_quantized_params: int = 0
    n_total_params: int = 0

    def __str__(self) -> str:
        frac = self.n_quantized_params / max(1, self.n_total_params)
        lines = [
            f"quantize_model: recipe={self.recipe} side={self.side} spec={self.spec}: {len(self.modules)} modules, "
            f"{self.n_quantized_params:,} of {self.n_total_params:,} parameters ({frac:.1%})"
        ]
        lines += [f"  {m.name:<40} {m.kind:<8} {m.spec:<28} {m.n_params:>12,}" for m in self.modules]
        if self.protected:
            lines.append(f"  kept unquantized (router/embedding/lm_head): {', '.join(self.protected)}")
        return "\n".join(lines)


def _is_experts(m: nn.Module) -> bool:
    p = dict(m.named_parameters(recurse=False))
    return "gate_up_proj" in p and "down_proj" in p and p["gate_up_proj"].dim() == 3


def _protected(name: str, module: nn.Module, model: nn.Module) -> bool:
    if name.rsplit(".", 1)[-1] in PROTECTED_NAMES or isinstance(module, nn.Embedding):
        return True
    special = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            special.append(getattr(model, getter)())
        except (AttributeError, NotImplementedError):
            pass
    return any(module is s for s in special if s is not None)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def quantized_modules(model: nn.Module) -> dict[str, _QuantizedBase]:
    """``{name: module}`` of every quantized module in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, _QuantizedBase)}


def dequantize_model(model: nn.Module) -> int:
    """Put the original modules back (same parameters); returns how many were restored."""
    qm = quantized_modules(model)
    for name, m in qm.items():
        orig = m.original
        for pname in m.weight_names + (("bias",) if isinstance(m, QuantizedLinear) else ()):
            setattr(orig, pname, getattr(m, pname))  # keep any parameter replaced since the swap
        _set_submodule(model, name, orig)
    for attr in ("quads_recipe", "quads_side"):
        if hasattr(model, attr):
            delattr(model, attr)
    return len(qm)


def target_modules(
    model: nn.Module, targets, protected: list[str] | None = None
) -> list[tuple[str, nn.Module, str]]:
    """``[(name, module, kind)]`` that ``targets`` select (kind "experts" or "linear"), per the module doc.

    Names of pattern-matched modules kept unquantized are appended to ``protected`` when given.
    """
    plan: list[tuple[str, nn.Module, str]] = []
    done: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(d + ".") for d in done):
            continue
        if not any(fnmatch.fnmatchcase(name, pat) for pat in targets):
            continue
        if _protected(name, module, model):
            if protected is not None:
                protected.append(name)
            continue
        done.append(name)
        if _is_experts(module):
            plan.append((name, module, "experts"))
        elif isinstance(module, nn.Linear):
            plan.append((name, module, "linear"))
        else:
            inner: list[str] = []
            for sub, m in module.named_modules(prefix=name):
                if any(sub.startswith(d + ".") for d in inner) or _protected(sub, m, model):
                    continue
                if _is_experts(m):
                    plan.append((sub, m, "experts"))
                    inner.append(sub)
                elif isinstance(m, nn.Linear):
                    plan.append((sub, m, "linear"))
    return plan


def quantize_model(
    model: nn.Module, recipe: Recipe | str, side: str = "trainer", *, verbose: bool = True
) -> QuantSummary:
    """Swap the modules matched by ``recipe.targets`` for quantized ones computing ``recipe.<side>``.

    Weights are shared, not copied. On the rollout side the weights are quantized now (the initial
    sync). Raises ValueError when nothing matches (with examples of module names) or a matched layer
    cannot be quantized (e.g. in_features not a multiple of 16 for NVFP4). Prints the summary when
    ``verbose``.
    """
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    spec = recipe.spec(side)
    dequantize_model(model)
    summary = QuantSummary(recipe=recipe.name, side=side, spec=spec.describe())
    summary.n_total_params = sum(p.numel() for p in model.parameters())
    plan = target_modules(model, recipe.targets, protected=summary.protected)
    if not plan:
        names = [n for n, _ in model.named_modules() if n][:8]
        raise ValueError(
            f"recipe {recipe.name!r}: no module matched targets {list(recipe.targets)}; module names look like "
            f"{names}; pass targets=... (fnmatch patterns on these names)"
        )
    new_modules = []
    for name, module, kind in plan:  # build all first: a bad layer raises before the model changes
        cls = QuantizedExperts if kind == "experts" else QuantizedLinear
        new = cls(module, spec, side=side, weight_dtype=recipe.torch_weight_dtype)
        if kind == "experts":
            new.grouped = {"auto": None, "grouped": True, "loop": False}[recipe.expert_path]
        new_modules.append((name, new, kind))
    for name, new, kind in new_modules:
        _set_submodule(model, name, new)
        n = sum(p.numel() for p in new.parameters())
        summary.modules.append(QuantizedModuleInfo(name, kind, spec.describe(), n))
        summary.n_quantized_params += n
    if side == "trainer":
        link_stores(model)  # the QAT cache refreshes every stale weight at once (WeightStore.get)
    model.quads_recipe = recipe
    model.quads_side = side
    if verbose:
        print(summary)
    return summary


def refresh_quantized(model: nn.Module) -> int:
    """Re-quantize every quantized module's weights now (and refresh static RAC orders)."""
    qm = quantized_modules(model)
    for m in qm.values():
        m.refresh()
    return len(qm)


@torch.no_grad()
def calibrate_static_channels(model: nn.Module, run: Callable[[nn.Module], object]) -> int:
    """Calibrate the static RAC orders now: gather residual statistics over ``run(model)`` (e.g. a few
    forwards on recent prompts), then re-sort the orders. Weight sync does the same with the
    statistics gathered by the rollouts since the previous sync. Returns the number of groups updated.
    """
    qm = [m for m in quantized_modules(model).values() if len(m.selectors)]
    if not qm:
        raise ValueError("calibrate_static_channels: no quantized module uses static RAC selection")
    for m in qm:
        for sel in m.selectors.values():
            sel.observing = True
    run(model)
    return sum(m.refresh_static() for m in qm)
