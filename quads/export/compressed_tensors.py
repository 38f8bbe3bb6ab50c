"""compressed-tensors ``nvfp4-pack-quantized``: the format vLLM and SGLang load with ``quant_method:
compressed-tensors`` (llm-compressor's NVFP4 / NVFP4A16 schemes).

Per quantized linear ``{name}`` (checked against compressed-tensors 0.20 ``NVFP4PackedCompressor`` and vLLM's
``CompressedTensorsW4A4Fp4`` / ``CompressedTensorsW4A16Fp4``):

- ``{name}.weight_packed``        uint8 [N, K/2], element 2i in the low nibble (same as quads);
- ``{name}.weight_scale``         float8_e4m3fn [N, K/16], the block scales as they are;
- ``{name}.weight_global_scale``  float32 [1], the ENCODE scale G (compressed-tensors divides by it:
  ``w = e2m1 * (s / G)``; vLLM computes ``1 / G`` in fp32). G is chosen so that ``fp32(1 / G)`` is exactly
  quads' decode scale S_dec, so vLLM's ``alpha`` carries the rollout's bits;
- ``{name}.input_global_scale``   float32 [1], W4A4 only: the activation encode scale 2688 / amax (amax
  calibrated, see ``quads.export.calibrate``); vLLM quantizes activations dynamically per 16-block under it.

transformers (5.19 and 5.24 checked) loads MoE experts into its fused ``gate_up_proj`` [E, 2I, H] /
``down_proj`` [E, H, I] parameters through ``CompressedTensorsDequantize``, which decompresses each expert from
``weight_packed``, ``weight_scale`` and ``weight_shape`` only: the ``weight_global_scale`` is dropped, so every
expert comes back as ``e2m1 * s`` (the weight divided by S_dec, about 1e4 too large), silently
(huggingface/transformers#48371). No naming or layout avoids that path while keeping NVFP4 experts, so
``check_transformers_loadable`` refuses such an export unless it is meant for serving engines only.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from quads.export.plan import ExportPlan, QuantLinear
from quads.formats.constants import NVFP4_BLOCK, NVFP4_GLOBAL_ENCODE_NUMERATOR

NAME = "compressed-tensors"
NATIVE_MODE = "compressed_tensors"  # the quantizer llm-compressor / compressed-tensors would have used
FORMAT = "nvfp4-pack-quantized"


_EXPERT_PIECE = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")


def check_transformers_loadable(plan: ExportPlan) -> None:
    """Raise ``ValueError`` when transformers would load the plan's NVFP4 experts with wrong scales (module doc)."""
    experts = [q.name for q in plan.quantized if _EXPERT_PIECE.search(q.name)]
    if experts:
        raise ValueError(
            f"--format compressed-tensors with {len(experts)} NVFP4 expert linears (e.g. {experts[0]}): transformers "
            "decompresses per-expert NVFP4 weights without their weight_global_scale (huggingface/transformers#48371) "
            "and would load wrong expert weights without an error. For vLLM / SGLang pass --engines-only; for "
            "transformers use --format bf16 --qdq; or leave the experts out of --targets"
        )


def encode_global_scale(s_dec: torch.Tensor) -> torch.Tensor:
    """The fp32 G with ``fp32(1 / G) == S_dec`` (searched among 1/S_dec and its nearest fp32 neighbours)."""
    s_dec = s_dec.float().reshape(())
    g = (1.0 / s_dec).reshape(())
    cands = [g]
    up, down = g, g
    for _ in range(4):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        cands += [up, down]
    for c in cands:
        if torch.equal(1.0 / c, s_dec):
            return c.reshape(1)
    raise ValueError(f"no fp32 encode scale G has 1/G == {s_dec.item()!r}; this global scale cannot be written "
                     "bit-exactly in compressed-tensors' convention (use --format modelopt, which stores S_dec)")


def activation_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """2688 / amax in fp32 (1.0 for amax == 0), shape [1]."""
    a = amax.float().reshape(1)
    return torch.where(a > 0, NVFP4_GLOBAL_ENCODE_NUMERATOR / a, torch.ones_like(a))


def linear_tensors(q: QuantLinear, w4a4: bool) -> dict[str, torch.Tensor]:
    out = {
        f"{q.name}.weight_packed": q.codes,
        f"{q.name}.weight_scale": q.scales,
        f"{q.name}.weight_global_scale": encode_global_scale(q.global_scale),
    }
    if w4a4:
        if q.input_amax is None:
            raise ValueError(f"{q.name}: W4A4 export needs a calibrated input amax; run calibration first")
        out[f"{q.name}.input_global_scale"] = activation_encode_scale(q.input_amax)
    return out


def _args(dynamic: Any, observer: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": NVFP4_BLOCK,
                         "strategy": "tensor_group", "dynamic": dynamic, "scale_dtype": "torch.float8_e4m3fn"}
    if observer:
        d["observer"] = observer
    return d


def quantization_config(plan: ExportPlan, w4a4: bool, linear_names: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of config.json: one group targeting ``Linear``, every linear that is
    not quantized listed by name in ``ignore`` (as llm-compressor writes it)."""
    quantized = {q.name for q in plan.quantized}
    return {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": _args(False),
            "input_activations": _args("local", "static_minmax") if w4a4 else None,
            "output_activations": None,
            "format": FORMAT,
        }},
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": FORMAT,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": sorted(n for n in linear_names if n not in quantized),
    }


def extra_files(plan: ExportPlan, w4a4: bool, linear_names: list[str]) -> dict[str, Any]:
    return {}
