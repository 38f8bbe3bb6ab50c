"""NVIDIA ModelOpt unified Hugging Face checkpoint (``quant_algo: NVFP4`` / ``W4A16_NVFP4``), as written by
``modelopt.torch.export.export_hf_checkpoint`` and loaded by vLLM / SGLang / TensorRT-LLM.

Per quantized linear ``{name}`` (checked against modelopt 0.47 ``NVFP4QTensor`` and its export):

- ``{name}.weight``          uint8 [N, K/2], element 2i in the low nibble (same as quads);
- ``{name}.weight_scale``    float8_e4m3fn [N, K/16];
- ``{name}.weight_scale_2``  float32 [], the DECODE global scale (``w = e2m1 * s * weight_scale_2``),
  i.e. quads' S_dec as it is;
- ``{name}.input_scale``     float32 [], W4A4 only: the activation decode scale amax / 2688.

``hf_quant_config.json`` holds ``{"producer", "quantization": {quant_algo, kv_cache_quant_algo,
group_size, exclude_modules}}``; config.json's ``quantization_config`` is the same information in the
converted form modelopt writes (``quant_method: modelopt``, config_groups, ignore).
"""

from __future__ import annotations

from typing import Any

import torch

from quads.export.plan import ExportPlan, QuantLinear
from quads.formats.constants import NVFP4_BLOCK, NVFP4_GLOBAL_ENCODE_NUMERATOR

NAME = "modelopt"
NATIVE_MODE = "modelopt"
PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the export layout we follow


def linear_tensors(q: QuantLinear, w4a4: bool) -> dict[str, torch.Tensor]:
    out = {
        f"{q.name}.weight": q.codes,
        f"{q.name}.weight_scale": q.scales,
        f"{q.name}.weight_scale_2": q.global_scale.float().reshape(()).clone(),
    }
    if w4a4:
        if q.input_amax is None:
            raise ValueError(f"{q.name}: W4A4 export needs a calibrated input amax; run calibration first")
        amax = q.input_amax.float().reshape(())
        out[f"{q.name}.input_scale"] = torch.where(amax > 0, amax / NVFP4_GLOBAL_ENCODE_NUMERATOR,
                                                   torch.ones_like(amax))
    return out


def hf_quant_config(plan: ExportPlan, w4a4: bool, linear_names: list[str]) -> dict[str, Any]:
    quantized = {q.name for q in plan.quantized}
    return {
        "producer": dict(PRODUCER),
        "quantization": {
            "quant_algo": "NVFP4" if w4a4 else "W4A16_NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": NVFP4_BLOCK,
            "exclude_modules": sorted(n for n in linear_names if n not in quantized),
        },
    }


def quantization_config(plan: ExportPlan, w4a4: bool, linear_names: list[str]) -> dict[str, Any]:
    """modelopt's ``convert_hf_quant_config_format`` output for one NVFP4 algorithm."""
    hq = hf_quant_config(plan, w4a4, linear_names)
    q = hq["quantization"]
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK}
    group: dict[str, Any] = {}
    if w4a4:
        group["input_activations"] = dict(weights)
    group["weights"] = weights
    group["targets"] = ["Linear"]
    return {
        "config_groups": {"group_0": group},
        "ignore": q["exclude_modules"],
        "quant_algo": q["quant_algo"],
        "producer": hq["producer"],
        "quant_method": "modelopt",
    }


def extra_files(plan: ExportPlan, w4a4: bool, linear_names: list[str]) -> dict[str, Any]:
    return {"hf_quant_config.json": hf_quant_config(plan, w4a4, linear_names)}
