"""Trainer side inside verl: quads' W4A16 QAT on verl's FSDP2 actor (strategy ``quads_fsdp2``).

verl builds its training engine from ``EngineRegistry`` by ``actor.strategy``. The plugin registers
``QuadsFSDPEngine`` under the strategy ``quads_fsdp2``; it is verl's own FSDP engine
(``FSDPEngineWithLMHead``, run as ``fsdp2``) with two additions:

- after verl builds the Hugging Face model and before it wraps it with FSDP2 (where verl's own
  ``qat.enable`` would call ``apply_qat``), ``quantize_model(model, recipe, side="trainer")`` swaps
  the recipe's targets (default: the routed experts ``*.mlp.experts``). On a transformers 5 MoE
  model (Qwen3-MoE, OLMoE, Mixtral) the experts are one module holding the packed 3-D
  ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]; quads swaps it for ``QuantizedExperts``,
  whose forward computes ``x @ QDQ(W_e).T`` per expert with straight-through gradients. verl's
  ``apply_qat`` swaps ``nn.Linear`` modules only, so it leaves these weights in BF16.
  Only the training engine is quantized (``forward_only`` engines, e.g. the reference policy, are
  not, and may keep verl's plain ``FSDPEngineConfig``), as with verl's own QAT.
- after every optimizer step the cached ``QDQ(W)`` is dropped (``invalidate_qat_cache``: FSDP2
  all-gathers into the same unsharded parameter without bumping its version counter).

The parameters and their state-dict names do not change, so verl's weight stream to the rollout
(``get_per_tensor_param``: state dict, ``convert_weight_keys``, ``unfuse_moe_params``) carries the
BF16/FP32 master weights under the checkpoint's per-expert names; the rollout's ``quads`` vLLM
method quantizes them with the same function (``quads.quant.ops.quantize_weight``).

The recipe is a typed field of the engine config: ``QuadsFSDPEngineConfig`` (selected with
``actor_rollout_ref.actor.fsdp_config._target_``; docs/VERL.md has the whole config).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from verl.workers.config import FSDPEngineConfig
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from quads.quant.apply import QuantSummary, quantize_model
from quads.quant.recipe import Recipe, get_recipe
from quads.rl.distributed import invalidate_qat_cache

logger = logging.getLogger(__name__)

STRATEGY = "quads_fsdp2"  # actor.strategy that selects QuadsFSDPEngine
BASE_STRATEGY = "fsdp2"  # what verl's FSDP engine runs underneath
ENGINE_CONFIG_TARGET = "quads.integrations.verl.engine.QuadsFSDPEngineConfig"


@dataclass
class QuadsFSDPEngineConfig(FSDPEngineConfig):
    """verl's ``FSDPEngineConfig`` plus the quads recipe the trainer side computes.

    The rollout side must run the same recipe (``engine_kwargs.vllm.hf_overrides.quantization_config``,
    ``quads.integrations.verl.config.verl_overrides`` writes both from one recipe).
    """

    quads_recipe: str = "quads"  # preset name: bf16 | fp8 | nvfp4 | w4a16-qat | w4a4-qat | quads | w4a16
    # ``get_recipe(quads_recipe, **overrides)``: e.g. {targets: ["*.mlp.experts"], weight_tile: [16, 16]}
    quads_recipe_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.recipe()  # a bad name or override fails when verl builds the config, not on the GPUs

    def recipe(self) -> Recipe:
        """The resolved ``Recipe``."""
        return get_recipe(self.quads_recipe, **dict(self.quads_recipe_overrides or {}))


def apply_trainer_qat(module: torch.nn.Module, recipe: Recipe, *, verbose: bool = False) -> QuantSummary:
    """``quantize_model(module, recipe, side="trainer")`` on a model verl built (before FSDP wrapping).

    A recipe whose trainer side computes the plain GEMM (``bf16``, ``fp8``, ``nvfp4``: BF16 trainer)
    swaps nothing and returns an empty summary.
    """
    if recipe.trainer.is_identity:
        return QuantSummary(recipe=recipe.name, side="trainer", spec=recipe.trainer.describe())
    return quantize_model(module, recipe, side="trainer", verbose=verbose)


@EngineRegistry.register(model_type="language_model", backend=STRATEGY, device=["cuda", "npu"])
class QuadsFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP2 language-model engine with quads' trainer-side QAT (module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config, **kwargs) -> None:
        quads_config = isinstance(engine_config, QuadsFSDPEngineConfig)
        if not quads_config and not engine_config.forward_only:
            raise ValueError(
                f"actor strategy {STRATEGY!r} needs the quads engine config, got {type(engine_config).__name__}; "
                f"set actor_rollout_ref.actor.fsdp_config._target_={ENGINE_CONFIG_TARGET} (docs/VERL.md)"
            )
        # verl's FSDP engine branches on "fsdp" / "fsdp2"; the registry lookup is done by now
        object.__setattr__(engine_config, "strategy", BASE_STRATEGY)
        # forward-only engines (the reference policy: ref.strategy follows actor.strategy, its
        # fsdp_config stays verl's) compute the plain model
        self.quads_recipe = engine_config.recipe() if quads_config else None
        self.quads_summary: QuantSummary | None = None
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config, **kwargs)

    def _build_module(self):
        module = super()._build_module()
        if self.engine_config.forward_only or self.quads_recipe is None:
            return module
        if self._is_lora:
            raise ValueError(
                f"strategy {STRATEGY!r} with LoRA is not supported (LoRA wraps the linears quads would swap); "
                "set actor_rollout_ref.model.lora_rank=0"
            )
        verbose = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        self.quads_summary = apply_trainer_qat(module, self.quads_recipe, verbose=verbose)
        return module

    def optimizer_step(self):
        grad_norm = super().optimizer_step()
        invalidate_qat_cache(self.module)
        return grad_norm
