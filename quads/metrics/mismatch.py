"""Rollout/trainer mismatch metrics of one RL step (DESIGN.md section 5).

Over the response tokens of a batch (``mask`` [B, L] = 1), with the log-probability of each sampled
token on both sides and ``rho = exp(logp_train - logp_rollout)``:

| key                                   | definition                                                   |
|---------------------------------------|--------------------------------------------------------------|
| ``mismatch/logp_gap_max``             | max |logp_rollout - logp_train|                              |
| ``mismatch/logp_gap_mean``            | mean |logp_rollout - logp_train|                             |
| ``mismatch/k1``                       | mean(logp_rollout - logp_train)  (KL(mu || pi) estimator)    |
| ``mismatch/k3``                       | mean(rho - log rho - 1)          (KL(mu || pi), >= 0)        |
| ``mismatch/chi2``                     | mean(rho^2) - 1                  (chi^2 divergence, as IS    |
|                                       |                                   variance proxy)            |
| ``mismatch/ppl_ratio``                | mean over sequences of ppl_rollout / ppl_train, where        |
|                                       | ppl = exp(-mean_t logp) of that sequence; > 1 when the       |
|                                       | rollout side is less sure of its own samples                 |
| ``mismatch/ppl_train``, ``..._rollout``| the two per-sequence perplexities averaged over sequences   |
| ``mismatch/frac_rho_outside_0.5_2``   | fraction of tokens with rho < 0.5 or rho > 2                 |
| ``mismatch/frac_rho_outside_0.2_5``   | fraction of tokens with rho < 0.2 or rho > 5                 |
| ``mismatch/routing_diff``             | fraction of (response token, layer) pairs whose top-k expert |
|                                       | *sets* differ between the two sides (order-insensitive)      |
| ``mismatch/logp_gap_max_probe``       | the max over the first ``probe_tokens`` response tokens      |
|                                       | (row-major), NaN when the batch has fewer; a max grows with  |
|                                       | the number of tokens it covers, so only this one is          |
|                                       | comparable across runs and batch sizes                       |
| ``mismatch/seq_gap_mean``, ``_max``     | mean / max over responses of sum_t |logp_train - logp_rollout| |
|                                       | (the per-token gap accumulated over a response: it grows     |
|                                       | with the response length, as the sequence IS ratio's error)  |
| ``mismatch/seq_log_ratio_mean``       | mean over responses of sum_t (logp_train - logp_rollout), the |
|                                       | log of the sequence importance ratio pi(y) / mu(y)           |
| ``mismatch/seq_log_ratio_abs_max``    | max over responses of |sum_t (logp_train - logp_rollout)|   |
| ``mismatch/layer_err/<name>``         | per-layer relative output error, passed through when given   |

Samples come from the rollout policy ``mu``, so the k1/k3 means estimate KL(mu || pi_train).
All arithmetic in fp32 (the inputs may be BF16 log-probs upcast by the caller or here), except the
per-response sums of ``mismatch/seq_*``, which are fp64.

Beside these, ``framework_aliases`` gives the same batch under the names RL frameworks log, so runs can
be read in the dashboards users already have (emitted by ``mismatch_metrics`` too):

| key | definition (``d = logp_train - logp_rollout`` per token; per-sequence means over its tokens) |
|---|---|
| ``rollout_corr/kl`` (verl) | mean(logp_rollout - logp_train) = ``mismatch/k1`` |
| ``rollout_corr/k3_kl`` (verl) | mean(exp(d) - d - 1) = ``mismatch/k3`` |
| ``rollout_corr/chi2_token`` (verl) | mean(exp(2 clamp(d, +-20))) - 1 (``mismatch/chi2`` without the clamp) |
| ``rollout_corr/chi2_seq`` (verl) | mean over sequences of exp(2 clamp(sum_t d, +-20)) - 1 |
| ``rollout_corr/training_ppl``, ``rollout_ppl`` | mean over sequences of exp(-mean_t logp) on that side |
| ``rollout_corr/training_log_ppl``, ``rollout_log_ppl`` | mean over sequences of -mean_t logp |
| ``rollout_corr/log_ppl_diff`` (``_abs_diff``, ``_max``, ``_min``) | per sequence mean_t logp_rollout - mean_t logp_train: mean (of abs), max, min |
| ``rollout_corr/ppl_ratio`` (verl) | mean over sequences of **ppl_train / ppl_rollout**: the inverse direction of ``mismatch/ppl_ratio`` |
| ``sampling/sampling_logp_difference/mean``, ``/max`` (TRL) | mean and max of abs(d) = ``mismatch/logp_gap_mean``, ``_max`` |

Sequences without response tokens are left out of the per-sequence means (verl requires none to be empty).
"""

