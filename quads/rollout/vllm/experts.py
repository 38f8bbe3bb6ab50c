"""The routed experts of vLLM's quads method, over ``RolloutWeight`` expert stacks (no vLLM import here).

Two paths compute the same function (``QuantizedExperts``'), chosen per call by ``use_sorted`` from the recipe's
``expert_path`` (the typed field quads' own layers read, ``Recipe.expert_path``):

- ``experts_forward``, the loop (the reference, and the CPU's default): slots grouped by expert (stable sort),
  per expert ``act(x @ Wg.T) * (x @ Wu.T) @ Wd.T`` with ``spec_linear`` (activation global scales over that
  expert's tokens), weighted by the routing weights and summed in ascending expert order. Its launches grow with
  the experts hit: ~10 per expert and layer at decode. Where ``shares_operands`` (NVFP4 activations on the
  reference kernels, dynamic RAC or none) it builds the activation operands once per call for all experts
  (``quads.quant.layers.shared_operand_experts``, as quads' own layer does): the same bits, fewer quantize calls.
- ``sorted_experts`` (``quads.quant.layers``: quads' own captured decode step computes with it), over
  ``VllmExpertOperands``: the slots sorted by expert on the device, one grouped GEMM per projection, no host
  sync. With packed storage on a Triton device, W4A16 and W4A4(+RAC) read the stored 4-bit weight with quads'
  grouped kernel (``quads.kernels.w4a16``): ``RolloutWeight`` keeps expert stacks in that kernel's layout. Same
  quantized operands as the loop, bit for bit; the outputs differ from it only by the GEMMs' accumulation order,
  as in quads' own engine.
"""

from __future__ import annotations

import functools

import torch

from quads.kernels import dispatch, w4a16
from quads.quant import grouped
from quads.quant.layers import (
    expert_groups,
    reads_packed_weight,
    scatter_expert_output,
    shared_operand_experts,
    shares_operands,
    sorted_experts,
)
from quads.quant.linear import spec_linear
from quads.quant.rac import StaticChannelSelector, rac_channels
from quads.quant.recipe import LinearSpec
from quads.rollout.vllm.weights import RolloutWeight

PATHS = ("loop", "sorted")


