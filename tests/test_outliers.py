"""Activation outlier channels (``quads.model.outliers``): injection keeps the function (bit for bit with a
power-of-two scale, FP32 and BF16) while the norm outputs' per-channel absmax grows by the scale; the
warm start's inject / init modes and ``quads outliers`` record what they did."""

import json

import pytest
import torch

from quads.model import ModelConfig, MoEForCausalLM
from quads.model.outliers import (
    OutlierConfig,
    init_outliers,
    inject_checked,
    inject_outliers,
    norm_output_absmax,
)

CHANNELS = [3, 40, 77]


def _model(dtype="float32", **kw):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=100, dtype=dtype, n_layers=2, **kw)
    model = MoEForCausalLM(cfg).eval()
    with torch.no_grad():  # trained-looking gains, not all ones
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _ids():
    return torch.randint(4, 100, (3, 37), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sites", [["mlp"], ["mlp", "attn"]], ids=lambda s: "+".join(s))
@pytest.mark.parametrize("shared", [False, True], ids=lambda s: f"shared{int(s)}")
def test_inject_with_power_of_two_scale_keeps_logits_bit_for_bit(dtype, sites, shared):
    kw = dict(shared_expert_intermediate_size=32, shared_expert_gate=True) if shared else {}
    model, ids = _model(dtype, **kw), _ids()
    cfg = OutlierConfig(mode="inject", channels=CHANNELS, scale=32.0, sites=sites)
    with torch.no_grad():
        before = model(ids).logits
        amax0 = {s: norm_output_absmax(model, ids, s) for s in sites}
        gains0 = model.model.layers[0].post_attention_layernorm.weight.clone()
        inject_outliers(model, cfg)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert torch.equal(model.model.layers[0].post_attention_layernorm.weight[CHANNELS], gains0[CHANNELS] * 32)
    for s in sites:
        ratio = norm_output_absmax(model, ids, s) / amax0[s]
        others = [c for c in range(ratio.shape[1]) if c not in CHANNELS]
        torch.testing.assert_close(ratio[:, CHANNELS], torch.full((2, 3), 32.0), rtol=0, atol=0)
        torch.testing.assert_close(ratio[:, others], torch.ones(2, len(others)), rtol=0, atol=0)


def test_scaling_the_gains_alone_changes_the_function():
    """What the column division compensates: without it (``init_outliers`` on a trained model) the logits move."""
    model, ids = _model(), _ids()
    with torch.no_grad():
        before = model(ids).logits
        init_outliers(model, OutlierConfig(mode="init", channels=CHANNELS, scale=32.0))
        assert (model(ids).logits - before).abs().max() > 1e-3
        assert torch.equal(model.model.layers[1].post_attention_layernorm.weight[CHANNELS], torch.full((3,), 32.0))


def test_inject_with_other_scale_changes_logits_by_rounding_only():
    model, ids = _model(), _ids()
    check = inject_checked(model, OutlierConfig(mode="inject", channels=CHANNELS, scale=3.0), ids)
    assert 0 < check["max_abs_logit_change"] < 1e-5 * max(check["max_abs_logit"], 1)
    assert check["mlp_absmax_ratio_outliers"] == pytest.approx(3.0, rel=1e-6)
    assert check["mlp_absmax_ratio_others"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("kw,match", [
    (dict(mode="inject"), "needs outliers.channels"),
    (dict(mode="inject", channels=[1, 1]), "distinct"),
    (dict(mode="init", channels=[1], scale=0.0), "scale"),
    (dict(mode="inject", channels=[1], sites=["lm_head"]), "sites"),
    (dict(mode="grow"), "mode"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        OutlierConfig(**kw)


def test_channel_out_of_range_is_refused():
    with pytest.raises(ValueError, match="< hidden_size 128"):
        inject_outliers(_model(), OutlierConfig(mode="inject", channels=[128]))


def test_default_warm_start_cache_key_is_unchanged():
    """``outliers.mode: none`` hashes as before the field existed (the key main computed for the default
    config), so warm starts already in a cache stay valid."""
    from quads.pretrain import PretrainConfig

    assert PretrainConfig().cache_key() == "7623b70770fa2c96"
    assert PretrainConfig(outliers=OutlierConfig(mode="inject", channels=[1])).cache_key() != "7623b70770fa2c96"


def _pretrain_cfg(tmp_path, **outliers):
    from quads.pretrain import PretrainConfig

    return PretrainConfig(difficulty=1, steps=4, batch_size=4, train_size=50, eval_size=4, max_new_tokens=8,
                          cache_dir=str(tmp_path), progress=False, threads=1, outliers=OutlierConfig(**outliers))


def test_warm_start_inject_mode_reuses_the_base_and_records_the_check(tmp_path):
    from quads.model.checkpoint import load_checkpoint
    from quads.pretrain import warm_start

    cfg = _pretrain_cfg(tmp_path, mode="inject", channels=CHANNELS, scale=16.0)
    folder = warm_start(cfg)
    base = warm_start(_pretrain_cfg(tmp_path))  # cached by the inject run
    assert folder != base and len(list(tmp_path.iterdir())) == 2
    model, extra = load_checkpoint(folder)
    base_model, base_extra = load_checkpoint(base)
    assert extra["outliers"] == {"mode": "inject", "channels": CHANNELS, "scale": 16.0, "sites": ["mlp"]}
    assert extra["pretrain"]["outliers"]["channels"] == CHANNELS
    res = extra["outliers_result"]
    assert res["max_abs_logit_change"] == 0.0 and res["mlp_absmax_ratio_outliers"] == 16.0
    assert res["base_checkpoint"] == str(base)
    assert extra["pretrain_result"]["heldout_pass@1"] == base_extra["pretrain_result"]["heldout_pass@1"]
    g, g0 = (m.model.layers[0].post_attention_layernorm.weight for m in (model, base_model))
    assert torch.equal(g[CHANNELS], g0[CHANNELS] * 16)
    w, w0 = (m.model.layers[0].mlp.experts.gate_up_proj for m in (model, base_model))
    assert torch.equal(w[..., CHANNELS], w0[..., CHANNELS] / 16)


def test_warm_start_init_mode_trains_with_outlier_gains(tmp_path):
    from quads.model.checkpoint import load_checkpoint
    from quads.pretrain import warm_start

    model, extra = load_checkpoint(warm_start(_pretrain_cfg(tmp_path, mode="init", channels=CHANNELS, scale=16.0)))
    assert extra["outliers"]["mode"] == "init" and "outliers_result" not in extra
    for layer in model.model.layers:  # AdamW moved the gains by about lr per step, far from their 1.0 start
        g = layer.post_attention_layernorm.weight
        assert (g[CHANNELS] - 16).abs().max() < 0.1 and (g[[0, 1, 2]] - 1).abs().max() < 0.1


def test_cli_injects_into_a_checkpoint(tmp_path, capsys):
    from quads.cli import main
    from quads.model.checkpoint import load_checkpoint, save_checkpoint
    from quads.model.tokenizer import CharTokenizer

    model, ids = _model(), _ids()
    src = save_checkpoint(model, tmp_path / "src", {"task": "arithmetic", "difficulty": 2}, tokenizer=CharTokenizer())
    out = tmp_path / "out"
    assert main(["outliers", "--checkpoint", str(src), "--out-dir", str(out), "--channels", "3,40",
                 "--scale", "8", "--sites", "mlp,attn"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["max_abs_logit_change"] == 0.0 and line["attn_absmax_ratio_outliers"] == 8.0
    new, extra = load_checkpoint(out)
    assert extra["outliers"]["sites"] == ["mlp", "attn"] and extra["task"] == "arithmetic"
    with torch.no_grad():
        torch.testing.assert_close(new(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert main(["outliers", "--checkpoint", str(src), "--out-dir", str(out), "--channels", "3"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["outliers", "--checkpoint", str(out), "--out-dir", str(tmp_path / "o2"), "--channels", "3"]) == 2
    assert "already has injected outliers" in capsys.readouterr().err


def test_pretrain_refuses_channels_beyond_the_preset_before_training(tmp_path, capsys):
    from quads.cli import main
    from quads.pretrain import PretrainConfig

    with pytest.raises(ValueError, match="tiny preset's hidden_size 128"):
        PretrainConfig(outliers=OutlierConfig(mode="init", channels=[5, 300]))
    assert main(["pretrain", "--outliers.mode", "inject", "--outliers.channels", "444", "--cache-dir",
                 str(tmp_path)]) == 2
    assert "hidden_size 128" in capsys.readouterr().err and not any(tmp_path.iterdir())