from __future__ import annotations

import math

import torch

BANDS = ((0.5, 2.0), (0.2, 5.0))
_LOG_RATIO_BOUND = 20.0  # verl's clamp of log rho (and of its per-sequence sum) inside its chi^2 metrics


def _band_key(lo: float, hi: float) -> str:
    return f"mismatch/frac_rho_outside_{lo:g}_{hi:g}"


@torch.no_grad()
def routing_diff(routing_train: torch.Tensor, routing_rollout: torch.Tensor,
                 mask: torch.Tensor | None = None) -> float:
    """Fraction of (token, layer) expert sets that differ; routing [n_layers, B, L, k] int, mask [B, L].

    The k selected experts are compared as sets (sorted), so a swap in rank order is not a difference.
    """
    if routing_train.shape != routing_rollout.shape:
        raise ValueError(
            f"routing tensors must have the same [n_layers, B, L, k] shape; got "
            f"{tuple(routing_train.shape)} and {tuple(routing_rollout.shape)}"
        )
    a = routing_train.sort(dim=-1).values
    b = routing_rollout.sort(dim=-1).values
    differ = (a != b).any(dim=-1).float()  # [n_layers, B, L]
    if mask is None:
        return differ.mean().item()
    m = mask.float()[None].expand_as(differ)
    return ((differ * m).sum() / m.sum().clamp(min=1.0)).item()


@torch.no_grad()
def framework_aliases(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
                      ) -> dict[str, float]:
    """verl's ``rollout_corr/*`` and TRL's ``sampling/sampling_logp_difference/*`` metrics of one batch
    (module docstring: definitions, and the direction of ``rollout_corr/ppl_ratio``); ``logp_*`` and
    ``mask`` [B, L]. NaN for a batch without response tokens."""
    keys = ("kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl", "rollout_ppl", "training_log_ppl",
            "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min",
            "ppl_ratio")
    m = mask.bool()
    if not m.any():
        out = {f"rollout_corr/{k}": math.nan for k in keys}
        return out | {"sampling/sampling_logp_difference/mean": math.nan,
                      "sampling/sampling_logp_difference/max": math.nan}
    lt, lr = logp_train.float(), logp_rollout.float()
    d = (lt - lr)[m]
    d_safe = d.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    mf = m.float()
    n = mf.sum(1)
    has = n > 0
    mean_t = ((lt * mf).sum(1) / n.clamp(min=1))[has]  # [B'] per-sequence mean log-prob
    mean_r = ((lr * mf).sum(1) / n.clamp(min=1))[has]
    seq_d = ((lt - lr) * mf).sum(1)[has].clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    diff = mean_r - mean_t  # log(ppl_train / ppl_rollout)
    vals = {
        "kl": (-d).mean(), "k3_kl": (torch.exp(d) - d - 1.0).mean(),
        "chi2_token": torch.exp(2.0 * d_safe).mean() - 1.0, "chi2_seq": torch.exp(2.0 * seq_d).mean() - 1.0,
        "training_ppl": torch.exp(-mean_t).mean(), "rollout_ppl": torch.exp(-mean_r).mean(),
        "training_log_ppl": (-mean_t).mean(), "rollout_log_ppl": (-mean_r).mean(),
        "log_ppl_diff": diff.mean(), "log_ppl_abs_diff": diff.abs().mean(), "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(), "ppl_ratio": torch.exp(diff).mean(),
    }
    out = {f"rollout_corr/{k}": v.item() for k, v in vals.items()}
    out["sampling/sampling_logp_difference/mean"] = d.abs().mean().item()
    out["sampling/sampling_logp_difference/max"] = d.abs().max().item()
    return out


SEQUENCE_KEYS = ("seq_gap_mean", "seq_gap_max", "seq_log_ratio_mean", "seq_log_ratio_abs_max")


