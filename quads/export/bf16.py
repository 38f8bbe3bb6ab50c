"""Plain BF16 Hugging Face folder (no ``quantization_config``): loads in transformers, vLLM, SGLang.

By default every tensor is the master weight cast to BF16. With ``qdq=True`` the targeted linears hold
the rollout's NVFP4 weights dequantized to BF16 (``(e2m1 * s) * S_dec``, exact in BF16), i.e. the weights
a W4A16-QAT trainer computes with: a BF16 engine then reproduces the trainer's forward.
"""

from __future__ import annotations

from typing import Any

import torch

from quads.export.plan import ExportPlan, QuantLinear

NAME = "bf16"
NATIVE_MODE = None  # no NVFP4 quantizer involved


def linear_tensors(q: QuantLinear, w4a4: bool) -> dict[str, torch.Tensor]:
    return {f"{q.name}.weight": q.dequantize(torch.bfloat16)}


def quantization_config(plan: ExportPlan, w4a4: bool, linear_names: list[str]) -> dict[str, Any] | None:
    return None


def extra_files(plan: ExportPlan, w4a4: bool, linear_names: list[str]) -> dict[str, Any]:
    return {}
