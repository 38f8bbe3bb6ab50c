"""GRPO: group-normalised advantages and the clipped policy loss.

Legend: ``B`` sequences (``P`` prompts x ``n`` samples, the ``n`` samples of a prompt contiguous),
``L`` response length (padded); masks are 1 on response tokens, 0 on padding.

Departures from textbook GRPO (DeepSeekMath), each a switch:
- ``std_norm=False`` drops the division by the group standard deviation (Dr. GRPO); with it on, the
  std is the unbiased one (``torch.std``, as verl and TRL) plus ``eps``.
- the loss is a token-level mean by default (DAPO / Dr. GRPO: every response token weighs the same,
  long answers are not down-weighted) with an explicit denominator, so that mini-batches and gradient
  accumulation give exactly the full-batch gradient; ``agg="seq_mean"`` is the original per-sequence
  mean then mean over sequences.
- PPO clipping has separate bounds ``[1 - clip_low, 1 + clip_high]`` (DAPO clip-higher).
- optional KL penalty to a reference with the k3 estimator ``exp(r) - r - 1``, ``r = logp_ref - logp``
  (always >= 0, unbiased for KL(pi || ref)); optional entropy bonus.
- an importance-sampling weight per token (``quads.rl.correction``, detached) multiplies the policy
  term only: ``loss_t = w_t * max(-A ratio_t, -A clip(ratio_t))`` with ``ratio_t = exp(logp - logp_old)``,
  both sides of the ratio computed by the trainer (verl/slime TIS).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean"]


def group_advantages(rewards: torch.Tensor, group_size: int, *, std_norm: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages ``A_i = (r_i - mean_g) / (std_g + eps)`` (or ``r_i - mean_g`` without ``std_norm``).

    ``rewards`` [B] with ``B = P * group_size``, the samples of prompt ``p`` at ``p*n .. p*n + n - 1``.
    Returns fp32 [B]. A group where every reward is equal gets advantage 0 (no signal).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B]; got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (GRPO compares samples of one prompt); got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}; "
            "pass the n samples of every prompt contiguously"
        )
    r = rewards.float().view(-1, group_size)  # [P, n]
    adv = r - r.mean(dim=1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


@torch.no_grad()
def group_stats(rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    """Reward statistics of a step: mean, std, and the fraction of groups that carry no signal."""
    r = rewards.float().view(-1, group_size)
    flat = (r == r.max(dim=1, keepdim=True).values).all(dim=1)  # [P] every sample scored the same
    return {
        "reward/mean": r.mean().item(),
        "reward/std": r.std().item() if r.numel() > 1 else 0.0,
        "reward/zero_std_frac": flat.float().mean().item(),
    }


@dataclasses.dataclass
class GRPOLossConfig:
    """Hyper-parameters of the clipped loss (the ``grpo`` section of the trainer config)."""

    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # ratio clipped above at 1 + clip_high (clip-higher when > clip_low)
    kl_coef: float = 0.0  # weight of the k3 KL penalty to the reference policy; 0 disables it
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss); 0 disables it
    agg: LossAgg = "token_mean"  # token_mean: sum / response tokens; seq_mean: per-sequence mean, then mean
    std_norm: bool = True  # divide advantages by the group std (False: Dr. GRPO, mean-centred only)
    adv_eps: float = 1e-6  # added to the group std before dividing

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"grpo.clip_low must be in [0, 1); got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"grpo.clip_high must be >= 0; got {self.clip_high}")
        if self.kl_coef < 0.0 or self.entropy_coef < 0.0:
            raise ValueError(
                f"grpo.kl_coef and grpo.entropy_coef must be >= 0; got {self.kl_coef}, {self.entropy_coef}"
            )
        if not 0.0 < self.adv_eps < float("inf"):
            raise ValueError(f"grpo.adv_eps must be a finite number > 0 (a group whose rewards are all equal has "
                             f"std 0, and its advantages 0 / (0 + adv_eps) would be NaN); got {self.adv_eps}")
        if self.agg not in ("token_mean", "seq_mean"):
            raise ValueError(f"grpo.agg must be 'token_mean' or 'seq_mean'; got {self.agg!r}")


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: LossAgg,
               denom: float | torch.Tensor | None) -> torch.Tensor:
    """Reduce [B, L] to a scalar. ``denom``: tokens (token_mean) or sequences (seq_mean) of the full batch."""
    if agg == "token_mean":  # a count on the device stays there (no host read between forward and backward)
        if denom is None:
            d = mask.sum().clamp(min=1.0)
        else:
            d = denom.clamp(min=1.0) if isinstance(denom, torch.Tensor) else max(float(denom), 1.0)
        return (per_token * mask).sum() / d
    seq_len = mask.sum(dim=1).clamp(min=1.0)  # [B]
    per_seq = (per_token * mask).sum(dim=1) / seq_len
    d = per_token.shape[0] if denom is None else denom
    return per_seq.sum() / max(float(d), 1.0)


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOLossConfig,
    *,
    is_weights: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    denom: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO loss over response tokens.

    logp [B, L] (with grad), logp_old [B, L] (trainer, no grad), advantages [B] or [B, L],
    mask [B, L] (0/1), is_weights [B, L] (detached, 1 by default), logp_ref [B, L], entropy [B, L].
    ``denom``: the normaliser of the *whole* step batch (response tokens for ``token_mean``, sequences
    for ``seq_mean``; a 0-dim tensor keeps a token count on the device) so that summing the losses of its
    mini-batches or micro-batches gives the full-batch loss; the default is this batch's own count. The
    metrics of such parts combine with ``merge_loss_metrics``.

    per token: ``ratio = exp(logp - logp_old)``,
    ``pg = w * max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))``,
    ``loss_t = pg + kl_coef * (exp(logp_ref - logp) - (logp_ref - logp) - 1) - entropy_coef * H_t``.
    """
    if logp.shape != logp_old.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp, logp_old and mask must have the same [B, L] shape; got {tuple(logp.shape)}, "
            f"{tuple(logp_old.shape)}, {tuple(mask.shape)}"
        )
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    w = torch.ones_like(logp) if is_weights is None else is_weights.detach().to(logp.dtype)

    log_ratio = logp - logp_old.detach()
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg1 = -adv * ratio
    pg2 = -adv * clipped
    pg = w * torch.maximum(pg1, pg2)
    per_token = pg
    kl = None
    if logp_ref is not None and cfg.kl_coef > 0.0:
        r = logp_ref.detach() - logp
        kl = torch.exp(r) - r - 1.0
        per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0.0:
        per_token = per_token - cfg.entropy_coef * entropy
    loss = _aggregate(per_token, mask, cfg.agg, denom)

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)

        def mmean(x: torch.Tensor) -> torch.Tensor:
            return (x.float() * mask).sum() / n

        values = {
            "loss/total": loss,
            "loss/policy": _aggregate(pg, mask, cfg.agg, denom),
            "loss/clip_frac": mmean((pg2 > pg1).float()),
            "loss/clip_frac_low": mmean(((ratio < 1.0 - cfg.clip_low) & (adv < 0)).float()),
            "loss/clip_frac_high": mmean(((ratio > 1.0 + cfg.clip_high) & (adv > 0)).float()),
            "loss/ratio_mean": mmean(ratio),
            "loss/approx_kl_old": mmean(0.5 * log_ratio.pow(2)),
            "loss/tokens": mask.sum(),
        }
        if kl is not None:
            values["loss/kl"] = mmean(kl)
        if entropy is not None:
            values["loss/entropy"] = mmean(entropy)
        # one read-back for all of them (fp64 holds every fp32 value exactly: the floats .item() would give)
        metrics = dict(zip(values, torch.stack([v.detach().double() for v in values.values()]).tolist()))
    return loss, metrics


# ``grpo_loss`` metrics that add up over the parts of a batch (with the batch's ``denom``); the others are token means
SUMMED_METRICS = ("loss/total", "loss/policy", "loss/tokens")


def merge_loss_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The ``grpo_loss`` metrics of a batch from those of its micro-batches, each computed with the batch's
    ``denom``: the losses and ``loss/tokens`` summed, the token means weighted by their ``loss/tokens``
    (``sum_i mean_i n_i / sum_i n_i``, the batch's token mean). One part is returned as it is."""
    if len(parts) == 1:
        return dict(parts[0])
    n = sum(p["loss/tokens"] for p in parts)
    return {k: sum(p[k] for p in parts) if k in SUMMED_METRICS
            else sum(p[k] * p["loss/tokens"] for p in parts) / max(n, 1.0) for k in parts[0]}
