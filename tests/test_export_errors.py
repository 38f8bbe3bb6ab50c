"""quads export from a ``quads train`` run folder, bad input, and atomic output (no half-written folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from quads.export import ExportConfig, export, load_exported
from quads.export import writer as export_writer
from quads.formats import nvfp4
from quads.model.checkpoint import save_checkpoint
from quads.model.config import ModelConfig
from quads.model.tokenizer import CharTokenizer
from quads.model.transformer import MoEForCausalLM
from quads.quant.ops import nvfp4_quantize_weight


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=100, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=2,
                top_k=1, moe_intermediate_size=32, max_seq_len=32)
    return ModelConfig(**(base | kw))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished run: config.yaml (recipe w4a16-qat with 16x16 tiles) + policy/ (save_checkpoint)."""
    run = tmp_path_factory.mktemp("runs") / "run"
    torch.manual_seed(0)
    model = MoEForCausalLM(_cfg())
    save_checkpoint(model, run / "policy", extra={"recipe": "w4a16-qat", "step": 3}, tokenizer=CharTokenizer())
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"recipe": {"name": "w4a16-qat", "weight_tile": "16x16"}}))
    return run


def _no_leftovers(parent: Path, name: str) -> bool:
    return not any(p.name.startswith(f".{name}.tmp-") for p in parent.iterdir())


def test_run_folder_exports_the_rollout_bits_with_the_run_recipe(run_dir, tmp_path):
    res = export(ExportConfig(checkpoint=str(run_dir), out=str(tmp_path / "ct"), format="compressed-tensors",
                              engines_only=True))
    meta = json.loads((res.out / "quads_export.json").read_text())
    assert meta["recipe"] == "w4a16-qat" and meta["nvfp4"]["tile"] == [16, 16]
    assert Path(meta["source"]) == run_dir / "policy"
    assert (res.out / "tokenizer.json").is_file()  # the char tokenizer as a tokenizers file
    assert json.loads((res.out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    master = load_file(str(run_dir / "policy" / "model.safetensors"))["model.layers.0.mlp.experts.down_proj"]
    q = nvfp4_quantize_weight(master.to(torch.bfloat16), tile=(16, 16))
    sd = load_file(str(res.out / "model.safetensors"))
    for e in range(2):
        assert torch.equal(sd[f"model.layers.0.mlp.experts.{e}.down_proj.weight_packed"], q.codes[e])
        assert torch.equal(sd[f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale"].view(torch.uint8),
                           q.scales[e].view(torch.uint8))
    model, tok, info = load_exported(res.out)
    assert tok is not None and tok.encode("12+3") == CharTokenizer().encode("12+3")
    w = model.state_dict()["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(w, nvfp4.dequantize(q, torch.bfloat16).to(w.dtype))
    assert all(info.requantize_exact.values())


def test_unfinished_run_is_a_clear_error(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: {name: quads}\n")
    with pytest.raises(ValueError, match="no exportable checkpoint"):
        export(ExportConfig(checkpoint=str(run), out=str(tmp_path / "o"), format="modelopt"))
    assert not (tmp_path / "o").exists() and _no_leftovers(tmp_path, "o")


def test_unknown_format_and_bad_flags():
    with pytest.raises(ValueError, match="unknown --format"):
        ExportConfig(checkpoint="x", out="y", format="gguf")
    with pytest.raises(ValueError, match="--format bf16 has no activation"):
        ExportConfig(checkpoint="x", out="y", format="bf16", activations="nvfp4")


def test_layer_that_cannot_be_packed(tmp_path):
    torch.manual_seed(0)
    model = MoEForCausalLM(_cfg(head_dim=8, n_heads=3, n_kv_heads=1))  # o_proj K = 24, not a multiple of 16
    save_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="not a multiple of 16"):
        export(ExportConfig(checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "o"), format="compressed-tensors",
                            targets=("*.mlp.experts", "*.self_attn.o_proj"), engines_only=True))
    assert not (tmp_path / "o").exists() and _no_leftovers(tmp_path, "o")


def test_fused_linears_with_different_global_scales_are_refused(run_dir, tmp_path):
    with pytest.raises(ValueError, match="vLLM fuses them"):
        export(ExportConfig(checkpoint=str(run_dir / "policy"), out=str(tmp_path / "o"), format="modelopt",
                            targets=("*.self_attn.*",)))


def test_failure_mid_write_leaves_no_folder_and_keeps_the_old_one(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "o"
    calls = {"n": 0}
    real = export_writer.write_json

    def flaky(path, obj):
        calls["n"] += 1
        if calls["n"] == 2:  # config.json written, hf_quant_config.json fails
            raise OSError("disk full")
        real(path, obj)

    monkeypatch.setattr("quads.export.write_json", flaky)
    with pytest.raises(OSError, match="disk full"):
        export(ExportConfig(checkpoint=str(run_dir), out=str(out), format="modelopt"))
    assert not out.exists() and _no_leftovers(tmp_path, "o")
    monkeypatch.setattr("quads.export.write_json", real)
    export(ExportConfig(checkpoint=str(run_dir), out=str(out), format="modelopt"))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="already exists"):
        export(ExportConfig(checkpoint=str(run_dir), out=str(out), format="bf16"))
    calls["n"] = 0
    monkeypatch.setattr("quads.export.write_json", flaky)
    with pytest.raises(OSError):
        export(ExportConfig(checkpoint=str(run_dir), out=str(out), format="modelopt", force=True))
    assert sorted(p.name for p in out.iterdir()) == before and _no_leftovers(tmp_path, "o")


def test_cli(run_dir, tmp_path, capsys):
    from quads.cli import main

    assert main(["export", "--checkpoint", str(run_dir), "--format", "bf16", "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "model.safetensors").is_file()
    assert main(["export", "--checkpoint", str(tmp_path / "missing"), "--format", "modelopt",
                 "--out", str(tmp_path / "m")]) == 2
    assert "no such folder" in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_force_never_replaces_a_run_a_policy_or_a_foreign_folder(run_dir, tmp_path, capsys):
    from quads.cli import main

    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    for out in (run_dir, run_dir / "policy", other):
        assert main(["export", "--checkpoint", str(run_dir), "--format", "bf16", "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert "never replaced" in err or "holds the checkpoint being exported" in err, err
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
    assert (other / "todo.txt").read_text() == "keep me"
    # an earlier export is recognised by its marker and replaced with --force only
    out = tmp_path / "exp"
    assert main(["export", "--checkpoint", str(run_dir), "--format", "bf16", "--out", str(out)]) == 0
    assert main(["export", "--checkpoint", str(run_dir), "--format", "modelopt", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(run_dir), "--format", "modelopt", "--out", str(out), "--force"]) == 0
    assert json.loads((out / "quads_export.json").read_text())["format"] == "modelopt"
