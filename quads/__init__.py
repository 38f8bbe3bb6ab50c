"""quads: NVFP4 rollouts that are safe for GRPO of Mixture-of-Experts models.

Trainer side: asymmetric W4A16 QAT (the forward sees QDQ(W), straight-through gradients into BF16
master weights). Rollout side: NVFP4 W4A4 GEMMs with Residual Activation Compensation (RAC).
See ``docs/METHOD.md`` and ``../shared/DESIGN.md``.
"""

__version__ = "0.1.0"
