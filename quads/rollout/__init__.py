"""The rollout seam (``backend``: ``RolloutBackend``, ``make_backend``) and quads' own engine: batched
KV-cache sampling with log-probs and expert ids of the sampled tokens."""

from quads.rollout.backend import RolloutBackend, make_backend
from quads.rollout.engine import RolloutEngine, sample_tokens
from quads.rollout.types import RolloutBatch, RolloutStats, SamplingParams

__all__ = ["RolloutBackend", "RolloutBatch", "RolloutEngine", "RolloutStats", "SamplingParams", "make_backend",
           "sample_tokens"]
