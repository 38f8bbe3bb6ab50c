"""vLLM linear and fused-MoE methods that compute a recipe's rollout ``LinearSpec`` with quads' functions.

Both keep vLLM's own master-weight parameters (``weight`` [N, K]; ``w13_weight`` [E, 2I, H] =
[gate; up], ``w2_weight`` [E, H, I]) in the model dtype, so vLLM's loaders and in-place
``reload_weights`` fill them as for an unquantized model. ``process_weights_after_loading`` (run
after the initial load and after every weight push) derives the rollout operand with
``quads.quant.ops.quantize_weight`` (the function the trainer's QAT uses: cast to the recipe's
``weight_dtype``, then QDQ) and refreshes static RAC channel orders, exactly as
``quads.quant.layers._QuantizedBase.refresh`` does on quads' own rollout side.

The forward calls ``quads.quant.linear.spec_linear`` per GEMM (``w4a4_linear`` with RAC,
``fp8_linear``, ``qat_linear`` or ``F.linear``), so for the same input and weights the output is the
same bits as quads' ``QuantizedLinear`` / ``QuantizedExperts``:

- fused linears (``qkv_proj``, ``gate_up_proj`` of dense MLPs) run one GEMM per shard, each shard
  quantized as its own layer (its own NVFP4 global scale), as quads quantizes ``q_proj``, ``k_proj``,
  ``v_proj`` separately;
- the experts loop is ``QuantizedExperts.forward``: slots grouped by expert (stable sort), per
  expert ``act(x @ Wg.T) * (x @ Wu.T) @ Wd.T`` (activation global scales over that expert's tokens
  of this forward), weighted by the routing weights and summed in ascending expert order.

The router (top-k selection, weights) is vLLM's: it is part of the engine, not of the recipe.

``recorder`` (None, or a list set by ``worker.record_inputs``): each ``apply`` appends the inputs it
computed on (``(x,)`` for a linear, ``(x, topk_ids, topk_weights)`` for experts), so a test can run
quads' own layers on exactly the activations vLLM quantized (``compare.replay_layer_inputs``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from quads.quant import ops
from quads.quant.layers import expert_groups, scatter_expert_output
from quads.quant.linear import spec_linear
from quads.quant.rac import StaticChannelSelector, rac_channels
from quads.quant.recipe import LinearSpec
from quads.quant.sync import WeightSyncError

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


def _refuse_if_unsynced(config) -> None:
    if config.sync_ok is False:
        raise WeightSyncError(
            f"vLLM worker: the last weight push failed the fingerprint check ({config.sync_detail}); "
            "refusing to roll out with these weights: push the trainer's weights again"
        )


def _static(spec: LinearSpec) -> bool:
    return spec.act == "nvfp4" and spec.rac_ratio > 0 and spec.rac_selection == "static"


def _gemm(
    x: torch.Tensor, w: torch.Tensor, w_q: torch.Tensor, spec: LinearSpec, sel: StaticChannelSelector | None,
    group: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GEMM under ``spec`` (``QuantizedBase._gemm``): static RAC channels / observation from ``sel``."""
    static = observe = None
    if sel is not None:
        static = sel.channels(group, rac_channels(w.shape[-1], spec.rac_ratio))
        observe = functools.partial(sel.observe, group)
    return spec_linear(x, w, spec, w_q=w_q, bias=bias, static_channels=static, observe=observe)


def _selectors(layer: torch.nn.Module, spec: LinearSpec, shapes: dict[str, tuple[int, int]]) -> dict:
    """``{name: StaticChannelSelector(groups, K)}`` kept on the layer across pushes (statistics survive)."""
    if not _static(spec):
        return {}
    old = getattr(layer, "quads_selectors", {}) or {}
    out = {}
    for name, (groups, k) in shapes.items():
        s = old.get(name)
        out[name] = s if s is not None and (s.groups, s.k) == (groups, k) else StaticChannelSelector(groups, k)
    return out


def experts_forward(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, w13: torch.Tensor,
    w2: torch.Tensor, w13_q: torch.Tensor, w2_q: torch.Tensor, spec: LinearSpec, act_fn, selectors: dict,
) -> torch.Tensor:
    """``x`` [T, H], ``top_k_index`` / ``top_k_weights`` [T, k] -> [T, H] (``QuantizedExperts.forward``)."""
    out = torch.zeros_like(x)
    sel13, sel2 = selectors.get("w13"), selectors.get("w2")
    for e, idx, w_route in expert_groups(top_k_index, top_k_weights, w13.shape[0]):
        gate, up = _gemm(x[idx], w13[e], w13_q[e], spec, sel13, e).chunk(2, dim=-1)
        y = _gemm(act_fn(gate) * up, w2[e], w2_q[e], spec, sel2, e)
        scatter_expert_output(out, idx, y, w_route)
    return out