def spec_gemm(
    x: torch.Tensor, w: torch.Tensor, w_q: torch.Tensor, spec: LinearSpec, sel: StaticChannelSelector | None,
    group: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GEMM under ``spec`` (``QuantizedBase._gemm``): static RAC channels / observation from ``sel``."""
    static = observe = None
    if sel is not None:
        static = sel.channels(group, rac_channels(w.shape[-1], spec.rac_ratio))
        observe = functools.partial(sel.observe, group)
    return spec_linear(x, w, spec, w_q=w_q, bias=bias, static_channels=static, observe=observe)


def experts_forward(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, n_experts: int,
    gate_up, down, spec: LinearSpec, act_fn, selectors: dict,
) -> torch.Tensor:
    """The loop: ``x`` [T, H], ``top_k_index`` / ``top_k_weights`` [T, k] -> [T, H] (``QuantizedExperts.forward``).

    ``gate_up(e)`` / ``down(e)``: expert ``e``'s ``(master, operand)``, fetched only for the experts hit;
    ``selectors``: ``{"w13": ..., "w2": ...}`` static RAC selectors (empty without static RAC).
    """
    if shares_operands(spec, x):  # the same bits, the operands once per call (quads' layer too; no static RAC)
        return shared_operand_experts(x, top_k_index, top_k_weights, n_experts=n_experts, spec=spec, act_fn=act_fn,
                                      gate_up=lambda e: gate_up(e)[1], down=lambda e: down(e)[1])
    out = torch.zeros_like(x)
    sel13, sel2 = selectors.get("w13"), selectors.get("w2")
    for e, idx, w_route in expert_groups(top_k_index, top_k_weights, n_experts):
        gate, up = spec_gemm(x[idx], *gate_up(e), spec, sel13, e).chunk(2, dim=-1)
        y = spec_gemm(act_fn(gate) * up, *down(e), spec, sel2, e)
        scatter_expert_output(out, idx, y, w_route)
    return out


class VllmExpertOperands:
    """A ``RolloutWeight`` expert stack ``[E, N, K]`` as ``sorted_experts`` reads it (``layers.ExpertOperands``).

    ``get_packed()``: the stored weight itself, when it is kept in the grouped kernels' layout
    (``RolloutWeight.layout == "w4a16"``: packed storage of canonical NVFP4); loads update it in place. ``get()``:
    the whole stack's operand, with master storage the tensor kept beside the master, with packed storage decoded
    at each call (transient, as the loop decodes the experts it hits).
    """

    def __init__(self, rw: RolloutWeight) -> None:
        if rw.units[0].expert is None:
            raise ValueError(f"{rw.units[0].name}: VllmExpertOperands takes an expert stack, not a linear")
        self.rw = rw

    @property
    def param(self) -> torch.Tensor:
        """The master stack (master storage); packed storage keeps none, and its operand stands in, as in
        ``RolloutWeight.gemm_weights`` (read only by unquantized or amplified specs, which packed storage refuses)."""
        return self.rw.param.detach() if self.rw.storage == "master" else self.get()

    def packed_gemm(self) -> bool:
        """Whether GEMMs may read the stored 4-bit weight: kept in the kernels' layout, under a spec and weight dtype
        ``layers.reads_packed_weight`` allows."""
        return self.rw.layout == "w4a16" and reads_packed_weight(self.rw.spec, self.rw.weight_dtype)

    def use_packed(self, x: torch.Tensor) -> bool:
        return self.packed_gemm() and w4a16.supports(x) and dispatch.use_triton(x)

    def get_packed(self) -> w4a16.W4A16Weight:
        return self.rw.kernel()

    def use_fp8(self, x: torch.Tensor) -> bool:
        """Never: vLLM's quads method keeps no FP8 codes (``fp8_scaled`` is quads' own engine's)."""
        return False

    def get_fp8(self):
        raise ValueError(f"{self.rw.units[0].name}: vLLM's quads method keeps no FP8 codes and scales")

    def get(self) -> torch.Tensor:
        return self.rw.full_operand()

    def get_f32(self) -> torch.Tensor:
        return self.get().float()

    def get_amplified(self) -> torch.Tensor:
        raise ValueError(f"{self.rw.units[0].name}: the mismatch amplifier (error_scale != 1) has no grouped path "
                         "in vLLM's quads method; set the recipe's expert_path to 'loop'")


def use_sorted(expert_path: str, spec: LinearSpec, x: torch.Tensor) -> bool:
    """Whether a call takes ``sorted_experts``: ``expert_path`` "grouped" (any device) or "auto" (CUDA tensors:
    launches dominate there; on the CPU the sorted path decodes the whole stack per call and is slower beyond the
    smallest shapes, docs/PERF.md), for the specs it implements (``grouped.supports``) without the mismatch
    amplifier, on a non-empty batch; "loop" never."""
    on = {"auto": x.is_cuda, "grouped": True, "loop": False}[expert_path]
    return on and x.shape[0] > 0 and grouped.supports(spec) and not spec.amplified


def sorted_experts_forward(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, n_experts: int,
    operands: dict[str, VllmExpertOperands], spec: LinearSpec, act_fn, selectors: dict,
) -> torch.Tensor:
    """``sorted_experts`` over vLLM's weights: ``operands`` ``{"gate_up_proj": ..., "down_proj": ...}``,
    ``selectors`` keyed as ``experts_forward``'s."""
    sels = {name: selectors[key] for name, key in (("gate_up_proj", "w13"), ("down_proj", "w2")) if key in selectors}
    return sorted_experts(x, top_k_index.long(), top_k_weights, spec=spec, stores=operands, selectors=sels,
                          act_fn=act_fn, num_experts=n_experts)
