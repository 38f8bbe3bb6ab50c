"""Functions that run inside the vLLM worker (``LLM.collective_rpc(fn, args=...)``: ``fn(worker, *args)``).

They only touch layers whose quant method is one of quads' (``methods``) and the shared
``QuadsQuantConfig``. Arguments and results are plain Python / CPU tensors, so the same functions
work with an in-process engine and with spawned workers (cloudpickle).
"""

from __future__ import annotations

import torch

from quads.quant.recipe import Recipe
from quads.quant.sync import Fingerprint, fingerprint, mismatching
from quads.rollout.vllm.methods import QuadsFusedMoEMethod, QuadsLinearMethod

_QUADS_METHODS = (QuadsLinearMethod, QuadsFusedMoEMethod)


def get_model(worker) -> torch.nn.Module:
    """The worker's ``nn.Module`` (``worker`` may be vLLM's ``WorkerWrapperBase``)."""
    w = getattr(worker, "worker", worker)
    return w.model_runner.get_model()


def quads_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """``[(layer, method)]`` of every layer computed by a quads method, in module order."""
    return [(m, m.quant_method) for m in model.modules() if isinstance(getattr(m, "quant_method", None), _QUADS_METHODS)]


def _config(model: torch.nn.Module):
    layers = quads_layers(model)
    return layers[0][1].config if layers else None


def requantize(worker) -> int:
    """Re-derive every quads layer's rollout operands from its master weights; returns the layer count."""
    layers = quads_layers(get_model(worker))
    for layer, method in layers:
        method.process_weights_after_loading(layer)
    return len(layers)


def operands(worker) -> dict[str, torch.Tensor]:
    """``{quads weight name: rollout operand}`` (views into the worker; use in-process only)."""
    out: dict[str, torch.Tensor] = {}
    for layer, method in quads_layers(get_model(worker)):
        out.update(method.operands(layer))
    return out


def fingerprints(worker) -> dict[str, Fingerprint]:
    """``{quads weight name: Fingerprint}`` of every rollout weight operand."""
    return {name: fingerprint(t) for name, t in operands(worker).items()}


def weight_dtype_of_masters(worker) -> dict[str, str]:
    """``{quads weight name: dtype of vLLM's master parameter}`` (what an unquantized operand is held in)."""
    out = {}
    for layer, method in quads_layers(get_model(worker)):
        dt = str(next(iter(layer.parameters())).dtype)
        out.update({name: dt for name in method.operands(layer)})
    return out


def verify(worker, expected: dict[str, Fingerprint]) -> list[str]:
    """Compare the worker's fingerprints with the trainer's; record the result; return mismatching names.

    A name present on one side only counts as a mismatch. The result is stored in the shared
    ``QuadsQuantConfig.sync_ok``: while it is False, every quads layer refuses to run.
    """
    got = fingerprints(worker)
    bad = mismatching(got, expected)
    cfg = _config(get_model(worker))
    if cfg is not None:
        cfg.sync_ok = not bad
        cfg.sync_detail = "" if not bad else f"{len(bad)} of {len(got)} weights differ, first {bad[:3]}"
    return bad


def sync_state(worker) -> tuple[bool | None, str]:
    """``(sync_ok, detail)``: None before any verified push (or after a recipe switch)."""
    cfg = _config(get_model(worker))
    return (None, "no quads layers") if cfg is None else (cfg.sync_ok, cfg.sync_detail)


def set_recipe(worker, recipe: dict) -> int:
    """Switch the rollout recipe of this engine (same targets only) and re-quantize; returns layer count."""
    new = Recipe.from_dict(recipe)
    cfg = _config(get_model(worker))
    if cfg is None:
        raise ValueError("this vLLM engine has no quads layers (it was started without quantization='quads')")
    if tuple(new.targets) != tuple(cfg.recipe.targets):
        raise ValueError(
            f"set_recipe: targets {list(new.targets)} differ from the engine's {list(cfg.recipe.targets)}; "
            "the layers quads computes are fixed when vLLM builds the model: start a new engine"
        )
    cfg.recipe = new
    cfg.sync_ok, cfg.sync_detail = None, ""
    for layer, _ in quads_layers(get_model(worker)):
        layer.quads_selectors = {}  # static RAC statistics belong to the previous recipe
    return requantize(worker)


def reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-named tensors in place (vLLM's RL reload: every layer re-processed, quads' too)."""
    w = getattr(worker, "worker", worker)
    w.reload_weights(weights_iterator=iter(weights))


def run_experts(worker, name: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> dict:
    """Run one quads experts layer on a given input; returns its output and master weights (tests)."""
    for layer, method in quads_layers(get_model(worker)):
        if isinstance(method, QuadsFusedMoEMethod) and method.name == name:
            y = method.apply(layer, x, topk_weights, topk_ids)
            return {"y": y.clone(), "w13": layer.w13_weight.detach().clone(), "w2": layer.w2_weight.detach().clone()}
    raise ValueError(f"no quads experts layer named {name!r}")


def record_inputs(worker, on: bool) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    """Start (``on``) or stop recording what every quads layer computes on; returns what was recorded.

    ``{quads name: [inputs of each call, in call order]}``; a fused linear (``qkv_proj``) is recorded under
    each shard's name (its shards share the input). Inputs are ``(x,)`` for a linear, ``(x, topk_ids,
    topk_weights)`` for experts (``methods``: ``recorder``).
    """
    out: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    for _, method in quads_layers(get_model(worker)):
        names = method.shard_names if isinstance(method, QuadsLinearMethod) else [method.name]
        for n in names:
            out[n] = method.recorder or []
        method.recorder = [] if on else None
    return out