@torch.no_grad()
def sequence_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The per-response mismatch (module docstring: ``mismatch/seq_*``); ``logp_*`` and ``mask`` [B, L].

    Per response ``b``: ``gap_b = sum_t |d_bt|`` and ``log_ratio_b = sum_t d_bt`` with
    ``d = logp_train - logp_rollout`` over its response tokens, summed in fp64 (a sum over hundreds of
    tokens); responses without tokens are left out; NaN when none has any."""
    m = mask.bool()
    has = m.any(dim=1)
    if not has.any():
        return {f"mismatch/{k}": math.nan for k in SEQUENCE_KEYS}
    d = (logp_train.double() - logp_rollout.double()).masked_fill(~m, 0.0)[has]  # [B', L]
    gap, log_ratio = d.abs().sum(dim=1), d.sum(dim=1)  # [B']
    return {"mismatch/seq_gap_mean": gap.mean().item(), "mismatch/seq_gap_max": gap.max().item(),
            "mismatch/seq_log_ratio_mean": log_ratio.mean().item(),
            "mismatch/seq_log_ratio_abs_max": log_ratio.abs().max().item()}


@torch.no_grad()
def mismatch_metrics(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    routing_train: torch.Tensor | None = None,
    routing_rollout: torch.Tensor | None = None,
    routing_mask: torch.Tensor | None = None,
    probe_tokens: int = 4096,
    layer_errors: dict[str, float] | None = None,
) -> dict[str, float]:
    """All mismatch metrics of one batch; ``logp_*`` [B, L], ``mask`` [B, L] 0/1 on response tokens.

    ``routing_*``: [n_layers, B, L, k] expert ids of the same positions (``routing_diff`` is omitted
    when either is None); ``routing_mask`` [B, L] restricts it (default ``mask``), e.g. to the tokens the
    engine fed back through the model (its last sampled token has no routing). ``layer_errors``: name -> relative output error, logged as
    ``mismatch/layer_err/<name>``.
    """
    if logp_train.shape != logp_rollout.shape or logp_train.shape != mask.shape:
        raise ValueError(
            f"logp_train, logp_rollout and mask must have the same [B, L] shape; got "
            f"{tuple(logp_train.shape)}, {tuple(logp_rollout.shape)}, {tuple(mask.shape)}"
        )
    if probe_tokens < 1:
        raise ValueError(f"probe_tokens must be >= 1; got {probe_tokens}")
    m = mask.bool()
    lt = logp_train.float()[m]  # [N] response tokens, row-major
    lr = logp_rollout.float()[m]
    n = lt.numel()
    out: dict[str, float] = {"mismatch/tokens": float(n)}
    if n == 0:
        nan = math.nan
        for k in ("logp_gap_max", "logp_gap_mean", "k1", "k3", "chi2", "ppl_ratio", "ppl_train",
                  "ppl_rollout", "logp_gap_max_probe"):
            out[f"mismatch/{k}"] = nan
        for lo, hi in BANDS:
            out[_band_key(lo, hi)] = nan
    else:
        d = lt - lr  # log rho
        rho = torch.exp(d)
        gap = d.abs()
        out["mismatch/logp_gap_max"] = gap.max().item()
        out["mismatch/logp_gap_mean"] = gap.mean().item()
        out["mismatch/k1"] = (-d).mean().item()
        out["mismatch/k3"] = (rho - d - 1.0).mean().item()
        out["mismatch/chi2"] = (rho.pow(2).mean() - 1.0).item()
        mf = mask.float()
        seq_n = mf.sum(dim=1)
        has = seq_n > 0
        ppl_t = torch.exp(-(logp_train.float() * mf).sum(1)[has] / seq_n[has])
        ppl_r = torch.exp(-(logp_rollout.float() * mf).sum(1)[has] / seq_n[has])
        out["mismatch/ppl_train"] = ppl_t.mean().item()
        out["mismatch/ppl_rollout"] = ppl_r.mean().item()
        out["mismatch/ppl_ratio"] = (ppl_r / ppl_t).mean().item()
        for lo, hi in BANDS:
            out[_band_key(lo, hi)] = ((rho < lo) | (rho > hi)).float().mean().item()
        out["mismatch/logp_gap_max_probe"] = gap[:probe_tokens].max().item() if n >= probe_tokens else math.nan
    if routing_train is not None and routing_rollout is not None:
        out["mismatch/routing_diff"] = routing_diff(
            routing_train, routing_rollout, mask if routing_mask is None else routing_mask)
    out.update(sequence_metrics(logp_train, logp_rollout, mask))
    for name, err in (layer_errors or {}).items():
        out[f"mismatch/layer_err/{name}"] = float(err)
    out.update(framework_aliases(logp_train, logp_rollout, mask))
    return out
