"""SFT warm start: response-only loss masking, loss goes down, checkpoint cached and reloads identically."""

import torch

from quads.model.checkpoint import load_checkpoint
from quads.model.tokenizer import CharTokenizer, load_tokenizer
from quads.pretrain import PretrainConfig, collate, encode_sft, save_warm_start, train_sft, warm_start


def _tiny_cfg(tmp_path, **kw):
    base = dict(difficulty=1, steps=25, batch_size=8, lr=3e-3, warmup_steps=3, train_size=100, eval_size=8,
                max_new_tokens=12, cache_dir=str(tmp_path), progress=False, threads=1)
    return PretrainConfig(**{**base, **kw})


def test_targets_cover_response_and_eos_only():
    tok = CharTokenizer()
    seq, start = encode_sft(tok, "Q: 1+2=\n", "1+2=3 #3")
    assert seq[0] == tok.bos_id and seq[-1] == tok.eos_id
    assert tok.decode(seq[start:-1]) == "1+2=3 #3"
    ids, targets = collate([(seq, start), encode_sft(tok, "Q: 9=\n", "#9")], tok.pad_id)
    assert ids.shape == targets.shape == (2, len(seq))
    row = targets[0]
    assert (row[:start - 1] == -100).all() and row[len(seq) - 1] == -100
    assert row[start - 1:len(seq) - 1].tolist() == seq[start:]  # next-token targets of the response + eos
    assert (targets[1] != -100).sum() == len("#9") + 1
    assert (ids[1, len(encode_sft(tok, "Q: 9=\n", "#9")[0]):] == tok.pad_id).all()


def test_cache_key_ignores_location_only(tmp_path):
    a = _tiny_cfg(tmp_path)
    assert a.cache_key() == _tiny_cfg(tmp_path / "elsewhere", progress=True).cache_key()
    assert a.cache_key() != _tiny_cfg(tmp_path, seed=1).cache_key()
    assert a.cache_key() != _tiny_cfg(tmp_path, steps=31).cache_key()
    assert a.cache_key() == _tiny_cfg(tmp_path, eval_size=99, threads=1).cache_key()


def test_short_warm_start_lowers_loss_and_reloads_identically(tmp_path):
    cfg = _tiny_cfg(tmp_path)
    model, tok, task, hist = train_sft(cfg)
    assert hist[-1][1] < 0.6 * hist[0][1], hist  # cross-entropy fell
    folder = save_warm_start(cfg, model, tok, task, hist)
    assert folder == tmp_path / cfg.cache_key() and (folder / "config.json").is_file()
    loaded, extra = load_checkpoint(folder)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert 0.0 <= extra["pretrain_result"]["heldout_pass@1"] <= 1.0
    assert extra["pretrain"]["steps"] == cfg.steps and extra["difficulty"] == 1
    assert isinstance(load_tokenizer(folder), CharTokenizer)
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert warm_start(cfg) == folder  # cached: returned without training again
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_training_is_seeded(tmp_path):
    cfg = _tiny_cfg(tmp_path, steps=3, train_size=20)
    a, b = train_sft(cfg)[0], train_sft(cfg)[0]
    c = train_sft(_tiny_cfg(tmp_path, steps=3, train_size=20, seed=1))[0]
    wa, wb, wc = (m.lm_head.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_config_validation():
    import pytest

    with pytest.raises(ValueError, match="steps must be >= 1"):
        PretrainConfig(steps=0)
    with pytest.raises(ValueError, match="dtype"):
        PretrainConfig(dtype="int8")


def test_chain_configs_find_the_warm_start_of_the_sweep(monkeypatch):
    """``quads train --config configs/chain_100m*.yaml`` asks for the warm start that
    ``scripts/chain_warm_start.sh`` trains (same cache key: the sweep's evaluation settings and device are
    not hashed), with and without the injected outliers."""
    from pathlib import Path

    import quads.pretrain as pretrain
    from quads.config import build_config
    from quads.model.outliers import OutlierConfig
    from quads.rl.build import warm_start_checkpoint
    from quads.rl.config import TrainConfig

    asked = []
    monkeypatch.setattr(pretrain, "warm_start", lambda cfg: asked.append(cfg.cache_key()) or "unused")
    for name in ("chain_100m", "chain_100m_outliers"):
        cfg = build_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml")
        warm_start_checkpoint(cfg)
        sweep = PretrainConfig(task="arithmetic", difficulty=8, preset="100m", lr=0.001, batch_size=32, eval_size=200,
                               max_new_tokens=400, device="cuda", progress=False, steps=cfg.warm_start.steps,
                               outliers=OutlierConfig(mode="inject", channels=[37, 150, 301, 444], scale=32)
                               if name.endswith("outliers") else OutlierConfig())
        assert asked[-1] == sweep.cache_key(), name


def test_sequences_longer_than_the_preset_are_refused_before_training():
    import pytest

    from quads.pretrain import check_lengths

    cfg = PretrainConfig(difficulty=8)
    check_lengths([([0] * 512, 90)], 512, cfg)  # exactly max_seq_len fits
    with pytest.raises(ValueError, match="513 tokens, over the tiny preset's max_seq_len 512"):
        check_lengths([([0] * 40, 5), ([0] * 513, 90)], 512, cfg)
