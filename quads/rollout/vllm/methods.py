"""vLLM linear and fused-MoE methods that compute a recipe's rollout ``LinearSpec`` with quads' functions.

Weights (``quads.rollout.vllm.weights.RolloutWeight``, one per vLLM parameter: ``weight`` [N, K];
``w13_weight`` [E, 2I, H] = [gate; up], ``w2_weight`` [E, H, I]): with ``weight_storage="packed"``
(the default) a layer holds only the NVFP4 codes, E4M3 block scales and FP32 global scales of
``quads.quant.ops.quantize_weight`` (the function the trainer's QAT uses: cast to the recipe's
``weight_dtype``, then quantize), and dequantizes the operands it multiplies in the forward; with
``"master"`` (debugging) it keeps vLLM's master parameters in the model dtype beside the operands. vLLM's
parameters keep their names, shapes and (wrapped) weight loaders, so every loader of vLLM fills them;
each load re-quantizes the units it completes at once (``RolloutWeight.wrap_loader``).
``process_weights_after_loading`` (after the initial load, vLLM's layerwise reload, or an RL framework's
``load_weights``) refuses half-loaded units and refreshes static RAC channel orders, exactly as
``quads.quant.layers._QuantizedBase.refresh`` does on quads' own rollout side; a forward after a plain
``load_weights`` with no processing refreshes them itself first (``_current``).

The forward calls ``quads.quant.linear.spec_linear`` per GEMM (``w4a4_linear`` with RAC,
``fp8_linear``, ``qat_linear`` or ``F.linear``), so for the same input and weights the output is the
same bits as quads' ``QuantizedLinear`` / ``QuantizedExperts``:

- fused linears (``qkv_proj``, ``gate_up_proj`` of dense MLPs) run one GEMM per shard, each shard
  quantized as its own layer (its own NVFP4 global scale), as quads quantizes ``q_proj``, ``k_proj``,
  ``v_proj`` separately;
- the experts are ``QuantizedExperts``' function on ``quads.rollout.vllm.experts``' two paths: the loop
  (slots grouped by expert, per expert ``act(x @ Wg.T) * (x @ Wu.T) @ Wd.T`` with activation global scales
  over that expert's tokens of this forward, weighted by the routing weights and summed in ascending expert
  order), or, as the recipe's ``expert_path`` picks (auto: on CUDA), the sorted grouped GEMMs of quads'
  captured decode step (``quads.quant.layers.sorted_experts``: no host sync, the 4-bit weight read by quads'
  grouped kernels with packed storage; the same quantized operands, the GEMMs' accumulation order aside).

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
from quads.quant.rac import StaticChannelSelector
from quads.quant.recipe import LinearSpec
from quads.quant.sync import WeightSyncError
from quads.rollout.vllm.experts import (
    VllmExpertOperands,
    experts_forward,
    sorted_experts_forward,
    spec_gemm,
    use_sorted,
)
from quads.rollout.vllm.weights import RolloutWeight, Unit, check_complete, expert_units

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


def _refuse_if_unsynced(config) -> None:
    if config.sync_ok is False:
        raise WeightSyncError(
            f"vLLM worker: the last weight push failed the fingerprint check ({config.sync_detail}); "
            "refusing to roll out with these weights: push the trainer's weights again"
        )


def _wrap_loader(param: torch.nn.Parameter, rw: RolloutWeight, rows) -> None:
    """Replace ``param``'s weight loader with ``rw.wrap_loader`` of it."""
    param.weight_loader = rw.wrap_loader(param.weight_loader, rows)


