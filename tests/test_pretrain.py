"""SFT warm start: response-only loss masking, loss goes down, checkpoint cached and reloads identically."""

import pytest
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
    with pytest.raises(ValueError, match="steps must be >= 1"):
        PretrainConfig(steps=0)
    with pytest.raises(ValueError, match="dtype"):
        PretrainConfig(dtype="int8")


def test_chain_configs_find_the_warm_start_of_the_sweep(monkeypatch):
    """``quads train --config configs/chain_100m*.yaml`` asks for the warm start that ``scripts/gpu_collapse.sh``
    trains (``quads pretrain`` with the config's warm_start fields: same cache key, the device not hashed),
    with and without the injected outliers."""
    from pathlib import Path

    import quads.pretrain as pretrain
    from quads.config import build_config
    from quads.model.outliers import OutlierConfig
    from quads.rl.build import warm_start_checkpoint
    from quads.rl.config import TrainConfig

    asked = []
    monkeypatch.setattr(pretrain, "warm_start", lambda cfg: asked.append(cfg.cache_key()) or "unused")
    outliers = OutlierConfig(mode="inject", channels=[37, 150, 301, 444], scale=32)
    chain = dict(task="arithmetic", preset="100m", lr=0.001, batch_size=32, eval_size=100, device="cuda", progress=False,
                 target_pass=0.35)
    level8 = dict(chain, difficulty=8, max_new_tokens=400, steps=800, eval_at=list(range(350, 801, 25)))
    sweeps = {"chain_100m": PretrainConfig(**level8),
              "chain_100m_outliers": PretrainConfig(**level8, outliers=outliers),
              "chain_100m_long": PretrainConfig(**chain, difficulty=10, max_new_tokens=3500, steps=2000,
                                                eval_at=list(range(50, 2001, 50)), outliers=outliers, max_seq_len=4096)}
    for name, sweep in sweeps.items():
        cfg = build_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml")
        warm_start_checkpoint(cfg)
        assert asked[-1] == sweep.cache_key(), name


def test_sequences_longer_than_the_preset_are_refused_before_training():
    from quads.pretrain import check_lengths

    cfg = PretrainConfig(difficulty=8)
    check_lengths([([0] * 512, 90)], 512, cfg)  # exactly max_seq_len fits
    with pytest.raises(ValueError, match="513 tokens, over the tiny preset's max_seq_len 512"):
        check_lengths([([0] * 40, 5), ([0] * 513, 90)], 512, cfg)
    with pytest.raises(ValueError, match="4097 tokens, over the config's max_seq_len 4096"):
        check_lengths([([0] * 4097, 90)], 4096, PretrainConfig(difficulty=10, max_seq_len=4096))


def test_max_seq_len_lengthens_the_context_and_an_unset_one_keeps_the_cache_keys(tmp_path):
    """PretrainConfig.max_seq_len: unset, a config hashes as before the field existed (keys computed before
    it: the defaults, and the outlier chain's warm start); set, it is hashed, it is the model's max_seq_len
    and the one check_lengths checks; it changes no weight; a shorter one than the preset's is refused."""
    from quads.model.outliers import OutlierConfig
    from quads.pretrain import model_config

    assert PretrainConfig().cache_key() == "7623b70770fa2c96"
    outlier_chain = PretrainConfig(task="arithmetic", difficulty=8, preset="100m", lr=0.001, batch_size=32,
                                   eval_size=100, max_new_tokens=400, device="cuda", progress=False, steps=800,
                                   target_pass=0.35, eval_at=list(range(350, 801, 25)),
                                   outliers=OutlierConfig(mode="inject", channels=[37, 150, 301, 444], scale=32))
    assert outlier_chain.cache_key() == "925e906848074bb9"
    assert PretrainConfig(max_seq_len=1024).cache_key() not in ("7623b70770fa2c96",
                                                                 PretrainConfig(max_seq_len=2048).cache_key())
    assert model_config(PretrainConfig(preset="100m"), 100).max_seq_len == 2048
    assert model_config(PretrainConfig(preset="100m", max_seq_len=4096), 100).max_seq_len == 4096
    for bad in (0, 256, True, 1024.0):
        with pytest.raises(ValueError, match="max_seq_len lengthens the tiny preset's context"):
            PretrainConfig(max_seq_len=bad)
    # the same weights with a longer context (it sizes the KV cache only)
    short = train_sft(_tiny_cfg(tmp_path, steps=3, train_size=20))[0]
    long = train_sft(_tiny_cfg(tmp_path, steps=3, train_size=20, max_seq_len=1024))[0]
    assert (short.config.max_seq_len, long.config.max_seq_len) == (512, 1024)
    assert all(torch.equal(a, b) for a, b in zip(short.state_dict().values(), long.state_dict().values()))
    # level 10 (the long chain) does not fit the tiny preset's 512 positions, it fits 4096
    long_chain = dict(difficulty=10, steps=1, batch_size=2, train_size=4, eval_size=0)
    with pytest.raises(ValueError, match="over the tiny preset's max_seq_len 512"):
        train_sft(_tiny_cfg(tmp_path, **long_chain))
    assert train_sft(_tiny_cfg(tmp_path, **long_chain, max_seq_len=4096))[0].config.max_seq_len == 4096


