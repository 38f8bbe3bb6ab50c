"""Trainer-side log-probs: ONE full-sequence forward, no KV cache (never the rollout engine's path).

Layout (the rollout engine's, see ``quads.rollout.engine``): ``input_ids`` [B, P + R] = left-padded
prompt block of width P then the response block of width R. The log-prob of response token j,
``input_ids[:, P + j]``, comes from the logits at column ``P + j - 1``; only those R columns go
through the lm_head. Positions count real tokens, so padding does not change any result.
"""

from __future__ import annotations

from collections.abc import Callable
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

    def select(self, rows: slice) -> SequenceBatch:
        """The sequences ``rows`` (a mini-batch or micro-batch), same columns."""
        pos = None if self.position_ids is None else self.position_ids[rows]
        return SequenceBatch(self.input_ids[rows], self.attention_mask[rows], self.prompt_len,
                             self.response_mask[rows], pos)

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


def policy_forward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor | None, routing: torch.Tensor | None, response_mask: torch.Tensor,
                   return_routing: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The model forward of ``forward_logprobs``: ``input_ids`` [B, P + R] -> (logits [B, R, V] at the
    columns that predict the response tokens, aux loss [], expert ids [n_layers, B, P + R, k] or None).

    The region ``quads.rl.compiled`` compiles: every argument is a tensor (or None, or a flag), and the
    prompt width comes from the shapes (``P = input_ids.shape[1] - response_mask.shape[1]``), so one
    graph with a dynamic sequence length serves every step. ``attention_mask`` None: no padding.
    """
    R = response_mask.shape[1]
    out = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, routing=routing,
                return_routing=return_routing, logits_slice=slice(-R - 1, -1))
    return out.logits, out.aux_loss, out.routing


def forward_logprobs(model: torch.nn.Module, batch: RolloutBatch | SequenceBatch,
                     routing: torch.Tensor | None = None, temperature: float = 1.0, *,
                     return_entropy: bool = False, return_routing: bool = False,
                     forward: Callable | None = None) -> LogprobResult:
    """One full forward over prompt + response (with grad if enabled) -> per-response-token log-probs.

    ``routing`` [n_layers, B, P + R, k] replays expert ids (e.g. ``RolloutBatch.routing``; -1 rows use
    the router's own choice). Log-probs are ``log_softmax(logits / temperature)`` in at least fp32.
    ``forward``: the model-forward region, ``policy_forward`` (None) or its compiled form
    (``quads.rl.compiled.CompiledForward``); the log-probs (``token_logprobs``) run eagerly after it.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for trainer log-probs, got {temperature} "
                         "(greedy rollouts report temperature-1 log-probs: pass 1.0)")
    seq = to_sequence_batch(batch, device=model.device)
    P = seq.prompt_len
    if routing is not None:
        routing = routing.to(model.device)
    # the one host read of the forward, before the region: a batch without padding takes SDPA's causal path
    key_mask = None if bool(seq.attention_mask.all()) else seq.attention_mask
    mask = seq.response_mask
    logits, aux_loss, used = (forward or policy_forward)(model, seq.input_ids, key_mask, seq.position_ids, routing,
                                                          mask, return_routing)
    logp, entropy = token_logprobs(logits, seq.input_ids[:, P:], temperature, return_entropy)
    logp = logp.masked_fill(~mask, 0.0)
    if entropy is not None:
        entropy = entropy.masked_fill(~mask, 0.0)
    return LogprobResult(logp, entropy, aux_loss, used)


CHUNK_ELEMENTS = 1 << 24  # logits entries per chunk of ``token_logprobs`` (64 MiB in fp32)


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                   return_entropy: bool = False, chunk_elements: int = CHUNK_ELEMENTS
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits`` [..., V], ``target`` [...] long -> (log p(target) [...], entropy [...] or None) of
    ``softmax(logits / temperature)``, computed in at least fp32, chunked over rows.

    Numerically ``log_softmax(z).gather(target)`` and ``-(p * log p).sum()`` with ``z = logits / T``:
    ``lse = logsumexp(z)``, ``log p(t) = z_t - lse``, ``H = lse - sum(p * z)``. Only the logits and
    ``lse`` are kept for the backward, which recomputes ``p`` chunk by chunk:
    ``dz = g_logp * (onehot(t) - p) + g_H * p * (sum(p * z) - z)``; the full-vocabulary fp32 softmax
    exists one chunk at a time (``chunk_elements`` entries), in neither pass whole.
    """
    V = logits.shape[-1]
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"token_logprobs: expected target of shape {tuple(logits.shape[:-1])}, got "
                         f"{tuple(target.shape)}")
    rows = max(1, chunk_elements // max(V, 1))
    lp, ent = _TokenLogprobFn.apply(logits.reshape(-1, V), target.reshape(-1), float(temperature), rows,
                                    return_entropy)
    return lp.view(target.shape), (ent.view(target.shape) if return_entropy else None)


class _TokenLogprobFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, rows, want_entropy):  # type: ignore[override]
        dt = torch.promote_types(logits.dtype, torch.float32)
        N = logits.shape[0]
        lse, lp = logits.new_empty(N, dtype=dt), logits.new_empty(N, dtype=dt)
        ent = logits.new_empty(N if want_entropy else 0, dtype=dt)
        for a in range(0, N, rows):
            z = logits[a:a + rows].to(dt) / temperature
            lse[a:a + rows] = torch.logsumexp(z, dim=-1)
            lp[a:a + rows] = z.gather(-1, target[a:a + rows, None]).squeeze(-1) - lse[a:a + rows]
            if want_entropy:
                p = torch.exp(z - lse[a:a + rows, None])
                ent[a:a + rows] = lse[a:a + rows] - (p * z).sum(-1)
        ctx.save_for_backward(logits, target, lse)
        ctx.temperature, ctx.rows, ctx.want_entropy = temperature, rows, want_entropy
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):  # type: ignore[override]
        logits, target, lse = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], rows):
            z = logits[a:a + rows].to(lse.dtype) / T
            p = torch.exp(z - lse[a:a + rows, None])
            dz = -p * g_lp[a:a + rows, None]
            dz.scatter_add_(-1, target[a:a + rows, None], g_lp[a:a + rows, None])
            if ctx.want_entropy and g_ent is not None:
                dz += p * ((p * z).sum(-1, keepdim=True) - z) * g_ent[a:a + rows, None]
            grad[a:a + rows] = dz / T
        return grad, None, None, None, None


def sequence_logprobs(model: torch.nn.Module, batch: RolloutBatch | SequenceBatch,
                      routing: torch.Tensor | None = None, temperature: float = 1.0, *,
                      return_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, R] log-probs of the response tokens (and [B, R] entropy if asked); see ``forward_logprobs``."""
    res = forward_logprobs(model, batch, routing, temperature, return_entropy=return_entropy)
    return (res.logprobs, res.entropy) if return_entropy else res.logprobs
