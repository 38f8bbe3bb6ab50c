"""The rollout engine: batched KV-cache sampling with log-probs and expert ids of the sampled tokens."""

from quads.rollout.engine import RolloutBatch, RolloutEngine, RolloutStats, SamplingParams, sample_tokens

__all__ = ["RolloutBatch", "RolloutEngine", "RolloutStats", "SamplingParams", "sample_tokens"]
