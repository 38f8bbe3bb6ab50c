"""Registration of the ``"quads"`` quantization method with vLLM (no patching of vLLM's source).

``register()`` imports ``quads.rollout.vllm.quant_config``, whose ``QuadsQuantConfig`` is decorated with
``vllm.model_executor.layers.quantization.register_quantization_config("quads")``. It is idempotent
and is the target of the ``vllm.general_plugins`` entry point (``quads = "quads.rollout.vllm.plugin:register"``),
which vLLM calls in every process it starts (engine core, workers). ``VLLMRolloutEngine`` calls it
itself and runs the engine in-process, so the entry point is only needed when vLLM spawns workers.
"""

from __future__ import annotations


def register() -> None:
    """Make ``quantization="quads"`` known to vLLM in this process."""
    from quads.rollout.vllm import quant_config  # noqa: F401  (the import registers the config class)
