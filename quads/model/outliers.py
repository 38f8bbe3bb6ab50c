"""Activation outlier channels for the built-in MoE, as real LLMs have them (``quads pretrain --outliers.*``,
``quads outliers``).

Models trained from scratch for a few hundred steps have no outlier channels; LLMs do (a few hidden
channels whose normalised activations are tens of times larger than the rest, carried by large RMSNorm
gains), and they are what makes 4-bit activations hard. Two ways to give the built-in model some:

- ``inject`` (``inject_outliers``): exact and function-preserving. For each chosen channel ``c`` of each
  layer, multiply the gain of an RMSNorm by ``s`` and divide column ``c`` of every weight that reads that
  norm's output by ``s``. ``norm(x)[:, c] * W[:, c]`` is unchanged, so the model computes the same
  function while the input of those GEMMs gets outlier channels (per-channel absmax times ``s``). When
  ``s`` is a power of two both scalings are exact in every binary float format (barring overflow and
  underflow), so even the BF16 forward is bit for bit the same; other values change it by rounding only.
- ``init`` (``init_outliers``): before supervised training, set the chosen gains to ``s`` (weights keep
  their random init); training then grows a model that uses those large channels.

Sites (``OutlierConfig.sites``): ``mlp`` = ``post_attention_layernorm``, read by the router (``mlp.gate``),
the routed experts (``gate_up_proj``) and the shared expert and its gate when the model has them; ``attn``
= ``input_layernorm``, read by ``q_proj``, ``k_proj``, ``v_proj`` (a different RMSNorm: the q/k norms act
after the projections, so they are untouched). The routed experts are what the recipes quantize by
default, so ``mlp`` is the default site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

SITES = ("mlp", "attn")


@dataclass
class OutlierConfig:
    """Outlier channels of the built-in model (module docstring)."""

    mode: Literal["none", "inject", "init"] = "none"  # none | inject (after SFT, function-preserving) | init (gain init before SFT)
    channels: list[int] = field(default_factory=list)  # hidden channels made outliers, in every layer
    scale: float = 32.0  # gain factor s (a power of two keeps the BF16 function bit for bit in inject mode)
    sites: list[str] = field(default_factory=lambda: ["mlp"])  # norms scaled: mlp (router + experts), attn (q/k/v)

    def __post_init__(self) -> None:
        self.scale = float(self.scale)  # 32 and 32.0 are one setting (and one warm-start cache key)
        self.channels, self.sites = [int(c) for c in self.channels], list(self.sites)
        if self.mode not in ("none", "inject", "init"):
            raise ValueError(f"outliers.mode must be none, inject or init; got {self.mode!r}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"outliers.scale must be a finite number > 0; got {self.scale}")
        bad = [s for s in self.sites if s not in SITES]
        if bad or not self.sites:
            raise ValueError(f"outliers.sites must be a non-empty list of {list(SITES)}; got {self.sites}")
        if self.mode != "none" and not self.channels:
            raise ValueError(f"outliers.mode={self.mode} needs outliers.channels (hidden channel indices, "
                             "e.g. 7,42,100); got none")
        if len(set(self.channels)) != len(self.channels) or any(c < 0 for c in self.channels):
            raise ValueError(f"outliers.channels must be distinct indices >= 0; got {self.channels}")

    @property
    def active(self) -> bool:
        return self.mode != "none"


def _readers(layer: nn.Module, site: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """(the RMSNorm of ``site`` in a decoder layer, the weights whose last dim reads its output)."""
    if site == "attn":
        a = layer.self_attn
        return layer.input_layernorm, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
    mlp = layer.mlp
    ws = [mlp.gate.weight, mlp.experts.gate_up_proj]  # [E, H], [E, 2I, H]
    if mlp.shared_expert is not None:
        ws += [mlp.shared_expert.gate_proj.weight, mlp.shared_expert.up_proj.weight]
    if mlp.shared_expert_gate is not None:
        ws.append(mlp.shared_expert_gate.weight)
    return layer.post_attention_layernorm, ws


def _check(model: nn.Module, cfg: OutlierConfig) -> torch.Tensor:
    hidden = model.config.hidden_size
    if any(c >= hidden for c in cfg.channels):
        raise ValueError(f"outliers.channels must be < hidden_size {hidden}; got {cfg.channels}")
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise ValueError("outliers apply to the built-in MoEForCausalLM (quads.model); got "
                         f"{type(model).__name__}")
    return torch.tensor(cfg.channels, dtype=torch.long)


@torch.no_grad()
def inject_outliers(model: nn.Module, cfg: OutlierConfig) -> None:
    """Scale the chosen channels' gains by ``cfg.scale`` and divide the matching weight columns by it, in
    every layer and site, in place (``inject`` mode; the BF16 function is unchanged)."""
    idx = _check(model, cfg)
    for layer in model.model.layers:
        for site in cfg.sites:
            norm, weights = _readers(layer, site)
            norm.weight[idx.to(norm.weight.device)] *= cfg.scale
            for w in weights:
                w[..., idx.to(w.device)] /= cfg.scale


@torch.no_grad()
def init_outliers(model: nn.Module, cfg: OutlierConfig) -> None:
    """Set the chosen channels' gains to ``cfg.scale`` in every layer and site, in place (``init`` mode, on
    a freshly initialised model before supervised training)."""
    idx = _check(model, cfg)
    for layer in model.model.layers:
        for site in cfg.sites:
            norm, _ = _readers(layer, site)
            norm.weight[idx.to(norm.weight.device)] = cfg.scale


@torch.no_grad()
def norm_output_absmax(model: nn.Module, input_ids: torch.Tensor, site: str = "mlp") -> torch.Tensor:
    """Per-channel max |activation| [n_layers, H] of the ``site`` RMSNorm's output on ``input_ids`` (what the
    GEMMs behind it read): outlier channels stand out here."""
    rows: list[torch.Tensor] = []
    hooks = [(_readers(layer, site)[0]).register_forward_hook(
        lambda _m, _i, out: rows.append(out.detach().abs().flatten(0, -2).amax(0).float().cpu()))
        for layer in model.model.layers]
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(rows)


@torch.no_grad()
def inject_checked(model: nn.Module, cfg: OutlierConfig, input_ids: torch.Tensor) -> dict[str, float]:
    """``inject_outliers`` with a check on ``input_ids`` [B, L]: the logits before and after, and the
    per-channel absmax of each site's norm output. Returns what a checkpoint records
    (``max_abs_logit_change``, ``max_abs_logit``, and per site the mean absmax ratio after / before on the
    outlier channels and on the others); raises ValueError when the logits moved by more than rounding."""
    was_training = model.training
    model.eval()
    before = model(input_ids).logits.float()
    amax0 = {site: norm_output_absmax(model, input_ids, site) for site in cfg.sites}
    inject_outliers(model, cfg)
    after = model(input_ids).logits.float()
    model.train(was_training)
    change = (after - before).abs().max().item()
    out = {"max_abs_logit_change": change, "max_abs_logit": before.abs().max().item(),
           "dtype": str(model.dtype).removeprefix("torch.")}
    mask = torch.zeros(model.config.hidden_size, dtype=torch.bool)
    mask[cfg.channels] = True
    for site in cfg.sites:
        ratio = norm_output_absmax(model, input_ids, site) / amax0[site].clamp_min(torch.finfo(torch.float32).tiny)
        out[f"{site}_absmax_ratio_outliers"] = ratio[:, mask].mean().item()
        out[f"{site}_absmax_ratio_others"] = ratio[:, ~mask].mean().item()
    tol = 8 * torch.finfo(model.dtype).eps * max(out["max_abs_logit"], 1.0) * model.config.n_layers
    if not change <= tol:
        raise ValueError(f"outlier injection changed the logits by {change:.3g} (more than rounding, {tol:.3g}); "
                         "the model has a layer this function does not know how to compensate")
    return out
