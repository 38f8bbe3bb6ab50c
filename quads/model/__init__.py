"""The built-in MoE transformer (Qwen3-MoE layout), its checkpoints, tokenizers and the HF adapter."""

from quads.model.attention import KVCache
from quads.model.config import PRESETS, ModelConfig
from quads.model.moe import MoEExperts
from quads.model.transformer import ModelOutput, MoEForCausalLM, positions_from_mask

__all__ = ["PRESETS", "KVCache", "ModelConfig", "ModelOutput", "MoEExperts", "MoEForCausalLM",
           "positions_from_mask"]