def test_max_seq_len_reaches_the_warm_start_from_train_configs_and_the_cli(monkeypatch):
    """warm_start.max_seq_len (YAML / --set) reaches PretrainConfig through warm_start_policy (unset: None, the
    preset's), and `quads pretrain --max-seq-len` sets it."""
    import argparse

    import quads.pretrain as pretrain
    from quads.config import build_config
    from quads.pretrain_cli import register
    from quads.rl.build import warm_start_checkpoint
    from quads.rl.config import TrainConfig, WarmStartSection

    asked = []
    monkeypatch.setattr(pretrain, "warm_start", lambda cfg: asked.append(cfg) or "unused")
    for value in (None, 1024):
        warm_start_checkpoint(TrainConfig(warm_start=WarmStartSection(max_seq_len=value)))
        assert asked[-1].max_seq_len == value
    with pytest.raises(ValueError, match="warm_start.max_seq_len must be > 0"):
        WarmStartSection(max_seq_len=0)
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["--max-seq-len", "4096", "--difficulty", "10"])
    assert build_config(PretrainConfig, None, args, skip=("config",)).max_seq_len == 4096


def test_compute_dtype_auto_keeps_cpu_runs_and_their_cache_keys():
    """auto is float32 on the CPU (the key of the committed GPU warm start, trained in float32, is unchanged:
    results/gpu/chain/warm_start_2026-12-01.jsonl, checkpoint 943e1db5ecaaee47) and bfloat16 on CUDA, which
    is hashed, so a BF16-compute warm start never answers for a float32 one."""
    chain = dict(task="arithmetic", difficulty=8, preset="100m", lr=0.001, batch_size=32, steps=1000, eval_size=200,
                 max_new_tokens=400)
    cpu = PretrainConfig(**chain)
    assert cpu.resolved_compute_dtype() == "float32"
    assert cpu.cache_key() == "943e1db5ecaaee47"
    assert PretrainConfig(**chain, device="cuda", compute_dtype="float32").cache_key() == "943e1db5ecaaee47"
    cuda = PretrainConfig(**chain, device="cuda")
    assert cuda.resolved_compute_dtype() == "bfloat16" and cuda.cache_key() != "943e1db5ecaaee47"
    assert cuda.cache_key() == PretrainConfig(**chain, compute_dtype="bfloat16").cache_key()
    assert PretrainConfig(**chain, device="cuda", dtype="bfloat16").resolved_compute_dtype() == "bfloat16"
    assert PretrainConfig(**chain, eval_at=[100, 500]).cache_key() == "943e1db5ecaaee47"


def test_compute_dtype_and_eval_at_validation():
    with pytest.raises(ValueError, match="compute_dtype must be one of auto, float32, bfloat16, got 'fp16'"):
        PretrainConfig(compute_dtype="fp16")
    with pytest.raises(ValueError, match="compute_dtype float32 over dtype bfloat16"):
        PretrainConfig(dtype="bfloat16", compute_dtype="float32")
    with pytest.raises(ValueError, match=r"eval_at must list optimizer steps in 1..steps \(10\)"):
        PretrainConfig(steps=10, eval_at=[5, 11])
    with pytest.raises(ValueError, match="eval_at needs eval_size > 0"):
        PretrainConfig(steps=10, eval_at=[5], eval_size=0)
    assert PretrainConfig(steps=10, eval_at=[8, 2, 8]).eval_at == [2, 8]


