"""The sparse MoE block: top-k softmax router, routed SwiGLU experts, optional shared expert.

Legend: ``T`` tokens (B*L flattened), ``H`` hidden, ``E`` experts, ``k`` experts per token,
``I`` expert intermediate size.

Routing (Qwen3-MoE / OLMoE / Mixtral): ``p = softmax(gate(x))`` in at least fp32, the experts are the
top-k of ``p``, their weights ``p[top-k]`` (renormalised to sum 1 when ``norm_topk_prob``), cast to the
compute dtype. Routing replay forces the expert ids; the weights are still the router's own softmax
probabilities of the forced experts, so gradients reach the router as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quads.model import gemm
from quads.model.config import ModelConfig


class MoEExperts(nn.Module):
    """E SwiGLU experts stored fused, exactly as transformers 5 ``Qwen3MoeExperts``.

    ``gate_up_proj`` [E, 2I, H] (rows [:I] gate, [I:] up), ``down_proj`` [E, H, I]. ``quads.quant`` swaps
    this class for a quantized one with the same ``forward`` signature.
    """

    def __init__(self, n_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = n_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, intermediate))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, k] long, top_k_weights [T, k] -> [T, H].

        out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = index[t, j]. Tokens are
        grouped by expert (one GEMM pair per expert hit), then the k weighted outputs of each token are
        summed in slot order (for k = 2 this equals transformers' expert-order ``index_add_`` exactly).
        """
        T, k = top_k_index.shape
        if T == 0:
            return torch.zeros_like(hidden_states)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order kept inside
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x_sorted = hidden_states[order // k]  # [T*k, H]
        ys = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate, up = gemm.linear(x_sorted[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
            ys.append(gemm.linear(F.silu(gate) * up, self.down_proj[e]))  # [n, H]
            start += n
        y = torch.empty((T * k, hidden_states.shape[1]), dtype=ys[0].dtype, device=hidden_states.device)
        y[order] = torch.cat(ys)
        y = y.view(T, k, -1) * top_k_weights[..., None].to(y.dtype)
        return y.sum(1).to(hidden_states.dtype)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (the shared expert): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = gemm.Linear(hidden, intermediate, bias=False)
        self.up_proj = gemm.Linear(hidden, intermediate, bias=False)
        self.down_proj = gemm.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, forced: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (probs [T, E] in >= fp32, top_k_index [T, k] long, top_k_weights [T, k]).

    ``forced`` [T, k] long replays recorded expert ids; rows whose ids are negative (-1: not recorded,
    e.g. padding) fall back to the router's own top-k.
    """
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if forced is not None:
        forced = forced.to(device=top_i.device, dtype=torch.long)
        if forced.shape != top_i.shape:
            raise ValueError(f"routing replay: expected expert ids of shape {tuple(top_i.shape)} per layer, "
                             f"got {tuple(forced.shape)}")
        keep = (forced >= 0).all(dim=-1, keepdim=True)
        top_i = torch.where(keep, forced, top_i)
        top_w = probs.gather(1, top_i)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return probs, top_i, top_w.to(logits.dtype)


def load_balance_loss(probs: torch.Tensor, top_k_index: torch.Tensor, valid: torch.Tensor | None
                      ) -> torch.Tensor:
    """Switch-Transformer balance loss E * sum_e f_e * P_e over valid tokens (1.0 when uniform).

    f_e: fraction of the T*k routing slots sent to expert e; P_e: mean router probability of e.
    """
    E = probs.shape[-1]
    w = torch.ones(probs.shape[0], device=probs.device, dtype=probs.dtype) if valid is None else valid.to(probs.dtype)
    n = w.sum().clamp_min(1.0)
    hits = F.one_hot(top_k_index, E).to(probs.dtype).sum(1)  # [T, E]
    f = (hits * w[:, None]).sum(0) / (n * top_k_index.shape[1])
    p = (probs * w[:, None]).sum(0) / n
    return E * (f * p).sum()


class MoEBlock(nn.Module):
    """Router (``gate``, nn.Linear(H, E)) + routed ``experts`` (+ ``shared_expert``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = gemm.Linear(cfg.hidden_size, cfg.n_experts, bias=False)
        self.experts = MoEExperts(cfg.n_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = gemm.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (out [T, H], top_k_index [T, k], router probs [T, E])."""
        probs, top_i, top_w = route(self.gate(x), self.top_k, self.norm_topk_prob, forced)
        out = self.experts(x, top_i, top_w)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out, top_i, probs
