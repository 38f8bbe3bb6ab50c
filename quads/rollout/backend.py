"""The rollout seam: what a trainer asks of a rollout backend, and the factory that picks one.

A ``RolloutBackend`` samples (``generate``), scores given token sequences on its own path
(``score``: teacher-forced log-probs, the rollout side of the engine-drift floor, DESIGN.md section 2)
and takes the trainer's weights (``load_weights``: ``quads.quant.sync.WeightSync`` into the backend's
target, with the fingerprint check, DESIGN.md section 4). Two backends implement it:

- ``"quads"``: ``quads.rollout.engine.RolloutEngine`` on a quads rollout model in this process;
- ``"vllm"``: ``quads.rollout.vllm.engine.VLLMRolloutEngine``, an in-process vLLM engine with quads'
  recipes (optional dependency; imported only when chosen).

``make_backend(cfg, ...)`` builds the one ``cfg.rollout_backend`` names. The trainer (``quads.rl``)
imports this module and the batch types, never a backend module (``tests/test_import_graph.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from quads.model.tokenizer import Tokenizer
from quads.quant.recipe import Recipe
from quads.quant.sync import SyncReport, WeightSource
from quads.rollout.types import RolloutBatch, SamplingParams

BACKENDS = ("quads", "vllm")
MULTI_PROCESS = {"quads": True, "vllm": False}  # one backend per rank under torchrun


def check_backend(name: str, world: int = 1) -> None:
    """Refuse a backend name that does not exist, or one that cannot run in each of ``world`` processes."""
    if name not in BACKENDS:
        raise ValueError(f"rollout_backend must be one of {list(BACKENDS)}, got {name!r}")
    if world > 1 and not MULTI_PROCESS[name]:
        raise ValueError(f"rollout_backend={name!r} runs in one process only; use the quads rollout engine under "
                         "torchrun (--rollout-backend quads)")


@runtime_checkable
class RolloutBackend(Protocol):
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None
                 ) -> RolloutBatch:
        """``params.n`` samples per prompt with their log-probs (and expert ids where the backend has them)."""
        ...

    def score(self, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
        """[B, R] log-probs of ``batch``'s response tokens, teacher-forced on this backend's path (0 off the
        response mask)."""
        ...

    def load_weights(self, source: WeightSource) -> SyncReport:
        """Take the trainer's weights from ``source``, re-quantize, verify bit-exactness (raises
        ``WeightSyncError`` on a mismatch)."""
        ...


def policy_engine(model: nn.Module, tokenizer: Tokenizer, device: str) -> RolloutBackend:
    """quads' engine generating from ``model`` as it is (a trainer's policy: its own layers and forward, no
    rollout quantization), without CUDA graphs or compile (its expert layers need not be capturable): the
    trainer's ``eval_trainer`` scores the held-out prompts with it."""
    from quads.rollout.engine import RolloutEngine

    return RolloutEngine(model, tokenizer, device=device, cuda_graphs=False, compile=False)


def make_backend(cfg, rollout_model: nn.Module, tokenizer: Tokenizer, recipe: Recipe, run_dir: str | Path
                 ) -> RolloutBackend:
    """The rollout backend ``cfg.rollout_backend`` names (``cfg``: a ``TrainConfig``).

    ``rollout_model``: a full (never sharded) quads rollout model: the quads engine generates from it;
    the vLLM engine takes its architecture from it (the weights come with the first ``load_weights``).
    A rollout recipe with ``error_scale != 1`` (the mismatch amplifier, ``quads.quant.amplify``) needs the
    quads engine (its captured decode step runs the amplified operands batched over experts).
    """
    name = cfg.rollout_backend
    check_backend(name)
    if name == "quads":
        from quads.rollout.engine import RolloutEngine

        return RolloutEngine(rollout_model, tokenizer, device=cfg.device, recipe=recipe.name,
                             cuda_graphs=cfg.rollout.cuda_graphs, compile=cfg.rollout.compile,
                             compile_prefill=cfg.rollout.compile_prefill, share_prefill=cfg.rollout.share_prefill,
                             fuse_qkv=cfg.rollout.fuse_qkv,
                             decode_attention=cfg.rollout.decode_attention)
    if cfg.rollout.decode_attention == "triton":
        raise ValueError(f"rollout.decode_attention=triton is the quads engine's; the {name} backend attends its "
                         "own way: use rollout.decode_attention auto or sdpa with it")
    if recipe.rollout.error_scale != 1.0:
        raise ValueError(f"recipe.rollout_error_scale={recipe.rollout.error_scale:g} (the mismatch amplifier) needs "
                         "the quads rollout backend; use --rollout-backend quads or rollout_error_scale 1")
    from quads.rollout.vllm.engine import make_rollout_engine

    return make_rollout_engine(cfg, rollout_model, tokenizer, recipe, run_dir)
