"""quads diagnose: teacher-forced rollout scoring reproduces the engine; the decomposition is consistent
(identical sides show zero gap, BF16/BF16 shows only engine drift); the CLI writes a filled report."""

import json
from pathlib import Path

import pytest
import torch
from conftest import SMALL_MODEL, tiny_model

from quads.cli import main
from quads.experiments.diagnose import DiagnoseConfig, decompose, floor_summary, load_grid
from quads.model.tokenizer import CharTokenizer
from quads.quant import get_recipe, quantize_model
from quads.rl.logprobs import sequence_logprobs
from quads.rollout import RolloutEngine, SamplingParams
from quads.rollout.score import score_rollout

PROMPTS = ["Q: 1+2=\n", "Q: 3*4-5=\n", "Q: 7=\n"]


def _model(dtype: str):
    return tiny_model(dtype=dtype, **SMALL_MODEL).eval()


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4", "quads"])
def test_score_reproduces_engine_bit_for_bit(recipe):
    """Scoring a batch with the model that sampled it gives the engine's own log-probs and routing,
    also under W4A4 where the per-tensor activation scale depends on which rows share a forward."""
    model = _model("bfloat16")
    quantize_model(model, get_recipe(recipe), side="rollout", verbose=False)
    batch = RolloutEngine(model, CharTokenizer()).generate(
        PROMPTS, SamplingParams(n=3, max_new_tokens=16, seed=1))
    assert len(set(batch.response_lengths().tolist())) > 1  # rows leave the cache at different steps
    res = score_rollout(model, batch)
    torch.testing.assert_close(res.logprobs, batch.logprobs, atol=0, rtol=0)
    fed = batch.routing >= 0
    assert torch.equal(res.routing[fed], batch.routing[fed])


def test_float64_rollout_path_matches_trainer_path():
    """In float64 the engine's KV-cache path and the trainer's full forward agree to ~1e-10, so the
    BF16 gap is engine drift from rounding, not a bug; quantization makes a real difference."""
    model = _model("float64")
    batch = RolloutEngine(model, CharTokenizer()).generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16))
    rollout = score_rollout(model, batch).logprobs
    train = sequence_logprobs(model, batch)
    assert (rollout - train).abs().max().item() < 1e-10
    quantize_model(model, get_recipe("nvfp4"), side="rollout", verbose=False)
    assert (score_rollout(model, batch).logprobs - train).abs().max().item() > 1e-4


def _small_cfg(checkpoint, tmp_path, **kw) -> DiagnoseConfig:
    base = dict(checkpoint=str(checkpoint), prompts=3, n_samples=2, max_new_tokens=12, rac_ratios="0.5,1.0",
                out_dir=str(tmp_path / "diag"))
    return DiagnoseConfig(**{**base, **kw})


def _row(rows, rollout, trainer):
    (row,) = [r for r in rows if r["rollout"] == rollout and r["trainer"] == trainer]
    return row


def test_decomposition_float64_identical_sides_zero_gap(small_checkpoint, tmp_path):
    res = decompose(_small_cfg(small_checkpoint, tmp_path, dtype="float64", layer_errors=False), say=lambda s: None)
    rows = res["rows"]
    assert res["self_check"] == 0.0
    # the same computation on both sides (BF16 engine vs BF16 trainer; W4A16 engine vs W4A16-QAT trainer)
    for rollout, trainer in (("bf16", "bf16"), ("w4a16", "w4a16-qat")):
        row = _row(rows, rollout, trainer)
        assert row["gap_max"] < 1e-10 and row["routing_diff"] == 0.0, row
    # one error source at a time shows up as a real gap
    for rollout in ("w4a16", "w16a4", "w4a4"):
        assert _row(rows, rollout, "bf16")["gap_max"] > 1e-4


