"""quads' ``mismatch/*`` metrics in verl's step metrics, beside verl's ``rollout_corr/*``.

verl's PPO trainer (``RayPPOTrainer.fit``, decoupled mode: the actor recomputes ``old_log_probs``)
calls ``verl.utils.debug.metrics.calculate_debug_metrics(batch)`` whenever the batch carries the
rollout's log-probs (``actor_rollout_ref.rollout.calculate_log_probs=true``) and merges its dict
into the step's metrics; a few lines later ``compute_rollout_correction_and_add_to_batch`` adds
``rollout_corr/*`` from the same ``old_log_probs``, ``rollout_log_probs`` and ``response_mask``.
verl has no metric hook, so ``install()`` wraps ``calculate_debug_metrics`` (looked up by verl at
call time) to also return ``batch_metrics(batch)``: quads' ``mismatch/*`` keys
(``quads.metrics.mismatch``: gap max / mean / probe max, k1, k3, chi2, ppl ratio in quads'
direction rollout/train, rho bands). verl's own keys are returned unchanged, and quads'
``rollout_corr/*`` aliases are *not* added: verl computes those itself, one writer per key.

In bypass mode (``algorithm.rollout_correction.bypass_mode=true``) verl sets ``old_log_probs`` to
the rollout's log-probs and skips ``calculate_debug_metrics``: there is no trainer forward to compare.
"""

from __future__ import annotations

import functools

from quads.metrics.mismatch import mismatch_metrics

PREFIX = "mismatch/"


def batch_metrics(batch) -> dict[str, float]:
    """quads' ``mismatch/*`` metrics of a verl ``DataProto`` (``old_log_probs`` = trainer,
    ``rollout_log_probs`` = rollout, ``response_mask``; all [B, R]); {} when a tensor is missing."""
    t = batch.batch
    keys = ("old_log_probs", "rollout_log_probs", "response_mask")
    if any(k not in t.keys() for k in keys):
        return {}
    out = mismatch_metrics(t["old_log_probs"], t["rollout_log_probs"], t["response_mask"])
    return {k: v for k, v in out.items() if k.startswith(PREFIX)}


def _with_quads(fn):
    @functools.wraps(fn)
    def calculate_debug_metrics(data):
        return {**fn(data), **batch_metrics(data)}

    calculate_debug_metrics.quads_wrapped = fn
    return calculate_debug_metrics


def install() -> bool:
    """Wrap ``verl.utils.debug.metrics.calculate_debug_metrics`` once; returns False if already done."""
    from verl.utils.debug import metrics as verl_debug

    if hasattr(verl_debug.calculate_debug_metrics, "quads_wrapped"):
        return False
    verl_debug.calculate_debug_metrics = _with_quads(verl_debug.calculate_debug_metrics)
    return True