class _QuadsMethod:
    """What the linear and experts methods share: the weights, their refresh and the checks of ``apply``."""

    config = None

    def weights(self, layer: torch.nn.Module) -> list[RolloutWeight]:
        return list(layer.quads_weights.values())

    def _new_param(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Packed storage: vLLM's parameter on the meta device (it holds data only while a load stages it)."""
        meta = self.config.weight_storage == "packed"
        return torch.empty(shape, dtype=dtype, device="meta" if meta else None)

    def set_spec(self, layer: torch.nn.Module) -> None:
        """Adopt the config's (new) recipe: re-derive the operands (master storage) and restart static RAC."""
        spec, dtype = self.config.recipe.rollout, self.config.recipe.torch_weight_dtype
        for rw in self.weights(layer):
            rw.spec, rw.weight_dtype = spec, dtype
            if rw.storage == "master":
                rw.quantize_all()
        layer.quads_selectors = {}
        self.refresh_static(layer)

    def refresh_static(self, layer: torch.nn.Module) -> None:
        """Re-sort static RAC orders (statistics since the last refresh, else the operands' column norms)."""
        spec = self.config.recipe.rollout
        layer.quads_selectors = self._selectors(layer, spec)
        for key, sel in layer.quads_selectors.items():
            sel.refresh(prior=self._prior(layer, key))
        layer.quads_versions = [rw.version for rw in self.weights(layer)]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """After vLLM loaded new weights (the units are already re-quantized by the loaders): refuse half-loaded
        units, free the staging copies, refresh static RAC orders."""
        check_complete(self.weights(layer), self.describe())
        for rw in self.weights(layer):
            rw.release_staging()
        self.refresh_static(layer)

    def _current(self, layer: torch.nn.Module) -> None:
        """Before computing: no half-loaded unit; static RAC orders refreshed after weights changed without a
        ``process_weights_after_loading`` (an RL framework's plain ``load_weights``)."""
        _refuse_if_unsynced(self.config)
        check_complete(self.weights(layer), self.describe())
        if getattr(layer, "quads_versions", None) != [rw.version for rw in self.weights(layer)]:
            for rw in self.weights(layer):
                rw.release_staging()
            self.refresh_static(layer)


class QuadsLinearMethod(_QuadsMethod, LinearMethodBase):
    """A vLLM linear (possibly fused from ``shard_names``) under the recipe's rollout spec."""

    def __init__(self, config, shard_names: list[str]) -> None:
        self.config = config
        self.shard_names = shard_names
        self.recorder: list | None = None

    def describe(self) -> str:
        return f"vLLM layer {self.shard_names}"

    def create_weights(
        self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs,
    ) -> None:
        if len(output_partition_sizes) != len(self.shard_names):
            raise ValueError(
                f"vLLM layer {self.shard_names} has {len(output_partition_sizes)} output partitions; "
                "the quads name mapping found a different shard count (packed_modules_mapping)"
            )
        spec = self.config.recipe.rollout
        if "nvfp4" in (spec.act, spec.weight):
            ops.check_k(input_size_per_partition, self.describe())
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=self._new_param((sum(output_partition_sizes), input_size_per_partition), params_dtype),
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
        units = [Unit(f"{n}.weight", None, a, b, ((a, b),)) for n, (a, b) in zip(self.shard_names, bounds)]
        rw = RolloutWeight(layer, "weight", units, spec, self.config.recipe.torch_weight_dtype,
                           self.config.weight_storage)
        layer.quads_weights = {"weight": rw}
        _wrap_loader(weight, rw, functools.partial(self._rows, layer))

    def _rows(self, layer: torch.nn.Module, loaded_shard_id=None, *args, **kwargs) -> tuple[None, int, int]:
        """Rows a linear loader call writes: all (``None``), or one shard (an index, or ``q`` / ``k`` / ``v``)."""
        sid = kwargs.get("loaded_shard_id", loaded_shard_id)
        bounds = layer.quads_bounds
        if sid is None:
            return None, 0, bounds[-1][1]
        idx = {"q": 0, "k": 1, "v": 2}.get(sid, sid) if isinstance(sid, str) else sid
        if not isinstance(idx, int) or not 0 <= idx < len(bounds):
            raise ValueError(f"{self.describe()}: vLLM loaded shard {sid!r}, which quads cannot place among "
                             f"{len(bounds)} shards")
        return None, *bounds[idx]

    def _selectors(self, layer: torch.nn.Module, spec: LinearSpec) -> dict:
        return _selectors(layer, spec, {n: (1, layer.weight.shape[-1]) for n in layer.quads_names})

    def _prior(self, layer: torch.nn.Module, name: str) -> torch.Tensor:
        return layer.quads_weights["weight"].operand(layer.quads_names.index(name)).float().square().sum(dim=-2)

    def operands(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``{quads weight name: rollout weight operand}`` (what the fingerprint check compares)."""
        rw = layer.quads_weights["weight"]
        return {f"{n}.weight": rw.operand(i) for i, n in enumerate(layer.quads_names)}

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self._current(layer)
        if self.recorder is not None:
            self.recorder.append((x.detach().clone(),))
        spec, rw = self.config.recipe.rollout, layer.quads_weights["weight"]
        outs = []
        for i, (lo, hi) in enumerate(layer.quads_bounds):
            name = layer.quads_names[i]
            b = None if bias is None else bias[lo:hi]
            sel = layer.quads_selectors.get(name)
            outs.append(spec_gemm(x, *rw.gemm_weights(i), spec, sel, 0, b))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _selectors(layer: torch.nn.Module, spec: LinearSpec, shapes: dict[str, tuple[int, int]]) -> dict:
    """``{name: StaticChannelSelector(groups, K)}`` kept on the layer across pushes (statistics survive)."""
    if not spec.static_rac:
        return {}
    old = getattr(layer, "quads_selectors", {}) or {}
    out = {}
    for name, (groups, k) in shapes.items():
        s = old.get(name)
        out[name] = s if s is not None and (s.groups, s.k) == (groups, k) else StaticChannelSelector(groups, k)
    return out


class QuadsFusedMoEMethod(_QuadsMethod, FusedMoEMethodBase):
    """vLLM routed experts computed by quads' experts loop under the recipe's rollout spec."""

    def __init__(self, moe, config, name: str) -> None:
        super().__init__(moe)
        self.config = config
        self.name = name  # quads name, e.g. model.layers.0.mlp.experts
        self.recorder: list | None = None

    def describe(self) -> str:
        return self.name

    def create_weights(
        self, layer: torch.nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
        params_dtype: torch.dtype, **extra_weight_attrs,
    ) -> None:
        if not self.moe.is_act_and_mul or self.moe.has_bias:
            raise ValueError(
                f"{self.name}: quads' experts need gated (act-and-mul) experts without biases, as "
                "QuantizedExperts; drop this module from the recipe's targets"
            )
        spec, dtype, storage = self.config.recipe.rollout, self.config.recipe.torch_weight_dtype, self.config.weight_storage
        if "nvfp4" in (spec.act, spec.weight):
            ops.check_k(hidden_size, f"{self.name}.gate_up_proj")
            ops.check_k(intermediate_size_per_partition, f"{self.name}.down_proj")
        inter, e_n = intermediate_size_per_partition, num_experts
        layer.quads_weights = {}
        for pname, qname, shape, parts in (
            ("w13_weight", "gate_up_proj", (e_n, 2 * inter, hidden_size), ((0, inter), (inter, 2 * inter))),
            ("w2_weight", "down_proj", (e_n, hidden_size, inter), ((0, hidden_size),)),
        ):
            p = torch.nn.Parameter(self._new_param(shape, params_dtype), requires_grad=False)
            layer.register_parameter(pname, p)
            set_weight_attrs(p, extra_weight_attrs)
            p.weight_loader_numel = p.numel()
            units = expert_units(self.name, qname, shape, parts)
            rw = RolloutWeight(layer, pname, units, spec, dtype, storage)
            layer.quads_weights[pname] = rw
            _wrap_loader(p, rw, functools.partial(self._rows, pname, inter, hidden_size))

    def _rows(self, pname: str, inter: int, hidden: int, *args, **kwargs) -> tuple[int, int, int]:
        """Rows a fused-MoE loader call ``(weight_name, shard_id, expert_id)`` writes: w1 = gate, w3 = up, w2."""
        names = ("weight_name", "shard_id", "expert_id")
        a = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        shard, expert = a.get("shard_id"), a.get("expert_id")
        rows = {("w13_weight", "w1"): (0, inter), ("w13_weight", "w3"): (inter, 2 * inter),
                ("w2_weight", "w2"): (0, hidden)}.get((pname, shard))
        if rows is None or not isinstance(expert, int):
            raise ValueError(f"{self.name}: vLLM loaded {a} into {pname}; quads places per-expert w1 / w3 / w2 "
                             "shards only (checkpoints with per-expert gate_proj / up_proj / down_proj)")
        return expert, *rows

    def _selectors(self, layer: torch.nn.Module, spec: LinearSpec) -> dict:
        e = layer.w13_weight.shape[0]
        return _selectors(layer, spec, {"w13": (e, layer.w13_weight.shape[-1]), "w2": (e, layer.w2_weight.shape[-1])})

    def _prior(self, layer: torch.nn.Module, key: str) -> torch.Tensor:
        rw = layer.quads_weights["w13_weight" if key == "w13" else "w2_weight"]
        return torch.stack([rw.operand(e).float().square().sum(dim=-2) for e in range(len(rw.units))])

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # no vLLM kernel: apply() computes the experts itself

    def operands(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``{quads weight name: rollout weight operand}`` (what the fingerprint check compares)."""
        return {f"{self.name}.gate_up_proj": layer.quads_weights["w13_weight"].full_operand(),
                f"{self.name}.down_proj": layer.quads_weights["w2_weight"].full_operand()}

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        shared_experts=None, shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._current(layer)
        act = getattr(layer, "activation", "silu")
        act_name = getattr(act, "value", act)
        act_name = str(act_name).lower()
        if act_name not in _ACTIVATIONS:
            raise ValueError(f"{self.name}: expert activation {act_name!r} is not supported; valid: {list(_ACTIVATIONS)}")
        if getattr(layer, "apply_router_weight_on_input", False) or getattr(layer, "expert_map", None) is not None:
            raise ValueError(f"{self.name}: router weights on input / expert parallelism are not supported by quads' experts")
        if self.recorder is not None:
            self.recorder.append((x.detach().clone(), topk_ids.detach().clone(), topk_weights.detach().clone()))
        w13, w2 = layer.quads_weights["w13_weight"], layer.quads_weights["w2_weight"]
        spec = self.config.recipe.rollout
        if use_sorted(self.config.recipe.expert_path, spec, x):
            operands = {"gate_up_proj": VllmExpertOperands(w13), "down_proj": VllmExpertOperands(w2)}
            return sorted_experts_forward(
                x, topk_ids, topk_weights, n_experts=len(w13.units), operands=operands, spec=spec,
                act_fn=_ACTIVATIONS[act_name], selectors=layer.quads_selectors,
            )
        return experts_forward(
            x, topk_ids, topk_weights, n_experts=len(w13.units), gate_up=w13.gemm_weights,
            down=w2.gemm_weights, spec=spec,
            act_fn=_ACTIVATIONS[act_name], selectors=layer.quads_selectors,
        )  # fmt: skip
