"""Read an exported (or third-party) NVFP4 / BF16 Hugging Face folder back for evaluation and training.

``load_exported(folder) -> (model, tokenizer, ImportInfo)``. Quantized linears are dequantized to BF16
master weights with quads' decode ``(e2m1 * s) * S_dec`` (S_dec = 1 / weight_global_scale for
compressed-tensors, = weight_scale_2 for ModelOpt); per-expert linears are fused back into
``experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]. ``ImportInfo.quantized`` keeps the exact
NVFP4 tensors (codes, block scales, global scale; one per fused parameter) so a recipe can keep the
same bits instead of re-quantizing the BF16 weights (re-quantizing is not always idempotent: the
re-measured amax can move the global scale; ``ImportInfo.requantize_exact`` says where it is).

Supported: compressed-tensors ``nvfp4-pack-quantized`` (group 16, symmetric, tensor_group), ModelOpt
``NVFP4`` / ``W4A16_NVFP4``, unquantized folders. Other schemes raise ``ValueError``.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quads.export.plan import QuantSpec, quantize_weight
from quads.export.source import TOKENIZER_FILES, fuse_experts, load_state_dict
from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK, NVFP4_GLOBAL_ENCODE_NUMERATOR

_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)$")


@dataclass
class ImportInfo:
    format: str  # compressed-tensors | modelopt | bf16
    scheme: str | None  # W4A16 | W4A4 | None
    quantized: dict[str, nvfp4.NVFP4Tensor] = field(default_factory=dict)  # fused param name -> exact bits
    input_amax: dict[str, float] = field(default_factory=dict)  # linear name -> static activation amax
    requantize_exact: dict[str, bool] = field(default_factory=dict)  # quantize(dequantize(q)) == q ?
    metadata: dict[str, Any] = field(default_factory=dict)  # quads_export.json when quads wrote the folder
    model_class: str = ""


@dataclass
class _Linear:
    codes: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # e4m3 [N, K/16]
    s_dec: torch.Tensor  # fp32 []


def _detect(config: dict[str, Any], folder: Path) -> str:
    qc = config.get("quantization_config")
    if qc is None:
        return "modelopt" if (folder / "hf_quant_config.json").is_file() else "bf16"
    method = qc.get("quant_method")
    if method not in ("compressed-tensors", "modelopt"):
        raise ValueError(f"{folder}: quant_method {method!r} is not supported; expected compressed-tensors or modelopt")
    return method


def _check_ct(qc: dict[str, Any]) -> str:
    scheme = "W4A16"
    for gname, g in qc.get("config_groups", {}).items():
        w = g.get("weights") or {}
        fmt = g.get("format") or qc.get("format")
        if fmt != "nvfp4-pack-quantized" or w.get("num_bits") != 4 or w.get("type") != "float" \
                or w.get("group_size") != NVFP4_BLOCK or not w.get("symmetric", True):
            raise ValueError(f"compressed-tensors group {gname}: expected nvfp4-pack-quantized 4-bit float weights "
                             f"with group_size {NVFP4_BLOCK}, got format {fmt!r}, weights {w}")
        if g.get("input_activations"):
            scheme = "W4A4"
    return scheme


def _ct_linears(sd: dict[str, torch.Tensor]) -> tuple[dict[str, _Linear], dict[str, float]]:
    lin, amax = {}, {}
    for k in [k for k in sd if k.endswith(".weight_packed")]:
        name = k.removesuffix(".weight_packed")
        g = sd.pop(f"{name}.weight_global_scale").float().reshape(())
        lin[name] = _Linear(sd.pop(k), sd.pop(f"{name}.weight_scale"), (1.0 / g).reshape(()))
        igs = sd.pop(f"{name}.input_global_scale", None)
        if igs is not None:
            amax[name] = float(NVFP4_GLOBAL_ENCODE_NUMERATOR / igs.float().reshape(()))
    return lin, amax


def _modelopt_linears(sd: dict[str, torch.Tensor]) -> tuple[dict[str, _Linear], dict[str, float]]:
    lin, amax = {}, {}
    for k in [k for k in sd if k.endswith(".weight_scale_2")]:
        name = k.removesuffix(".weight_scale_2")
        w = sd.pop(f"{name}.weight")
        if w.dtype != torch.uint8:
            raise ValueError(f"{name}.weight: expected packed uint8 NVFP4 codes, got {w.dtype}")
        lin[name] = _Linear(w, sd.pop(f"{name}.weight_scale"), sd.pop(k).float().reshape(()))
        inp = sd.pop(f"{name}.input_scale", None)
        if inp is not None:
            amax[name] = float(inp.float().reshape(()) * NVFP4_GLOBAL_ENCODE_NUMERATOR)
    return lin, amax


def _as_tensor(lin: _Linear) -> nvfp4.NVFP4Tensor:
    n, k2 = lin.codes.shape
    return nvfp4.NVFP4Tensor(lin.codes, lin.scales.to(torch.float8_e4m3fn), lin.s_dec,
                             torch.Size((n, 2 * k2)), torch.bfloat16)


def _fuse_quantized(lin: dict[str, _Linear]) -> dict[str, nvfp4.NVFP4Tensor]:
    """Per-linear tensors -> one NVFP4Tensor per state-dict parameter (experts fused along E)."""
    out: dict[str, nvfp4.NVFP4Tensor] = {}
    experts: dict[str, dict[str, dict[int, _Linear]]] = {}
    for name, q in lin.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name + ".weight"] = _as_tensor(q)
        else:
            experts.setdefault(m["prefix"], {}).setdefault(m["kind"], {})[int(m["e"])] = q
    for prefix, kinds in experts.items():
        n = len(kinds.get("down_proj", {}))
        for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            if not all(len(kinds.get(p, {})) == n for p in parts):
                raise ValueError(f"{prefix}: only some experts' {parts} are quantized; cannot fuse them")
            if n == 0:
                continue
            per = [[kinds[p][e] for p in parts] for e in range(n)]
            codes = torch.stack([torch.cat([x.codes for x in ls]) for ls in per])
            scales = torch.stack([torch.cat([x.scales for x in ls]) for ls in per]).to(torch.float8_e4m3fn)
            rows = torch.stack([torch.cat([x.s_dec.reshape(1).expand(x.codes.shape[0]) for x in ls]) for ls in per])
            if bool((rows == rows.reshape(-1)[0]).all()):
                gs = rows.reshape(-1)[0].clone()  # one scale for the stack
            elif bool((rows == rows[:, :1]).all()):
                gs = rows[:, :1].unsqueeze(-1).clone()  # [E, 1, 1]: one per expert (the quads rollout)
            else:
                gs = rows.unsqueeze(-1).clone()  # [E, 2I, 1]: gate and up quantized with separate scales
            out[f"{prefix}.{fused}"] = nvfp4.NVFP4Tensor(codes, scales, gs, torch.Size((*codes.shape[:-1],
                                                         2 * codes.shape[-1])), torch.bfloat16)
    return out


def read_exported(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], ImportInfo]:
    """(BF16 state dict with fused experts, config.json without quantization_config, ImportInfo)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json; expected a Hugging Face model folder")
    config = json.loads((folder / "config.json").read_text())
    fmt = _detect(config, folder)
    sd = load_state_dict(folder)
    if not sd:
        raise ValueError(f"{folder}: no *.safetensors files")
    scheme = None
    if fmt == "compressed-tensors":
        scheme = _check_ct(config["quantization_config"])
        lin, amax = _ct_linears(sd)
    elif fmt == "modelopt":
        lin, amax = _modelopt_linears(sd)
        scheme = "W4A4" if amax else "W4A16"
    else:
        lin, amax = {}, {}
    quantized = _fuse_quantized(lin)
    sd = fuse_experts(sd)
    meta_path = folder / "quads_export.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    nv = meta.get("nvfp4") or {}
    mode, tile = nv.get("mode", "te"), tuple(nv.get("tile", (1, 16)))
    exact = {}
    for key, q in quantized.items():
        if key in sd:
            raise ValueError(f"{folder}: {key} is stored both quantized and dense")
        w = nvfp4.dequantize(q, torch.bfloat16)
        sd[key] = w
        re_q = quantize_weight(w, QuantSpec(mode=mode, tile=tile))
        same_g = torch.equal(*torch.broadcast_tensors(re_q.global_scale.float(), q.global_scale.float()))
        exact[key] = bool(torch.equal(re_q.codes, q.codes) and same_g
                          and torch.equal(re_q.scales.view(torch.uint8), q.scales.view(torch.uint8)))
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    info = ImportInfo(fmt, scheme if lin else None, quantized, amax, exact, meta)
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}, config, info


