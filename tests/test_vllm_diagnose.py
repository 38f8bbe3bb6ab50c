"""``quads diagnose --rollout-backend vllm``: the decomposition with vLLM as the rollout side.

Needs the optional vLLM extra (see docs/VLLM.md); skipped with the reason otherwise. Float32, so the
BF16-recipe row is vLLM's own engine drift (tiny) and a quantized row must stand far above it.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from quads.rollout.vllm import vllm_available

_OK, _WHY = vllm_available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY)


def test_diagnose_with_vllm_rollouts(tmp_path):
    from quads.experiments.diagnose import DiagnoseConfig, decompose
    from quads.model.checkpoint import save_checkpoint
    from quads.model.config import ModelConfig
    from quads.model.tokenizer import CharTokenizer
    from quads.model.transformer import MoEForCausalLM

    torch.manual_seed(0)
    tok = CharTokenizer()
    cfg = ModelConfig.preset("tiny", n_layers=2, dtype="float32", vocab_size=tok.vocab_size, init_std=0.08)
    save_checkpoint(MoEForCausalLM(cfg), tmp_path / "ckpt", tokenizer=tok)
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({
        "rollout": {"bf16": {}, "w4a4": {"weight": "nvfp4", "act": "nvfp4"}},
        "trainer": {"bf16": {}},
    }))
    dcfg = DiagnoseConfig(checkpoint=str(tmp_path / "ckpt"), prompts=2, n_samples=2, max_new_tokens=8,
                          dtype="float32", master_dtype="float32", layer_errors=False, recipe_grid=str(grid),
                          rollout_backend="vllm", out_dir=str(tmp_path / "out"))
    result = decompose(dcfg, say=lambda s: None)
    rows = {r["rollout"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "w4a4"}
    floor, w4a4 = rows["bf16"]["gap_mean"], rows["w4a4"]["gap_mean"]
    assert floor < 1e-3, f"vLLM BF16-recipe (float32) vs trainer mean gap {floor} should be kernel noise"
    assert w4a4 > 20 * max(floor, 1e-6), f"W4A4 gap {w4a4} should stand far above the vLLM floor {floor}"
    assert all(math.isnan(r["routing_diff"]) for r in rows.values()), "vLLM returns no expert ids on CPU"
    assert rows["w4a4"]["tokens"] > 0
