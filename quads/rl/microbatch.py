"""Gradient accumulation: every trainer forward on at most ``optim.micro_batch_size`` sequences.

Each mini-batch (one optimizer step) runs as micro-batches of contiguous rows: one forward + backward
each, autograd summing the gradients into ``.grad``, then one grad-norm clip and one AdamW step, as
without micro-batches. Every micro-batch's loss is divided by the *mini-batch's* denominator
(``loss_denom``: its response tokens for ``grpo.agg=token_mean``, its sequences for ``seq_mean``), so the
micro-batch losses and gradients add up to the mini-batch's: the optimizer step is the one without
micro-batches up to the floating-point summation order. The step's no-grad forwards (old log-probs,
reference) run on the same row chunks (``forward_chunks``), so no trainer forward holds more rows.

Split: ``n`` rows at ``size`` give ``ceil(n / size)`` chunks of near-equal size (64 at 24: 22, 21, 21),
so a step has at most two chunk sizes, the same in every step.

Exact only where each row's result depends on that row alone. Two features compute a statistic over
the rows of a forward and are refused when a forward is split (``check``):
- a trainer recipe whose activation quantization measures the batch (``batch_statistic``): NVFP4
  activations with ``act_scale=tensor`` (each expert's global scale from the amax over its rows), RAC
  (channels from residual norms over the batch, or statistics the forward observes), FP8 ``tensor``;
- the router load-balance loss (``router_aux_loss_coef > 0``): ``E sum_e f_e P_e`` multiplies two batch
  means, so it is no sum over micro-batches.
"""

from __future__ import annotations

import math

import torch

from quads.model.config import ModelConfig
from quads.quant.recipe import LinearSpec, Recipe
from quads.rl import distributed
from quads.rl.config import TrainConfig
from quads.rl.logprobs import LogprobResult, SequenceBatch, forward_logprobs


def split_rows(start: int, stop: int, size: int | None) -> list[slice]:
    """Rows ``[start, stop)`` in ``ceil(n / size)`` contiguous chunks whose sizes differ by at most one
    (each at most ``size``); one chunk when ``size`` is None."""
    n = stop - start
    k = 1 if size is None else max(1, math.ceil(n / size))
    bounds = [start + (n * j) // k for j in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def step_chunks(rows: int, mini_batches: int, size: int | None) -> list[list[slice]]:
    """The micro-batches of each of the ``mini_batches`` contiguous mini-batches of a step's ``rows``."""
    mb = rows // mini_batches
    return [split_rows(i * mb, (i + 1) * mb, size) for i in range(mini_batches)]


def batch_statistic(spec: LinearSpec) -> str | None:
    """Why the trainer side ``spec`` makes a row's result depend on the other rows of its forward, or None."""
    if spec.act == "nvfp4" and spec.act_scale == "tensor":
        return "quantizes activations to NVFP4 with one global scale per tensor (the amax over the batch)"
    if spec.act == "nvfp4" and spec.rac_ratio > 0:
        return f"picks RAC channels ({spec.rac_selection}) from statistics of the batch"
    if spec.act == "fp8" and spec.fp8_scheme == "tensor":
        return "quantizes activations to FP8 with one scale per tensor (the amax over the batch)"
    return None


def config_rows(cfg: TrainConfig, world: int = 1) -> int:
    """Sequences of one rank's step: its share of the prompts times the samples per prompt."""
    return cfg.rollout.prompts_per_step // world * cfg.rollout.n_samples


def config_chunks(cfg: TrainConfig, world: int = 1) -> list[list[slice]]:
    """``step_chunks`` of one rank's step under ``cfg`` (the same split in every step)."""
    return step_chunks(config_rows(cfg, world), cfg.optim.mini_batches, cfg.optim.micro_batch_size)


def check(cfg: TrainConfig, recipe: Recipe, model_config: ModelConfig, world: int = 1) -> None:
    """Refuse ``optim.micro_batch_size`` where splitting would change more than the summation order."""
    check_recipe(cfg, recipe, world)
    size = cfg.optim.micro_batch_size
    if size is None:
        return
    rows = config_rows(cfg, world)
    chunks = config_chunks(cfg, world)
    if model_config.router_aux_loss_coef > 0 and max(map(len, chunks)) > 1:
        raise ValueError(f"optim.micro_batch_size={size} splits the mini-batches of {rows // cfg.optim.mini_batches} "
                         f"sequences, but the model's router load-balance loss (router_aux_loss_coef "
                         f"{model_config.router_aux_loss_coef:g}) is a product of batch means, not a sum over "
                         "micro-batches; leave optim.micro_batch_size unset (or at least the mini-batch size)")


def check_recipe(cfg: TrainConfig, recipe: Recipe, world: int = 1) -> None:
    """The recipe's part of ``check`` (no model needed: ``quads compare`` runs it before any warm start)."""
    size = cfg.optim.micro_batch_size
    if size is None:
        return
    why = batch_statistic(recipe.trainer)
    if why is not None and sum(map(len, config_chunks(cfg, world))) > 1:
        raise ValueError(f"optim.micro_batch_size={size}: recipe {recipe.name!r}'s trainer {why}, so a micro-batch "
                         f"would be quantized with other scales than the step's {config_rows(cfg, world)} sequences "
                         "together; use recipe.act_scale=token (and no trainer RAC) for micro-batches, or leave "
                         "optim.micro_batch_size unset")


def loss_denom(loss_mask: torch.Tensor, agg: str, info: distributed.DistInfo,
               n_micro: int) -> float | torch.Tensor | None:
    """``grpo_loss``'s ``denom`` for the micro-batches of the mini-batch whose kept-token mask is ``loss_mask``.

    Under torchrun ``distributed.loss_denom``; in one process None when the mini-batch is one forward
    (``grpo_loss`` counts it itself, as without micro-batches), else its kept response tokens (a device
    tensor: no host read) or its sequences."""
    d = distributed.loss_denom(loss_mask, agg, info)
    if d is not None or n_micro == 1:
        return d
    return loss_mask.sum() if agg == "token_mean" else float(loss_mask.shape[0])


def forward_chunks(model: torch.nn.Module, seq: SequenceBatch, routing: torch.Tensor | None, temperature: float,
                   chunks: list[slice] | None, **kw) -> LogprobResult:
    """``forward_logprobs`` over the row ``chunks`` of ``seq`` one after the other (None: one forward), the
    results concatenated along the rows: for the step's no-grad passes. ``aux_loss`` is the row-weighted
    mean of the chunks' (the load-balance loss of the whole batch only for one chunk; these passes do not
    use it)."""
    if chunks is None or len(chunks) == 1:
        return forward_logprobs(model, seq, routing, temperature, **kw)
    parts = [forward_logprobs(model, seq.select(rows), None if routing is None else routing[:, rows], temperature,
                              **kw) for rows in chunks]
    n = seq.input_ids.shape[0]

    def cat(name: str, dim: int) -> torch.Tensor | None:
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts, dim=dim)

    aux = sum(p.aux_loss * ((r.stop - r.start) / n) for p, r in zip(parts, chunks))
    return LogprobResult(cat("logprobs", 0), cat("entropy", 0), aux, cat("routing", 1))
