"""The rollout seam (``backend``: ``RolloutBackend``, ``make_backend``) and quads' own engine: batched
KV-cache sampling with log-probs and expert ids of the sampled tokens.

Importing the package loads the seam and the batch types only; ``RolloutEngine`` / ``sample_tokens``
load quads' engine (a backend) on first use, so the trainer, which imports this package, never loads a
backend module it did not choose (``tests/test_import_graph.py``)."""

from quads.rollout.backend import RolloutBackend, make_backend, policy_engine
from quads.rollout.types import RolloutBatch, RolloutStats, SamplingParams

_ENGINE = ("RolloutEngine", "sample_tokens")  # quads' engine, loaded on first use


def __getattr__(name: str):
    if name in _ENGINE:
        from quads.rollout import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'quads.rollout' has no attribute {name!r}")


__all__ = ["RolloutBackend", "RolloutBatch", "RolloutEngine", "RolloutStats", "SamplingParams", "make_backend",
           "policy_engine", "sample_tokens"]
