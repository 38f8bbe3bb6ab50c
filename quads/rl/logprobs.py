"""Trainer-side log-probs: ONE full-sequence forward, no KV cache (never the rollout engine's path).

Layout (the rollout engine's, see ``quads.rollout.engine``): ``input_ids`` [B, P + R] = left-padded
prompt block of width P then the response block of width R. The log-prob of response token j,
``input_ids[:, P + j]``, comes from the logits at column ``P + j - 1``; only those R columns go
through the lm_head. Positions count real tokens, so padding does not change any result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quads.rollout import RolloutBatch


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor  # [B, P + R] long
    attention_mask: torch.Tensor  # [B, P + R] bool, True at real tokens
    prompt_len: int  # P
    response_mask: torch.Tensor  # [B, R] bool, True at response tokens that count in the loss
    position_ids: torch.Tensor | None = None  # [B, P + R]; None = counted from attention_mask

    def __post_init__(self) -> None:
        B, S = self.input_ids.shape
        if self.attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask must be {[B, S]}, got {list(self.attention_mask.shape)}")
        if not 0 < self.prompt_len < S or self.response_mask.shape != (B, S - self.prompt_len):
            raise ValueError(f"expected 0 < prompt_len < {S} and response_mask [B, S - prompt_len]; got "
                             f"prompt_len {self.prompt_len}, response_mask {list(self.response_mask.shape)}")

    def to(self, device: torch.device | str) -> SequenceBatch:
        pos = self.position_ids.to(device) if self.position_ids is not None else None
        return SequenceBatch(self.input_ids.to(device), self.attention_mask.to(device), self.prompt_len,
                             self.response_mask.to(device), pos)


def to_sequence_batch(batch: RolloutBatch | SequenceBatch, device: torch.device | str | None = None
                      ) -> SequenceBatch:
    """The padded tensors the trainer needs from a ``RolloutBatch`` (input_ids, masks, position_ids)."""
    from quads.model.transformer import positions_from_mask

    if isinstance(batch, SequenceBatch):
        seq = batch
    else:
        seq = SequenceBatch(batch.input_ids, batch.attention_mask.bool(), batch.prompt_len,
                            batch.response_mask.bool(), positions_from_mask(batch.attention_mask))
    return seq.to(device) if device is not None else seq


@dataclass
class LogprobResult:
    logprobs: torch.Tensor  # [B, R] log p(response token) at `temperature`, 0 where response_mask is False
    entropy: torch.Tensor | None  # [B, R] entropy of the temperature-scaled distribution, or None
    aux_loss: torch.Tensor  # [] router load-balance loss (already weighted by router_aux_loss_coef)
    routing: torch.Tensor | None  # [n_layers, B, P + R, k] expert ids the forward used, or None


def forward_logprobs(model: torch.nn.Module, batch: RolloutBatch | SequenceBatch,
                     routing: torch.Tensor | None = None, temperature: float = 1.0, *,
                     return_entropy: bool = False, return_routing: bool = False) -> LogprobResult:
    """One full forward over prompt + response (with grad if enabled) -> per-response-token log-probs.

    ``routing`` [n_layers, B, P + R, k] replays expert ids (e.g. ``RolloutBatch.routing``; -1 rows use
    the router's own choice). Log-probs are ``log_softmax(logits / temperature)`` in at least fp32.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for trainer log-probs, got {temperature} "
                         "(greedy rollouts report temperature-1 log-probs: pass 1.0)")
    seq = to_sequence_batch(batch, device=model.device)
    P = seq.prompt_len
    if routing is not None:
        routing = routing.to(model.device)
    out = model(seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids,
                routing=routing, return_routing=return_routing, logits_slice=slice(P - 1, -1))
    logits = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32)) / temperature  # [B, R, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    target = seq.input_ids[:, P:]
    logp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    mask = seq.response_mask
    logp = logp.masked_fill(~mask, 0.0)
    entropy = None
    if return_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1).masked_fill(~mask, 0.0)
    return LogprobResult(logp, entropy, out.aux_loss, out.routing)


def sequence_logprobs(model: torch.nn.Module, batch: RolloutBatch | SequenceBatch,
                      routing: torch.Tensor | None = None, temperature: float = 1.0, *,
                      return_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, R] log-probs of the response tokens (and [B, R] entropy if asked); see ``forward_logprobs``."""
    res = forward_logprobs(model, batch, routing, temperature, return_entropy=return_entropy)
    return (res.logprobs, res.entropy) if return_entropy else res.logprobs
