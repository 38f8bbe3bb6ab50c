"""Precision recipes and the layers that carry them (QAT, W4A4 + RAC, FP8), model swapping, weight sync."""

from quads.quant.apply import (
    QuantSummary,
    calibrate_static_channels,
    dequantize_model,
    quantize_model,
    quantized_modules,
    refresh_quantized,
)
from quads.quant.diagnostics import layer_errors, recipe_layer_errors
from quads.quant.fp8_linear import fp8_linear
from quads.quant.layers import QuantizedExperts, QuantizedLinear
from quads.quant.qat import qat_linear, ste_linear
from quads.quant.rac import StaticChannelSelector, rac_channels
from quads.quant.recipe import (
    PRESETS,
    FP8ActConfig,
    FP8WeightConfig,
    LinearSpec,
    NVFP4ActConfig,
    NVFP4WeightConfig,
    Recipe,
    get_recipe,
)
from quads.quant.sync import SyncReport, WeightSyncError, fingerprint, sync_weights, verify_sync
from quads.quant.w4a4 import w4a4_linear

__all__ = [
    "PRESETS",
    "FP8ActConfig",
    "FP8WeightConfig",
    "LinearSpec",
    "NVFP4ActConfig",
    "NVFP4WeightConfig",
    "QuantSummary",
    "QuantizedExperts",
    "QuantizedLinear",
    "Recipe",
    "StaticChannelSelector",
    "SyncReport",
    "WeightSyncError",
    "calibrate_static_channels",
    "dequantize_model",
    "fingerprint",
    "fp8_linear",
    "get_recipe",
    "layer_errors",
    "recipe_layer_errors",
    "qat_linear",
    "quantize_model",
    "quantized_modules",
    "rac_channels",
    "refresh_quantized",
    "ste_linear",
    "sync_weights",
    "verify_sync",
    "w4a4_linear",
]
