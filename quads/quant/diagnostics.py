"""Per-layer error between two specs on the same input (DESIGN.md section 5, "per layer").

``layer_errors(model, run, reference, candidate)`` runs ``run(model)`` once with forward hooks that
capture the inputs of every targeted layer (the quantized modules if the model is quantized, else
the modules ``targets`` select), then replays each captured input through the layer computed under
``reference`` and under ``candidate`` and returns ``{layer name: ||Y_c - Y_r|| / ||Y_r||}`` (Frobenius
norms summed over all calls of the layer in the pass). Both replays see exactly the same input, so
the error is the layer's own, not propagated from upstream layers. The model is not modified;
static RAC orders in the replays come from the weight-norm prior (no calibration data).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quads.quant.apply import quantized_modules, target_modules
from quads.quant.layers import QuantizedExperts, QuantizedLinear, _QuantizedBase
from quads.quant.recipe import DEFAULT_TARGETS, WEIGHT_DTYPES, LinearSpec, Recipe


def _replay_module(module: nn.Module, spec: LinearSpec, weight_dtype: torch.dtype) -> nn.Module:
    orig = module.original if isinstance(module, _QuantizedBase) else module
    cls = (
        QuantizedExperts
        if isinstance(module, QuantizedExperts) or hasattr(orig, "gate_up_proj")
        else QuantizedLinear
    )
    return cls(orig, spec, side="rollout", weight_dtype=weight_dtype)


@torch.no_grad()
def layer_errors(
    model: nn.Module,
    run: Callable[[nn.Module], object] | torch.Tensor,
    reference: LinearSpec,
    candidate: LinearSpec,
    *,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    weight_dtype: torch.dtype | str = torch.bfloat16,
) -> dict[str, float]:
    """Relative output error of each targeted layer, ``candidate`` vs ``reference`` (module docstring).

    ``run``: a callable doing one forward of ``model`` (e.g. ``lambda m: m(input_ids)``), or input ids.
    """
    wd = WEIGHT_DTYPES[weight_dtype] if isinstance(weight_dtype, str) else weight_dtype
    layers = quantized_modules(model) or {n: m for n, m, _ in target_modules(model, targets)}
    if not layers:
        raise ValueError(f"layer_errors: no quantized module and nothing matches targets {list(targets)}")
    captured: dict[str, list[tuple]] = {n: [] for n in layers}
    hooks = [
        m.register_forward_hook(
            lambda mod, args, out, n=n: captured[n].append(tuple(a.detach() for a in args))
        )
        for n, m in layers.items()
    ]
    try:
        run(model) if callable(run) else model(run)
    finally:
        for h in hooks:
            h.remove()
    errors: dict[str, float] = {}
    for name, module in layers.items():
        if not captured[name]:
            continue
        ref_mod = _replay_module(module, reference, wd)
        cand_mod = _replay_module(module, candidate, wd)
        num = den = 0.0
        for args in captured[name]:
            y_r = ref_mod(*args).double()
            y_c = cand_mod(*args).double()
            num += (y_c - y_r).square().sum().item()
            den += y_r.square().sum().item()
        errors[name] = (num / den) ** 0.5 if den > 0 else float("nan")
    return errors


def recipe_layer_errors(model: nn.Module, run, recipe: Recipe) -> dict[str, float]:
    """``layer_errors`` of the recipe's rollout layers against its trainer layers."""
    return layer_errors(
        model,
        run,
        recipe.trainer,
        recipe.rollout,
        targets=recipe.targets,
        weight_dtype=recipe.torch_weight_dtype,
    )