def test_cli_writes_filled_report(small_checkpoint, tmp_path, capsys):
    out = tmp_path / "diag"
    rc = main(["diagnose", "--checkpoint", str(small_checkpoint), "--prompts", "3", "--n-samples", "2",
               "--max-new-tokens", "12", "--rac-ratios", "0.25,1.0", "--out-dir", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "decomposition.jsonl").read_text().splitlines()]
    assert {r["rollout"] for r in rows} == {"bf16", "w4a16", "w16a4", "w4a4", "w4a4+rac25%", "w4a4+rac100%"}
    assert {r["trainer"] for r in rows} == {"bf16", "w4a16-qat", "w4a4-qat"} and len(rows) == 18
    md = (out / "decomposition.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and "rollout" not in ln]
    assert table and not any("n/a" in ln for ln in table), md
    for f in ("rac_ratio_gap.png", "decomposition_gap.png", "layer_errors.png", "layer_errors.json", "batch.json"):
        assert (out / f).stat().st_size > 0, f
    floor = _row(rows, "bf16", "bf16")
    assert 0 < floor["gap_mean"]  # BF16 engine drift is real
    assert _row(rows, "w4a4", "bf16")["gap_mean"] > floor["gap_mean"]
    assert _row(rows, "w4a4", "bf16")["layer_err_mean"] > 0.01
    assert floor["layer_err_mean"] == 0.0  # same spec on both sides of the replay: no layer error
    layers = json.loads((out / "layer_errors.json").read_text())
    assert len(layers) == 18 and all(len(v) == 2 for v in layers.values())  # 2 expert layers per pair


def test_recipe_grid_file(tmp_path):
    p = tmp_path / "grid.yaml"
    p.write_text("rollout:\n  a4: {act: nvfp4}\n  w4a4: {weight: nvfp4, act: nvfp4, rac_ratio: 0.25}\n"
                 "trainer:\n  bf16: {}\n")
    g = load_grid(str(p))
    assert g.rollout["a4"].describe() == "W16A4" and g.rollout["w4a4"].rac_ratio == 0.25
    p.write_text("rollout:\n  x: {wieght: nvfp4}\ntrainer:\n  bf16: {}\n")
    with pytest.raises(ValueError, match="valid spec fields"):
        load_grid(str(p))
    p.write_text("rollout:\n  x: {}\n")
    with pytest.raises(ValueError, match="rollout and trainer"):
        load_grid(str(p))


def test_finds_the_warm_start_quads_train_cached(tmp_path, monkeypatch):
    """With no checkpoint, diagnose uses the warm start quads train cached for the same preset, task, level
    and seed (same config hash folder), and trains none of its own."""
    from quads import pretrain
    from quads.rl.build import resolve
    from quads.rl.config import TrainConfig

    monkeypatch.setenv("QUADS_CACHE", str(tmp_path / "cache"))
    trained = []

    def sft(cfg, log_every=50, evals=None, resume=None):  # a stand-in for the SFT run: a tiny model, recorded
        trained.append(cfg)
        return tiny_model(**SMALL_MODEL), CharTokenizer(), pretrain._task(cfg), [(0, 1.0)]

    monkeypatch.setattr(pretrain, "train_sft", sft)
    folder = resolve(TrainConfig()).checkpoint  # quads train's defaults
    assert len(trained) == 1 and folder.parent == tmp_path / "cache" / "pretrain"
    res = decompose(DiagnoseConfig(prompts=2, n_samples=1, max_new_tokens=4, rac_ratios="1.0", layer_errors=False,
                                   out_dir=str(tmp_path / "diag")), say=lambda s: None)
    assert res["meta"]["checkpoint"] == str(folder)
    assert len(trained) == 1  # found in the cache, not trained again


@pytest.mark.parametrize("folder", ["results/cpu/diagnose", "results/cpu/diagnose-vllm", "results/gpu/diagnose"])
def test_committed_report_is_what_the_report_module_writes(folder, tmp_path):
    """The report of a committed diagnose run, rewritten from its data files, is the committed one."""
    import shutil

    from quads.experiments.diagnose import load_result, write_report

    src = Path(__file__).resolve().parents[1] / folder
    shutil.copytree(src, tmp_path / "d")
    write_report(load_result(tmp_path / "d"), tmp_path / "d")
    assert (tmp_path / "d" / "decomposition.md").read_text() == (src / "decomposition.md").read_text()


def test_injected_outliers_raise_w4a4_error_and_leave_bf16_unchanged(small_checkpoint, tmp_path):
    """The same model with outlier channels injected (function-preserving, power-of-two scale): the BF16
    floor row of the decomposition is bit for bit the same (same sampled batch, same log-probs), while the
    W4A4 rollout's k3 and the activation-quantized layers' errors rise well above the model without them."""
    from quads.model.checkpoint import load_checkpoint, save_checkpoint
    from quads.model.outliers import OutlierConfig, inject_outliers

    model, extra = load_checkpoint(small_checkpoint)
    inject_outliers(model, OutlierConfig(mode="inject", channels=[5, 21, 40], scale=64.0))
    injected = save_checkpoint(model, tmp_path / "outliers", {**extra, "outliers": {
        "mode": "inject", "channels": [5, 21, 40], "scale": 64.0, "sites": ["mlp"]}}, tokenizer=CharTokenizer())
    kw = dict(rac_ratios="1.0", prompts=4, n_samples=2, max_new_tokens=16)
    base = decompose(_small_cfg(small_checkpoint, tmp_path / "a", **kw), say=lambda s: None)
    out = decompose(_small_cfg(injected, tmp_path / "b", **kw), say=lambda s: None)
    b = {(r["rollout"], r["trainer"]): r for r in base["rows"]}
    o = {(r["rollout"], r["trainer"]): r for r in out["rows"]}
    for m in ("gap_max", "gap_mean", "k3", "routing_diff"):
        assert o[("bf16", "bf16")][m] == b[("bf16", "bf16")][m], (m, o[("bf16", "bf16")][m], b[("bf16", "bf16")][m])
    for rollout in ("w16a4", "w4a4"):
        key = (rollout, "bf16")
        assert o[key]["k3"] > 3 * b[key]["k3"], (key, o[key]["k3"], b[key]["k3"])
        assert o[key]["layer_err_mean"] > 2 * b[key]["layer_err_mean"], (key, o[key], b[key])
    assert out["meta"]["outliers"]["channels"] == [5, 21, 40] and base["meta"]["outliers"] is None
    (s,) = [s for s in floor_summary(out["rows"]) if s["trainer"] == "bf16"]
    assert (s["w4a4"], s["floor"]) == ("w4a4", "bf16")
    assert s["k3_ratio"] == o[("w4a4", "bf16")]["k3"] / o[("bf16", "bf16")]["k3"]


def test_static_rac_variants_run_with_calibrated_orders(small_checkpoint, tmp_path, monkeypatch):
    """A static RAC variant gets calibrated orders (the BF16 policy's samples on training-split prompts) after
    each quantization to it: the same orders when it samples and when it scores (self-check 0), and orders
    other than the weights' prior (its log-probs, on one fixed batch, differ from the uncalibrated run's)."""
    from quads.experiments import diagnose as diag

    p = tmp_path / "grid.yaml"
    p.write_text("rollout:\n  static: {weight: nvfp4, act: nvfp4, rac_ratio: 0.5, rac_selection: static}\n"
                 "  w4a4: {weight: nvfp4, act: nvfp4}\ntrainer:\n  w4a16-qat: {weight: nvfp4}\n")
    calls = []
    real = diag.calibrate_static_channels
    monkeypatch.setattr(diag, "calibrate_static_channels", lambda m, run: calls.append(1) or real(m, run))
    kw = dict(recipe_grid=str(p), layer_errors=False, static_calibration_prompts=3)
    own = decompose(_small_cfg(small_checkpoint, tmp_path / "a", sample_with="static", **kw), say=lambda s: None)
    assert own["self_check"] == 0.0 and len(calls) == 2  # once before sampling, once before scoring
    runs = [decompose(_small_cfg(small_checkpoint, tmp_path / f"b{n}", sample_with="w4a4", **{**kw, **extra}),
                      say=lambda s: None) for n, extra in enumerate([{}, {"static_calibration_prompts": 0}])]
    assert len(calls) == 3  # the uncalibrated run calibrates nothing
    cal, prior = ({r["rollout"]: r for r in res["rows"]} for res in runs)
    assert cal["w4a4"]["k3"] == prior["w4a4"]["k3"]  # one fixed batch
    assert cal["static"]["k3"] != prior["static"]["k3"]
    with pytest.raises(ValueError, match="static_calibration_prompts"):
        DiagnoseConfig(static_calibration_prompts=-1)
