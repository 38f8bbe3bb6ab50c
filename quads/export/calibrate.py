"""Activation amax for W4A4 exports (the static activation global scale engines need).

The rollout measures the activation global scale dynamically (per tensor or per token, per batch);
serving engines want ONE static FP32 activation global scale per linear (compressed-tensors
``input_global_scale`` = 2688 / amax, ModelOpt ``input_scale`` = amax / 2688) and compute block scales
dynamically under it. We run the exported model (transformers Qwen3-MoE with the NVFP4 weights
dequantized, BF16 activations) over a calibration batch and record, per MoE layer:

- gate/up input amax = max |hidden states entering the experts| (every token reaches k experts);
- down input amax = max |silu(gate) * up| over the (token, expert) pairs the router picked;

and for other targeted linears the max |input|. All experts of a layer get the layer's value: vLLM
reduces the per-expert input scales of a FusedMoE to one anyway. Without ``--calib-data`` the batch is
uniform random token ids (seeded): scales then reflect the model's activation range, not a task's.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from quads.export.plan import ExportPlan

_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.\d+\.(?P<kind>gate_proj|up_proj|down_proj)$")


def calibration_ids(hf_config: dict[str, Any], data: Path | None, n_tokens: int, seed: int,
                    tokenizer_files: dict[str, bytes]) -> torch.Tensor:
    """[B, L] token ids: lines of ``data`` tokenized with the checkpoint's tokenizer, or random ids."""
    if data is None:
        g = torch.Generator().manual_seed(seed)
        seq = min(64, n_tokens)
        return torch.randint(0, hf_config["vocab_size"], (max(1, n_tokens // seq), seq), generator=g)
    if "tokenizer.json" not in tokenizer_files and "tokenizer.model" not in tokenizer_files:
        raise ValueError("--calib-data needs the checkpoint's tokenizer files; none were found")
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, blob in tokenizer_files.items():
            (Path(tmp) / name).write_bytes(blob)
        tok = AutoTokenizer.from_pretrained(tmp)
    lines = [ln for ln in Path(data).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"--calib-data {data} has no non-empty lines")
    ids = [torch.tensor(tok.encode(ln)[:256]) for ln in lines]
    return torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)


def build_hf_model(hf_config: dict[str, Any], sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers ``Qwen3MoeForCausalLM`` holding ``sd`` (fused expert names, as in transformers 5)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict({k: v.to(torch.bfloat16) for k, v in sd.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.get("tie_word_embeddings"))]
    if missing or unexpected:
        raise ValueError(f"state dict does not match Qwen3-MoE: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.eval()


@torch.no_grad()
def calibrate(plan: ExportPlan, sd: dict[str, torch.Tensor], hf_config: dict[str, Any],
              ids: torch.Tensor) -> dict[str, float]:
    """Fill ``input_amax`` of every ``plan.quantized`` linear; returns {linear name: amax}."""
    weights = dict(sd)
    for key, q in plan.sources.items():
        weights[key] = q.dequantize(torch.bfloat16)
    model = build_hf_model(hf_config, weights)
    amax: dict[str, float] = {}

    def bump(name: str, x: torch.Tensor) -> None:
        if x.numel():
            amax[name] = max(amax.get(name, 0.0), float(x.detach().float().abs().amax()))

    hooks = []
    wanted = {q.name for q in plan.quantized}
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts"):
            def experts_hook(mod, args, kwargs, name=name):
                hidden = args[0] if args else kwargs["hidden_states"]
                idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
                bump(name + ".in", hidden)
                for e in idx.unique().tolist():
                    tok = (idx == e).any(dim=-1)
                    g, u = F.linear(hidden[tok], mod.gate_up_proj[e]).chunk(2, dim=-1)
                    bump(name + ".mid", F.silu(g) * u)
            hooks.append(mod.register_forward_pre_hook(experts_hook, with_kwargs=True))
        elif name in wanted:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, name=name: bump(name, a[0])))
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, float] = {}
    for q in plan.quantized:
        m = _EXPERT.match(q.name)
        key = q.name if m is None else m["layer"] + (".mid" if m["kind"] == "down_proj" else ".in")
        if key not in amax:
            raise ValueError(f"calibration never reached {q.name}; give more calibration tokens")
        q.input_amax = torch.tensor(amax[key], dtype=torch.float32)
        out[q.name] = amax[key]
    return out