def _load_tokenizer(folder: Path) -> Any:
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def load_exported(folder: str | Path, *, model_class: str = "auto") -> tuple[Any, Any, ImportInfo]:
    """Load ``folder`` as a BF16 model.

    ``model_class``: ``quads`` (the built-in ``MoEForCausalLM`` through ``quads.model.hf.load_hf_model``),
    ``transformers`` (``Qwen3MoeForCausalLM``) or ``auto`` (quads when ``quads.model.hf`` is importable).
    """
    folder = Path(folder)
    sd, config, info = read_exported(folder)
    use_quads = model_class == "quads"
    if model_class == "auto":
        try:
            from quads.model.hf import load_hf_model  # noqa: F401

            use_quads = True
        except ImportError:
            use_quads = False
    if use_quads:
        from safetensors.torch import save_file

        from quads.model.hf import load_hf_model

        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            save_file({k: v.contiguous() for k, v in sd.items()}, str(t / "model.safetensors"))
            (t / "config.json").write_text(json.dumps(config))
            for n in TOKENIZER_FILES:
                if (folder / n).is_file():
                    (t / n).write_bytes((folder / n).read_bytes())
            model, tokenizer = load_hf_model(t)
        info.model_class = type(model).__name__
        return model, tokenizer, info
    from quads.export.calibrate import build_hf_model

    model = build_hf_model(config, sd)
    info.model_class = type(model).__name__
    return model, _load_tokenizer(folder), info