def test_warm_start_compute_dtype_round_trips_to_the_pretrain_config(monkeypatch):
    """warm_start.compute_dtype is a TrainConfig field (YAML / --set), reaches PretrainConfig through
    warm_start_policy (the one path of train, compare and diagnose), and a bad value is refused."""
    import quads.pretrain as pretrain
    from quads.config import to_dict
    from quads.rl.build import warm_start_checkpoint
    from quads.rl.config import TrainConfig, WarmStartSection

    asked = []
    monkeypatch.setattr(pretrain, "warm_start", lambda cfg: asked.append(cfg) or "unused")
    for value, device, want in (("auto", "cpu", "float32"), ("bfloat16", "cpu", "bfloat16"),
                                ("float32", "cuda", "float32")):
        cfg = TrainConfig(warm_start=WarmStartSection(compute_dtype=value), device=device)
        assert to_dict(cfg)["warm_start"]["compute_dtype"] == value
        warm_start_checkpoint(cfg)
        assert asked[-1].compute_dtype == value and asked[-1].resolved_compute_dtype() == want
    from quads.config import from_dict

    back = from_dict(TrainConfig, to_dict(TrainConfig(warm_start=WarmStartSection(compute_dtype="bfloat16"))))
    assert back.warm_start.compute_dtype == "bfloat16"
    with pytest.raises(ValueError, match="compute_dtype"):
        from_dict(TrainConfig, {"warm_start": {"compute_dtype": "half"}})


def test_cpu_auto_is_float32_and_eval_at_does_not_change_the_weights(tmp_path):
    """On the CPU auto trains exactly as compute_dtype float32; eval_at evaluates with the final evaluation's
    function, draws nothing from the training's randomness, and is recorded in the checkpoint."""
    from quads.model.checkpoint import read_checkpoint_config

    base = dict(steps=6, train_size=40, max_new_tokens=16)
    ref = train_sft(_tiny_cfg(tmp_path, **base, compute_dtype="float32"))[0].state_dict()
    cfg = _tiny_cfg(tmp_path, **base, eval_at=[2, 6])
    evals = []
    model, tok, task, hist = train_sft(cfg, evals=evals)
    assert all(torch.equal(ref[k], v) for k, v in model.state_dict().items())
    assert [e["step"] for e in evals] == [2] and 0 <= evals[0]["heldout_pass@1"] <= 1
    folder = save_warm_start(cfg, model, tok, task, hist, evals=evals)
    res = read_checkpoint_config(folder)[1]["pretrain_result"]
    assert [e["step"] for e in res["heldout_by_step"]] == [2, 6]
    assert res["heldout_by_step"][-1]["heldout_pass@1"] == res["heldout_pass@1"] and res["compute_dtype_resolved"] == "float32"


