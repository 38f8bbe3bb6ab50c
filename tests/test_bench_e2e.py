"""quads bench e2e on the CPU at a tiny size: every recipe row filled, ratios computed in one run."""

import json

import pytest

from quads.cli import main


@pytest.mark.slow  # a benchmark run: every recipe on both expert paths, plus the trainer
def test_bench_e2e_quick(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--quick", "--preset", "tiny", "--device", "cpu", "--experts", "grouped,loop",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    roll = {(r["recipe"], r["experts"]): r for r in rows if r["suite"] == "rollout"}
    recipes = {"bf16", "fp8", "w4a16", "w4a4", "w4a4+rac50", "w4a4+rac50-static"}
    assert set(roll) == {(n, p) for n in recipes for p in ("grouped", "loop")}
    assert all(r["tokens_per_s"] > 0 and r["decode_ms_per_step"] > 0 for r in roll.values())
    assert roll["bf16", "grouped"]["vs_bf16"] == 1.0 and roll["w4a4", "loop"]["vs_grouped"] > 0
    tr = [r for r in rows if r["suite"] == "trainer"]
    assert [r["recipe"] for r in tr] == ["bf16", "w4a16-qat"] and tr[-1]["vs_bf16"] > 0
    assert data["info"]["device"] == "cpu"
    assert "rollout" in capsys.readouterr().out


def _bench():
    from quads.bench import _load_bench

    return _load_bench("bench_e2e")


def test_timing_stats_on_synthetic_timings():
    st = _bench().timing_stats([10.0, 12.0, 11.0, 30.0, 9.0, 10.0, 11.0, 10.0, 12.0])  # one outlier (30)
    assert st["n"] == 9 and st["median"] == 11.0 and st["min"] == 9.0 and st["max"] == 30.0
    assert (st["q25"], st["q75"]) == (10.0, 12.0)  # inclusive quartiles of the sorted 9
    assert abs(st["iqr_pct"] - 100 * 2 / 11) < 1e-12
    assert abs(st["mad_pct"] - 100 * 1 / 11) < 1e-12  # |t - 11| sorted: 0 0 1 1 1 1 1 2 19 -> median 1
    assert _bench().timing_stats([5.0])["iqr_pct"] == 0.0
    with pytest.raises(ValueError, match="at least one sample"):
        _bench().timing_stats([])


def test_ratio_ci_resolves_a_five_percent_difference():
    g = __import__("random").Random(0)
    base = [20.0 * (1 + 0.01 * g.gauss(0, 1)) for _ in range(30)]  # 1% noise
    qat = [b * 1.05 for b in base]
    r = _bench().ratio_ci(qat, base)
    assert abs(r["ratio"] - 1.05) < 1e-12 and abs(r["pair_median"] - 1.05) < 1e-12
    assert 1.0 < r["ci_lo"] <= 1.05 <= r["ci_hi"] < 1.1
    same = _bench().ratio_ci(base, base)
    assert same["ratio"] == 1.0 and same["ci_lo"] == same["ci_hi"] == 1.0
    noisy = _bench().ratio_ci([20.0 * (1 + 0.3 * g.gauss(0, 1)) for _ in range(30)], base)
    assert noisy["ci_hi"] - noisy["ci_lo"] > r["ci_hi"] - r["ci_lo"]  # more spread, wider interval
    with pytest.raises(ValueError, match="equally long"):
        _bench().ratio_ci([1.0], [1.0, 2.0])


def test_trainer_flops_counts_active_matmuls():
    from quads.model import ModelConfig

    cfg = ModelConfig.preset("100m", vocab_size=100)
    B, S, R = 64, 128, 96
    f = _bench().trainer_flops(cfg, B, S, R)
    n = cfg.num_params()
    # active params minus the embedding table and norms (not matmuls) are the body's matmul weights + head
    H, L = cfg.hidden_size, cfg.n_layers
    qk = 2 * cfg.head_dim if cfg.qk_norm == "head" else (0 if cfg.qk_norm == "none" else (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim)
    body = n["active"] - n["embedding"] - H - L * (2 * H + qk)
    attn = 6 * L * cfg.n_heads * cfg.head_dim * S * S * B
    assert f == 6 * body * B * S + 6 * cfg.vocab_size * H * B * R + attn


def test_bench_trainer_cpu_interleaved(tmp_path):
    out = tmp_path / "t.json"
    assert _bench().main(["--suites", "trainer", "--preset", "tiny", "--device", "cpu", "--batch", "2",
                          "--seq-len", "16", "--warmup", "1", "--steps", "3", "--interleave", "block", "--trainer-profile",
                          "--block", "2", "--json", str(out)]) == 0
    rows = __import__("json").loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["bf16", "w4a16-qat"]
    assert all(len(r["raw_ms"]) == 3 and r["stats"]["n"] == 3 and r["timer"] == "perf_counter" for r in rows)
    assert rows[1]["vs_bf16_ci"][0] <= rows[1]["vs_bf16"] <= rows[1]["vs_bf16_ci"][1]
    assert "mfu_h200_bf16" not in rows[0] and rows[0]["tflops"] > 0
    assert all(r["profile"]["top"] and r["profile"]["syncs"] == 0 for r in rows)  # CPU: no CUDA syncs to count


def test_trainer_rows_compare_compiled_qat_with_compiled_bf16():
    refs = _bench()._ratio_refs
    names = ["bf16", "w4a16-qat", "bf16+compile", "w4a16-qat+compile"]
    configs = {"bf16": ("bf16", False), "w4a16-qat": ("w4a16-qat", False), "bf16+compile": ("bf16", True),
               "w4a16-qat+compile": ("w4a16-qat", True)}
    assert refs("bf16", names, configs) == [] and refs("w4a16-qat", names, configs) == ["bf16"]
    assert refs("bf16+compile", names, configs) == ["bf16"]
    assert refs("w4a16-qat+compile", names, configs) == ["bf16", "w4a16-qat", "bf16+compile"]


def test_trainer_compile_flag_parses():
    on_off = _bench()._on_off
    assert on_off("off", "f") == [False] and on_off("off,on", "f") == [False, True] and on_off("on,on", "f") == [True]
    with pytest.raises(ValueError, match="--trainer-compile"):
        on_off("yes", "--trainer-compile")


def test_operand_bytes_count_the_packed_weights(reference_quantizer):
    """W4A4+RAC rollout layers on the Triton backend hold the packed NVFP4 layout (0.5 + 1/16 bytes per
    weight, K padded to 64, 4 bytes of global scale per expert), on the reference backend the BF16 QDQ(W)."""
    pytest.importorskip("triton")
    from conftest import tiny_model

    from quads.kernels import dispatch
    from quads.kernels._common import interpreter_on
    from quads.quant import quantize_model
    from quads.quant.recipe import LinearSpec, Recipe

    if not interpreter_on():
        pytest.skip("the kernels were imported before TRITON_INTERPRET=1 was set")
    spec = LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5)
    held = {}
    for backend in ("triton", "reference"):
        model = tiny_model(hidden_size=64, dtype="bfloat16").requires_grad_(False)
        with dispatch.kernels(backend):
            quantize_model(model, Recipe("t", rollout=spec), side="rollout", verbose=False)
        held[backend] = _bench().operand_bytes(model)
    ex = model.model.layers[0].mlp.experts
    packed = sum(E * N * (-(-K // 64) * 64) * 9 // 16 + 4 * E
                 for E, N, K in (ex.gate_up_proj.shape, ex.down_proj.shape))
    assert held["triton"] == packed
    assert held["reference"] == 2 * (ex.gate_up_proj.numel() + ex.down_proj.numel())


def test_operand_bytes_count_the_fp8_codes(monkeypatch):
    """FP8 rollout layers on FP8 tensor cores (the branch patched on, tests/test_fp8_scaled.py) hold 1 byte a weight
    and a 4-byte scale a row; emulated, the BF16 QDQ(W)."""
    from conftest import tiny_model

    from quads.quant import fp8_scaled, quantize_model
    from quads.quant.recipe import LinearSpec, Recipe

    held = {}
    for cores in (True, False):
        monkeypatch.setattr(fp8_scaled, "on_tensor_cores", lambda t, weight_dims=2, _on=cores: _on)
        model = tiny_model(hidden_size=64, dtype="bfloat16").requires_grad_(False)
        quantize_model(model, Recipe("t", rollout=LinearSpec.of(weight="fp8", act="fp8")), side="rollout", verbose=False)
        held[cores] = _bench().operand_bytes(model)
    ex = model.model.layers[0].mlp.experts
    weights = ex.gate_up_proj.numel() + ex.down_proj.numel()
    rows = ex.gate_up_proj.shape[0] * (ex.gate_up_proj.shape[1] + ex.down_proj.shape[1])
    layers = len(model.model.layers)
    assert held[True] == layers * (weights + 4 * rows)
    assert held[False] == layers * 2 * weights


def test_bench_trainer_phases_cpu(tmp_path):
    """``--trainer-phases``: per configuration the phase steps' statistics (median, IQR) of every phase in
    order, each step the sum of its phases; QAT's refresh phase does the work
    (BF16 has none: no ATen call in its profiled refresh), and its paired differences to BF16 are reported."""
    out = tmp_path / "p.json"
    assert _bench().main(["--suites", "trainer", "--preset", "tiny", "--device", "cpu", "--batch", "2", "--seq-len",
                          "16", "--warmup", "1", "--steps", "2", "--trainer-phases", "3", "--trainer-profile",
                          "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    phases = list(_bench().PHASES)
    assert phases == ["refresh", "forward", "backward", "optimizer"]
    for r in rows:
        ph = r["phases"]
        assert ph["steps"] == 3 and ph["timer"] == "perf_counter" and list(ph["ms"]) == phases
        assert all(ph["ms"][n]["n"] == 3 and {"median", "iqr_pct"} <= set(ph["ms"][n]) for n in phases)
        for i, total in enumerate(ph["step_raw_ms"]):
            assert total == pytest.approx(sum(ph["raw_ms"][n][i] for n in phases), rel=1e-9)
        assert ph["sum_of_medians_ms"] == pytest.approx(sum(ph["ms"][n]["median"] for n in phases), rel=1e-9)
        assert ph["step"]["min"] > 0 and r["stats"]["min"] > 0  # (no timing ratio: CI machines are shared)
        assert list(r["profile"]["phases"]) == phases
    bf, qat = rows
    assert "vs_bf16_delta_ms" not in bf["phases"] and set(qat["phases"]["vs_bf16_delta_ms"]) == {*phases, "step"}
    assert qat["phases"]["ms"]["refresh"]["median"] > bf["phases"]["ms"]["refresh"]["median"]
    assert bf["profile"]["phases"]["refresh"]["aten_calls"] == 0 < qat["profile"]["phases"]["refresh"]["aten_calls"]


def test_profile_splits_op_time_into_decode_steps_and_the_rest():
    """The profile suite's per-op split: (48-token trace - 16-token trace) / the extra steps per decode
    step, and the 16-token trace less its own decode steps as the prefill's share."""
    split = _bench()._op_split
    # gemm: 2 calls and 0.01 ms a step, a 1 ms prefill; norm only in the prefill; 15 and 47 decode steps
    o16 = {"gemm": (1 + 2 * 15, 1.0 + 0.01 * 15), "norm": (3, 0.5)}
    o48 = {"gemm": (1 + 2 * 47, 1.0 + 0.01 * 47), "norm": (3, 0.5), "late": (32, 0.32)}
    per_step, outside = split(o16, o48, steps=32, steps16=15)
    assert per_step[:2] == [("gemm", 2.0, 10.0), ("late", 1.0, 10.0)]  # ties by name
    assert ("norm", 0.0, 0.0) in per_step
    assert outside[0] == ("gemm", 1.0, 1.0) and outside[1] == ("norm", 3.0, 0.5)
    assert ("late", -15.0, -0.15) in outside  # an op the short trace lacks shows as a negative remainder
    assert len(split(o16, o48, steps=32, steps16=15, top=1)[1]) == 1
    _, every = split(o16, o48, steps=32, steps16=15, top=None)  # the host total sums every op
    assert len(every) == 3 and round(sum(r[2] for r in every), 6) == 1.35


def test_profile_modes_follow_graphs_and_compile():
    """The profile suite's (graphs, compile) modes: ``--graphs on`` traces only the compiled step(s) in
    graphs, ``off`` adds the eager step, and the CPU (no graphs) always traces the eager one."""
    modes = _bench()._profile_modes
    assert modes("on", "on", cuda=True) == [(True, True)]
    assert modes("on,off", "on,off", cuda=True) == [(True, True), (True, False), (False, False)]
    assert modes("off", "on", cuda=True) == [(False, False)]
    assert modes("on", "on", cuda=False) == [(False, False)]


def test_rollout_recipes_run_in_the_order_given(tmp_path, capsys):
    """``--recipes`` runs its recipes in the order given (rows are written as each ends, so the order decides which
    rows a time limit keeps); the ratio to BF16 does not need BF16 first; an unknown name is an error naming the
    valid ones."""
    out = tmp_path / "e2e.json"
    bench = _bench()
    assert bench.main(["--suites", "rollout", "--preset", "tiny", "--device", "cpu", "--experts", "grouped",
                       "--recipes", "w4a16,bf16", "--prompts", "2", "--n", "1", "--new-tokens", "2", "--long-tokens",
                       "0", "--reps", "1", "--graphs", "off", "--compile", "off", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["w4a16", "bf16"] and rows[0]["vs_bf16"] > 0
    with pytest.raises(SystemExit):
        bench.main(["--suites", "rollout", "--device", "cpu", "--recipes", "bf16,w4a5"])
    assert "unknown recipe(s) ['w4a5']; valid: bf16, fp8" in capsys.readouterr().err


def test_stop_fraction_makes_rows_finish_at_different_steps(tmp_path):
    """``--stop-fraction``: a fixed seeded subset of that fraction of the vocabulary (no special id) ends a sample, so
    the rows end before ``--new-tokens`` on average while the batch runs on (the masked slots a real rollout has);
    the row records the fraction, the mean response length and the decode steps; 0 keeps every row at its length."""
    bench = _bench()
    ids = bench.stop_ids(0.1, 1000)
    assert len(ids) == 100 and len(set(ids)) == 100 and min(ids) >= 4 and max(ids) < 1000
    assert ids == bench.stop_ids(0.1, 1000) and bench.stop_ids(0.0, 1000) == ()
    out = tmp_path / "e2e.json"
    common = ["--suites", "rollout", "--preset", "tiny", "--device", "cpu", "--experts", "grouped", "--recipes",
              "bf16", "--prompts", "4", "--n", "4", "--new-tokens", "40", "--long-tokens", "0", "--reps", "1",
              "--graphs", "off", "--compile", "off", "--json", str(out)]
    rows = []
    for fraction in ("0.05", "0"):
        assert bench.main(common + ["--stop-fraction", fraction]) == 0
        rows += json.loads(out.read_text())["rows"]
    finishing, full = rows
    assert finishing["stop_fraction"] == 0.05 and full["stop_fraction"] == 0.0
    assert 1 <= finishing["response_tokens_mean"] < 40 and full["response_tokens_mean"] == 40
    assert finishing["decode_steps"] <= 39 and full["decode_steps"] == 39  # the first token comes from the prefill
    with pytest.raises(SystemExit):
        bench.main(["--suites", "rollout", "--device", "cpu", "--stop-fraction", "1"])
