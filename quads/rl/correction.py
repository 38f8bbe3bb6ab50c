"""Importance-sampling correction for the rollout/trainer mismatch.

The samples come from the rollout engine's policy ``mu`` (quantized, KV-cache decode), while the loss
is built from the trainer's policy ``pi``. Per response token, with both log-probs of the sampled token:

    rho_t = exp(logp_old_t - logp_rollout_t)          # trainer (old, no grad) over rollout

How it composes with PPO (as verl / slime TIS): the PPO ratio stays on the trainer side,
``ratio_t = exp(logp_t - logp_old_t)`` (new over old, both from the trainer's full forward), and the IS
term multiplies the clipped policy term as a *detached* weight:

    loss_t = w_t * max(-A ratio_t, -A clip(ratio_t, 1 - eps_low, 1 + eps_high))

The correction is applied identically whatever the recipe (bf16 included: the BF16 engine drift is
a real mismatch too). Kinds:
- ``none``: ``w = 1``.
- ``tis`` (truncated IS, token level): ``w = min(rho, cap)``.
- ``icepop`` (token masking): tokens with ``rho`` outside ``[low, high]`` are dropped, others ``w = 1``.
- ``seq_mask`` (sequence masking): a sequence is dropped when its geometric-mean ratio
  ``exp(mean_t log rho_t)`` is outside ``[low, high]``; kept sequences get ``w = 1``.

Dropped tokens leave the loss *and* its token denominator (the returned ``mask``), as verl's rejection
sampling does: the step's loss is the mean over the tokens that survive.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

CorrectionKind = Literal["none", "tis", "icepop", "seq_mask"]


@dataclasses.dataclass
class CorrectionConfig:
    """The ``correction`` section of the trainer config."""

    kind: CorrectionKind = "tis"  # none | tis | icepop | seq_mask
    cap: float = 2.0  # tis: upper bound C of the token weight min(rho, C)
    low: float = 0.5  # icepop / seq_mask: lower edge of the kept band of rho
    high: float = 2.0  # icepop / seq_mask: upper edge of the kept band of rho

    def __post_init__(self) -> None:
        if self.kind not in ("none", "tis", "icepop", "seq_mask"):
            raise ValueError(
                f"correction.kind must be one of none, tis, icepop, seq_mask; got {self.kind!r}"
            )
        if not self.cap > 0.0:
            raise ValueError(f"correction.cap must be > 0; got {self.cap}")
        if not 0.0 <= self.low < 1.0 < self.high:
            raise ValueError(
                f"correction band must satisfy 0 <= low < 1 < high; got low={self.low}, high={self.high}"
            )


@dataclasses.dataclass
class Correction:
    """weights [B, L] (detached, 0 on dropped tokens), mask [B, L] (the loss mask after dropping)."""

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]


@torch.no_grad()
def is_correction(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                  cfg: CorrectionConfig) -> Correction:
    """Weights and loss mask for ``cfg.kind``; all inputs [B, L], ``mask`` 0/1 on response tokens."""
    if logp_old.shape != logp_rollout.shape or logp_old.shape != mask.shape:
        raise ValueError(
            f"logp_old, logp_rollout and mask must have the same [B, L] shape; got "
            f"{tuple(logp_old.shape)}, {tuple(logp_rollout.shape)}, {tuple(mask.shape)}"
        )
    m = mask.float()
    log_rho = (logp_old.float() - logp_rollout.float()) * m  # 0 on padding
    rho = torch.exp(log_rho)
    n_tok = m.sum().clamp(min=1.0)
    keep = m.clone()
    if cfg.kind == "none":
        w = torch.ones_like(rho)
    elif cfg.kind == "tis":
        w = rho.clamp(max=cfg.cap)
    elif cfg.kind == "icepop":
        inside = (rho >= cfg.low) & (rho <= cfg.high)
        keep = m * inside.float()
        w = torch.ones_like(rho)
    else:  # seq_mask
        seq_len = m.sum(dim=1).clamp(min=1.0)
        geo = torch.exp(log_rho.sum(dim=1) / seq_len)  # [B]
        inside = (geo >= cfg.low) & (geo <= cfg.high)
        keep = m * inside[:, None].float()
        w = torch.ones_like(rho)
    w = w * keep
    n_seq = max(int((m.sum(dim=1) > 0).sum().item()), 1)
    metrics = {
        "correction/weight_mean": ((w * m).sum() / n_tok).item(),
        "correction/token_drop_frac": (((m - keep) > 0).float().sum() / n_tok).item(),
        "correction/seq_drop_frac": (((m.sum(1) > 0) & (keep.sum(1) == 0)).float().sum() / n_seq).item(),
        "correction/capped_frac": (((rho > cfg.cap) & (m > 0)).float().sum() / n_tok).item()
        if cfg.kind == "tis" else 0.0,
    }
    return Correction(weights=w.to(logp_old.dtype), mask=keep.to(mask.dtype), metrics=metrics)