def test_cuda_bf16_sft_takes_the_grouped_expert_path_and_learns(tmp_path, monkeypatch):
    """On CUDA compute_dtype auto trains in BF16 over float32 master weights: every MoE layer's experts run
    ``sorted_expert_mlp`` (``torch._grouped_mm``), the per-expert loop never, the weights (and the saved
    checkpoint) stay float32, and the cross-entropy falls over a few steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import quads.model.moe as moe

    calls = {"sorted": 0, "grouped_mm": 0}
    sorted_mlp, grouped = moe.sorted_expert_mlp, torch._grouped_mm

    def spy_sorted(x, *a, **k):
        calls["sorted"] += 1
        assert moe.compute_dtype(x) == torch.bfloat16
        return sorted_mlp(x, *a, **k)

    def spy_grouped(a, b, *args, **k):
        calls["grouped_mm"] += 1
        assert a.dtype == b.dtype == torch.bfloat16
        return grouped(a, b, *args, **k)

    monkeypatch.setattr(moe, "sorted_expert_mlp", spy_sorted)
    monkeypatch.setattr(torch, "_grouped_mm", spy_grouped)
    cfg = _tiny_cfg(tmp_path, steps=30, device="cuda", eval_size=4)
    assert cfg.resolved_compute_dtype() == "bfloat16"
    model, tok, task, hist = train_sft(cfg, log_every=1)
    n_layers = model.config.n_layers
    assert calls["sorted"] == 30 * n_layers and calls["grouped_mm"] >= 2 * 30 * n_layers
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ces = [ce for _, ce in hist]
    assert sum(ces[-5:]) / 5 < 0.8 * sum(ces[:5]) / 5, ces
    folder = save_warm_start(cfg, model, tok, task, hist)
    loaded, _ = load_checkpoint(folder, device="cpu")
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


def test_bf16_compute_on_cpu_keeps_fp32_weights_and_evaluates_a_bf16_copy(tmp_path, monkeypatch):
    """compute_dtype bfloat16 (here on the CPU, the path CUDA's auto takes): the forward runs under BF16
    autocast, the parameters, AdamW and the checkpoint stay float32, the CE falls, and the held-out
    evaluation runs a BF16 copy (the model handed to the rollout engine is BF16, the trained one untouched)."""
    import quads.evaluation as evaluation
    from quads.model.checkpoint import read_checkpoint_config

    seen = []
    real = evaluation.evaluate_model
    monkeypatch.setattr(evaluation, "evaluate_model",
                        lambda model, *a, **k: seen.append(next(model.parameters()).dtype) or real(model, *a, **k))
    import quads.pretrain as pretrain

    autocast, loss = [], pretrain.sft_loss
    monkeypatch.setattr(pretrain, "sft_loss", lambda *a: autocast.append(
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")) or loss(*a))
    cfg = _tiny_cfg(tmp_path, steps=20, compute_dtype="bfloat16", eval_at=[10])
    assert cfg.cache_key() != _tiny_cfg(tmp_path, steps=20).cache_key()
    evals = []
    model, tok, task, hist = train_sft(cfg, log_every=1, evals=evals)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert autocast == [torch.bfloat16] * 20
    ces = [ce for _, ce in hist]
    assert sum(ces[-3:]) / 3 < 0.8 * sum(ces[:3]) / 3, ces
    folder = save_warm_start(cfg, model, tok, task, hist, evals=evals)
    assert seen == [torch.bfloat16, torch.bfloat16]  # step 10 and the final evaluation
    assert read_checkpoint_config(folder)[1]["pretrain_result"]["compute_dtype_resolved"] == "bfloat16"
    loaded, _ = load_checkpoint(folder, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_target_pass_stops_at_the_first_eval_step_reaching_it_and_saves_that_model(tmp_path, monkeypatch):
    """target_pass: training stops at the first eval_at step whose held-out pass@1 reaches it; the checkpoint
    is that step's model (the same weights a run without the target has at that step) with that pass@1."""
    import copy

    import quads.pretrain as pretrain
    from quads.model.checkpoint import load_checkpoint, read_checkpoint_config

    scores, seen = iter([0.1, 0.5, 0.9, 0.7] * 3), []

    def fake_eval(cfg, model, tok, task):
        seen.append(copy.deepcopy(model.state_dict()))
        return {"heldout_pass@1": next(scores), "heldout_mean_response_chars": 3.0}

    monkeypatch.setattr(pretrain, "heldout_eval", fake_eval)
    base = dict(steps=8, train_size=40, max_new_tokens=16, eval_at=[2, 4, 6])
    pretrain.train_sft(_tiny_cfg(tmp_path, **base))  # no target: evaluated at 2, 4, 6
    at_step4 = seen[1]
    scores, seen = iter([0.1, 0.5, 0.9]), []
    cfg = _tiny_cfg(tmp_path, **base, target_pass=0.4)
    folder = pretrain.warm_start(cfg)
    res = read_checkpoint_config(folder)[1]["pretrain_result"]
    assert res["stopped_at_step"] == 4 and res["heldout_pass@1"] == 0.5 and len(seen) == 2  # no final evaluation
    assert [e["step"] for e in res["heldout_by_step"]] == [2, 4] and res["loss_history"][-1][0] == 3
    model, _ = load_checkpoint(folder)
    assert all(torch.equal(at_step4[k], v) for k, v in model.state_dict().items())
    # outliers injected into that warm start: the base's stop and records kept, the injected model evaluated afresh
    from quads.model.outliers import OutlierConfig

    scores = iter([0.45])
    inj = pretrain.warm_start(_tiny_cfg(tmp_path, **base, target_pass=0.4,
                                        outliers=OutlierConfig(mode="inject", channels=[1, 5], scale=4.0)))
    res_inj = read_checkpoint_config(inj)[1]["pretrain_result"]
    assert res_inj["stopped_at_step"] == 4 and res_inj["heldout_by_step"] == res["heldout_by_step"]
    assert res_inj["heldout_pass@1"] == 0.45 and res_inj["base_heldout_pass@1"] == 0.5
    # never reached: all steps are trained and the final evaluation is the checkpoint's
    scores = iter([0.1, 0.2, 0.3, 0.35])
    res = read_checkpoint_config(pretrain.warm_start(_tiny_cfg(tmp_path, **base, target_pass=0.99)))[1]["pretrain_result"]
    assert "stopped_at_step" not in res and res["heldout_pass@1"] == 0.35 and res["loss_history"][-1][0] == 7


def test_target_pass_hashes_the_evaluation_that_decides_the_stop(tmp_path):
    plain = _tiny_cfg(tmp_path)
    assert plain.cache_key() == _tiny_cfg(tmp_path, eval_size=50, eval_at=[5], max_new_tokens=20).cache_key()
    t = _tiny_cfg(tmp_path, eval_at=[5, 10], target_pass=0.4)
    assert t.cache_key() != plain.cache_key()
    assert t.cache_key() != _tiny_cfg(tmp_path, eval_at=[5, 10], target_pass=0.4, eval_size=50).cache_key()
    assert t.cache_key() != _tiny_cfg(tmp_path, eval_at=[5, 10], target_pass=0.5).cache_key()
    for bad in (dict(target_pass=0.4), dict(target_pass=0.0, eval_at=[5]), dict(target_pass=1.5, eval_at=[5])):
        with pytest.raises(ValueError, match="target_pass"):
            _tiny_cfg(tmp_path, **bad)


def test_an_interrupted_sft_resumes_at_its_last_check_and_ends_with_the_same_weights(tmp_path, monkeypatch):
    """``warm_start`` saves the SFT's state at every ``eval_at`` step; killed after one, a second call
    continues from it (no steps repeated from 0) and caches the same weights and records as one run."""
    import quads.pretrain as pretrain

    kw = dict(steps=10, eval_at=[4, 8], eval_size=2)
    whole = load_checkpoint(warm_start(_tiny_cfg(tmp_path / "a", **kw)))
    cfg = _tiny_cfg(tmp_path / "b", **kw)
    real, calls = pretrain.sft_loss, []

    def dies_at_step_6(*a, **k):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt  # the device call's end, between the checks at 4 and 8
        return real(*a, **k)

    monkeypatch.setattr(pretrain, "sft_loss", dies_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        warm_start(cfg)
    part = pretrain.partial_state(cfg)
    assert part.is_file() and pretrain.resumed_progress(part)["step"] == 4
    assert not (cfg.folder() / "config.json").exists()
    calls.clear()
    monkeypatch.setattr(pretrain, "sft_loss", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = load_checkpoint(warm_start(cfg))
    assert len(calls) == 6 and not part.parent.exists()  # steps 4-9 only; the partial state is gone
    for name, tensor in whole[0].state_dict().items():
        assert torch.equal(tensor, resumed[0].state_dict()[name]), name
    a, b = whole[1]["pretrain_result"], resumed[1]["pretrain_result"]
    assert a["loss_history"] == b["loss_history"] and a["heldout_pass@1"] == b["heldout_pass@1"]
    assert [e["step"] for e in a["heldout_by_step"]] == [e["step"] for e in b["heldout_by_step"]] == [4, 8]
