"""``ModelConfig``: the shape of the built-in MoE decoder (Qwen3-MoE style) and its presets.

The same config describes Hugging Face Qwen3-MoE, OLMoE and Mixtral checkpoints once mapped by
``quads.model.hf``: they differ only in q/k normalisation (``qk_norm``), whether the top-k router
weights are renormalised (``norm_topk_prob``) and a few sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

NVFP4_BLOCK = 16  # NVFP4 block length along K: every quantized in-feature dim must be a multiple of it

# the project's one map of dtype names (configs, checkpoints, CLI flags) to torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "float16": torch.float16}


@dataclass
class ModelConfig:
    vocab_size: int = 128  # V; >= the tokenizer's vocab size (extra ids are never produced by a trained model)
    hidden_size: int = 128  # H
    n_layers: int = 4  # decoder layers, every one an MoE layer
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (GQA); divides n_heads
    head_dim: int = 32  # per-head dim (even: RoPE rotates pairs); n_heads*head_dim need not equal H
    n_experts: int = 8  # E routed experts per layer
    top_k: int = 2  # k experts per token
    moe_intermediate_size: int = 128  # I, per routed expert (SwiGLU)
    shared_expert_intermediate_size: int = 0  # shared (always-on) SwiGLU expert width; 0 = none
    shared_expert_gate: bool = False  # Qwen2-MoE style sigmoid gate on the shared expert output
    norm_topk_prob: bool = True  # renormalise the k softmax weights to sum to 1 (Qwen3/Mixtral yes, OLMoE no)
    qk_norm: Literal["none", "head", "full"] = "head"  # RMSNorm on q/k: per head (Qwen3), full width (OLMoE), none (Mixtral)
    rope_theta: float = 10000.0  # RoPE base
    rms_norm_eps: float = 1e-6
    max_seq_len: int = 512  # longest prompt + response the rollout KV cache is sized for
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens.weight
    router_aux_loss_coef: float = 0.0  # Switch-style load-balance loss weight; 0 = not computed
    init_std: float = 0.02  # normal init std; residual output projections get init_std / sqrt(2 * n_layers)
    dtype: Literal["float32", "bfloat16", "float64", "float16"] = "float32"  # parameter (= compute) dtype
    architecture: str = field(default="quads_moe")  # "quads_moe" or the HF model_type it was loaded from

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "n_experts", "top_k", "moe_intermediate_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % NVFP4_BLOCK:
                raise ValueError(
                    f"ModelConfig.{name} must be a multiple of {NVFP4_BLOCK} so NVFP4 blocks fit along K; "
                    f"got {getattr(self, name)}"
                )
        if self.shared_expert_intermediate_size < 0 or self.shared_expert_intermediate_size % NVFP4_BLOCK:
            raise ValueError(
                "ModelConfig.shared_expert_intermediate_size must be 0 (none) or a positive multiple of "
                f"{NVFP4_BLOCK}; got {self.shared_expert_intermediate_size}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be 'none', 'head' or 'full', got {self.qk_norm!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named size (see ``PRESETS``) with field overrides, e.g. ``preset("tiny", n_layers=2)``."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}; valid fields are {sorted(names)}")
        return cls(**data)

    def num_params(self) -> dict[str, int]:
        """Parameter counts by group, computed from the shapes (no model is built).

        ``total`` counts every stored parameter; ``active`` those a token touches (k of E experts).
        """
        H, L, D = self.hidden_size, self.n_layers, self.head_dim
        q, kv = self.n_heads * D, self.n_kv_heads * D
        attn = H * q + 2 * H * kv + q * H
        attn += {"none": 0, "head": 2 * D, "full": q + kv}[self.qk_norm]
        expert = 3 * H * self.moe_intermediate_size
        shared = 3 * H * self.shared_expert_intermediate_size + (H if self.shared_expert_gate else 0)
        router = H * self.n_experts
        norms = 2 * H
        embed = self.vocab_size * H
        head = 0 if self.tie_word_embeddings else self.vocab_size * H
        per_layer = attn + self.n_experts * expert + shared + router + norms
        total = embed + head + H + L * per_layer
        active = total - L * (self.n_experts - self.top_k) * expert
        return {"total": total, "active": active, "experts": L * self.n_experts * expert,
                "attention": L * attn, "embedding": embed + head}


# Sizes: `tiny` trains on 2 CPU cores in a minute or two; the others are GPU sizes (the test prints counts).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=8, top_k=2,
                 moe_intermediate_size=128, max_seq_len=512),  # ~1.8M params
    "small": dict(hidden_size=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, n_experts=16, top_k=2,
                  moe_intermediate_size=256, max_seq_len=1024),  # ~20M
    "100m": dict(hidden_size=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, n_experts=32, top_k=4,
                 moe_intermediate_size=256, max_seq_len=2048, dtype="bfloat16"),  # ~107M
    "500m": dict(hidden_size=1024, n_layers=12, n_heads=16, n_kv_heads=4, head_dim=64, n_experts=32, top_k=4,
                 moe_intermediate_size=384, max_seq_len=2048, dtype="bfloat16"),  # ~485M
    "1b": dict(hidden_size=1024, n_layers=20, n_heads=16, n_kv_heads=4, head_dim=64, n_experts=64, top_k=8,
               moe_intermediate_size=256, max_seq_len=4096, dtype="bfloat16"),  # ~1.07B
}