class QuadsLinearMethod(LinearMethodBase):
    """A vLLM linear (possibly fused from ``shard_names``) under the recipe's rollout spec."""

    def __init__(self, config, shard_names: list[str]) -> None:
        self.config = config
        self.shard_names = shard_names
        self.recorder: list | None = None

    def create_weights(
        self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs,
    ) -> None:
        if len(output_partition_sizes) != len(self.shard_names):
            raise ValueError(
                f"vLLM layer {self.shard_names} has {len(output_partition_sizes)} output partitions; "
                "the quads name mapping found a different shard count (packed_modules_mapping)"
            )
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=weight_loader,
        )  # fmt: skip
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        bounds, lo = [], 0
        for n in output_partition_sizes:
            bounds.append((lo, lo + n))
            lo += n
        layer.quads_bounds = bounds
        layer.quads_names = list(self.shard_names)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Re-quantize every shard now (initial load and every weight push)."""
        spec, dtype = self.config.recipe.rollout, self.config.recipe.torch_weight_dtype
        w = layer.weight.detach()
        k = w.shape[-1]
        if "nvfp4" in (spec.act, spec.weight):
            ops.check_k(k, f"vLLM layer {layer.quads_names}")
        layer.quads_w_q = [ops.quantize_weight(w[lo:hi], spec, dtype)[0] for lo, hi in layer.quads_bounds]
        layer.quads_selectors = _selectors(layer, spec, {n: (1, k) for n in layer.quads_names})
        for name, sel in layer.quads_selectors.items():
            wq = layer.quads_w_q[layer.quads_names.index(name)]
            sel.refresh(prior=wq.float().square().sum(dim=-2))

    def operands(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``{quads weight name: rollout weight operand}`` (what the fingerprint check compares)."""
        return {f"{n}.weight": wq for n, wq in zip(layer.quads_names, layer.quads_w_q)}

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        _refuse_if_unsynced(self.config)
        if self.recorder is not None:
            self.recorder.append((x.detach().clone(),))
        spec = self.config.recipe.rollout
        outs = []
        for i, (lo, hi) in enumerate(layer.quads_bounds):
            name = layer.quads_names[i]
            b = None if bias is None else bias[lo:hi]
            sel = layer.quads_selectors.get(name)
            outs.append(_gemm(x, layer.weight[lo:hi], layer.quads_w_q[i], spec, sel, 0, b))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class QuadsFusedMoEMethod(FusedMoEMethodBase):
    """vLLM routed experts computed by quads' experts loop under the recipe's rollout spec."""

    def __init__(self, moe, config, name: str) -> None:
        super().__init__(moe)
        self.config = config
        self.name = name  # quads name, e.g. model.layers.0.mlp.experts
        self.recorder: list | None = None

    def create_weights(
        self, layer: torch.nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
        params_dtype: torch.dtype, **extra_weight_attrs,
    ) -> None:
        if not self.moe.is_act_and_mul or self.moe.has_bias:
            raise ValueError(
                f"{self.name}: quads' experts need gated (act-and-mul) experts without biases, as "
                "QuantizedExperts; drop this module from the recipe's targets"
            )
        i2 = 2 * intermediate_size_per_partition
        w13 = torch.nn.Parameter(torch.empty(num_experts, i2, hidden_size, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        set_weight_attrs(w13, extra_weight_attrs)
        w13.weight_loader_numel = w13.numel()
        w2 = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        layer.register_parameter("w2_weight", w2)
        set_weight_attrs(w2, extra_weight_attrs)
        w2.weight_loader_numel = w2.numel()

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # no vLLM kernel: apply() computes the experts itself

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Re-quantize ``w13`` / ``w2`` (one NVFP4 global scale per expert) and refresh static RAC orders."""
        spec, dtype = self.config.recipe.rollout, self.config.recipe.torch_weight_dtype
        w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
        if "nvfp4" in (spec.act, spec.weight):
            ops.check_k(w13.shape[-1], f"{self.name}.gate_up_proj")
            ops.check_k(w2.shape[-1], f"{self.name}.down_proj")
        layer.quads_w13_q = ops.quantize_weight(w13, spec, dtype)[0]
        layer.quads_w2_q = ops.quantize_weight(w2, spec, dtype)[0]
        e = w13.shape[0]
        layer.quads_selectors = _selectors(layer, spec, {"w13": (e, w13.shape[-1]), "w2": (e, w2.shape[-1])})
        for name, sel in layer.quads_selectors.items():
            wq = layer.quads_w13_q if name == "w13" else layer.quads_w2_q
            sel.refresh(prior=wq.float().square().sum(dim=-2))

    def operands(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``{quads weight name: rollout weight operand}`` (what the fingerprint check compares)."""
        return {f"{self.name}.gate_up_proj": layer.quads_w13_q, f"{self.name}.down_proj": layer.quads_w2_q}

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        shared_experts=None, shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _refuse_if_unsynced(self.config)
        act = getattr(layer, "activation", "silu")
        act_name = getattr(act, "value", act)
        act_name = str(act_name).lower()
        if act_name not in _ACTIVATIONS:
            raise ValueError(f"{self.name}: expert activation {act_name!r} is not supported; valid: {list(_ACTIVATIONS)}")
        if getattr(layer, "apply_router_weight_on_input", False) or getattr(layer, "expert_map", None) is not None:
            raise ValueError(f"{self.name}: router weights on input / expert parallelism are not supported by quads' experts")
        if self.recorder is not None:
            self.recorder.append((x.detach().clone(), topk_ids.detach().clone(), topk_weights.detach().clone()))
        return experts_forward(
            x, topk_ids, topk_weights, w13=layer.w13_weight, w2=layer.w2_weight, w13_q=layer.quads_w13_q,
            w2_q=layer.quads_w2_q, spec=self.config.recipe.rollout, act_fn=_ACTIVATIONS[act_name],
            selectors=layer.quads_selectors,
        )  # fmt: skip
