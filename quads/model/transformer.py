"""``MoEForCausalLM``: the built-in Qwen3-MoE-style decoder (pre-norm, GQA + RoPE, every layer MoE).

Module names mirror Hugging Face Qwen3-MoE (``model.embed_tokens``, ``model.layers.{i}.self_attn.q_proj``,
``model.layers.{i}.mlp.gate``, ``model.layers.{i}.mlp.experts.gate_up_proj``, ``model.norm``, ``lm_head``)
so quantization and export rules are shared with HF models.

Legend: ``B`` sequences, ``L`` tokens per sequence in this call, ``T`` = B*L, ``V`` vocabulary,
``k`` experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from quads.model.attention import Attention, KVCache, RMSNorm, StaticKVCache, build_attn_mask, rope_cos_sin
from quads.model.config import ModelConfig
from quads.model.gemm import Linear
from quads.model.moe import MoEBlock, MoEExperts, load_balance_loss


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, L, V] in the compute dtype
    routing: torch.Tensor | None  # [n_layers, B, L, k] long expert ids actually used; None unless asked
    aux_loss: torch.Tensor  # [] router load-balance loss already times router_aux_loss_coef (0 if coef is 0)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, forced: torch.Tensor | None, rows: torch.Tensor | None = None,
                device_dispatch: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, H] -> (x, top_k_index [T, k], router probs [T, E]); ``rows``, ``device_dispatch``:
        see ``MoEForCausalLM.decode_step``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, rows)
        B, L, H = x.shape
        flat_rows = None if rows is None else rows[:, None].expand(B, L).reshape(B * L)
        h, top_i, probs = self.mlp(self.post_attention_layernorm(x).reshape(B * L, H), forced, flat_rows,
                                   device_dispatch)
        return x + h.view(B, L, H), top_i, probs


class MoEModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, S] counting real tokens only (left padding gets 0): cumsum(mask) - 1, >= 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


class MoEForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = MoEModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()
        self.to(cfg.torch_dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std); residual output projections (o_proj, down_proj) std / sqrt(2 n_layers)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, 0.0, out_std if name.endswith(("o_proj", "down_proj")) else std)
            elif isinstance(m, MoEExperts):
                nn.init.normal_(m.gate_up_proj, 0.0, std)
                nn.init.normal_(m.down_proj, 0.0, out_std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                routing: torch.Tensor | None = None, return_routing: bool = False,
                logits_slice: slice | None = None, device_dispatch: bool = False) -> ModelOutput:
        """input_ids [B, L] -> logits [B, L, V].

        attention_mask: 1 = real token. Without a cache it is [B, L]; with a cache it covers every key,
          [B, cache.length + L]. Left padding is supported (pads are hidden as keys; their own outputs
          are garbage and must be ignored).
        position_ids: [B, L]; default counts real tokens (``positions_from_mask``), so a left-padded
          row gets the same positions as the unpadded one.
        cache: ``KVCache`` for incremental decode (rollout engine only); advanced by L on return.
        routing: [n_layers, B, L, k] expert ids to force (routing replay); rows of -1 are not forced.
        logits_slice: compute logits only for ``[:, logits_slice]`` (saves the lm_head on prompts).
        device_dispatch: the experts' capturable path (``forward_static``; the rollout engine's prefill on its
          static path, ``quads.rollout.decode.StaticDecoder.prefill``).
        """
        cfg = self.config
        B, L = input_ids.shape
        past = cache.length if cache is not None else 0
        if attention_mask is not None and attention_mask.shape != (B, past + L):
            raise ValueError(f"attention_mask must be [B, past + L] = {[B, past + L]}, got "
                             f"{list(attention_mask.shape)} (with a cache it covers past and new tokens)")
        if routing is not None and routing.shape[:3] != (cfg.n_layers, B, L):
            raise ValueError(f"routing must be [n_layers, B, L, k] = {[cfg.n_layers, B, L, cfg.top_k]}, "
                             f"got {list(routing.shape)}")
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past:]
            else:
                position_ids = torch.arange(past, past + L, device=input_ids.device).expand(B, L)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype)
        mask = build_attn_mask(attention_mask, B, L, past, x.device)
        valid = attention_mask[:, past:].reshape(-1) if attention_mask is not None else None
        record = []
        aux = torch.zeros((), device=x.device, dtype=torch.float32)
        for i, layer in enumerate(self.model.layers):
            forced = routing[i].reshape(B * L, -1) if routing is not None else None
            x, top_i, probs = layer(x, cos, sin, mask, cache, forced, None, device_dispatch)
            if return_routing:
                record.append(top_i.view(B, L, -1))
            if cfg.router_aux_loss_coef > 0:
                aux = aux + load_balance_loss(probs, top_i, valid).float()
        if cache is not None:
            cache.advance(L)
        if isinstance(logits_slice, slice):  # not `is not None`, which makes Dynamo specialise on a traced slice
            x = x[:, logits_slice]
        logits = self.lm_head(self.model.norm(x))
        aux = aux * (cfg.router_aux_loss_coef / cfg.n_layers)
        return ModelOutput(logits, torch.stack(record) if return_routing else None, aux)

    def decode_step(self, tokens: torch.Tensor, cache: StaticKVCache, rows: torch.Tensor, *,
                    device_dispatch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One fixed-shape decode forward: ``tokens`` [B] at column ``cache.pos`` -> (logits [B, V],
        expert ids [n_layers, B, k]); the rollout engine's decode step, captured in a CUDA graph.

        Every shape is fixed by the batch and the cache, and nothing is read back to the host, so the
        call is capturable. ``rows`` [B] bool: the rows still generating. The other rows stay in their
        slots as exact zeros through the whole network (zero embedding, zero attention output, no
        expert), so they change no other row's activation scales and their outputs are never read.
        ``device_dispatch``: run the experts' capturable path (device-side sort, grouped GEMMs);
        else their host-synced reference path. ``cache.pos`` / ``row_pos`` are advanced by the caller.
        """
        cfg = self.config
        cache.key_mask.index_fill_(1, cache.pos, True)
        x = torch.where(rows[:, None, None], self.model.embed_tokens(tokens[:, None]), 0.0)  # [B, 1, H]
        cos, sin = rope_cos_sin(cache.row_pos[:, None], cfg.head_dim, cfg.rope_theta, x.dtype)
        mask = cache.key_mask[:, None, None, :]  # [B, 1, 1, S]
        record = []
        for layer in self.model.layers:
            x, top_i, _ = layer(x, cos, sin, mask, cache, None, rows, device_dispatch)
            record.append(top_i)
        logits = self.lm_head(self.model.norm(x))[:, 0]
        return logits, torch.stack(record)
