"""The mismatch amplifier (quads.quant.amplify, recipe.rollout_error_scale): x + alpha (Q(x) - x) per operand."""

from dataclasses import replace

import pytest
import torch

from quads.config import save_config
from quads.quant import ops
from quads.quant.linear import spec_linear
from quads.quant.rac import rac_channels, rac_operands
from quads.quant.recipe import LinearSpec, Recipe, get_recipe
from quads.rl.config import RecipeSection, TrainConfig

W4A4 = LinearSpec.of(weight="nvfp4", act="nvfp4")
RAC = LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5)
FP8 = LinearSpec.of(weight="fp8", act="fp8")
BF16 = torch.bfloat16


def _xw(t=24, k=64, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, 3] *= 20  # an outlier channel, so RAC selects it
    return x, torch.randn(n, k, generator=g) * 0.1


def _run(spec, x, w):
    w_q = ops.quantize_weight(w, spec, BF16)[0]
    return spec_linear(x, w, spec, w_q=w_q)


@pytest.mark.parametrize("spec", [W4A4, RAC, FP8], ids=["W4A4", "W4A4+RAC", "FP8"])
def test_alpha_one_is_the_recipe_bit_for_bit(spec):
    x, w = _xw()
    amplified_one = get_recipe(Recipe("r", rollout=spec), rollout_error_scale=1.0).rollout
    assert torch.equal(_run(amplified_one, x, w), _run(spec, x, w))
    # the whole config path: rollout_error_scale=1 builds exactly the preset recipe
    cfg = TrainConfig(recipe=RecipeSection(name="quads", rollout_error_scale=1.0))
    assert get_recipe(cfg.recipe.name, **cfg.recipe.overrides()) == get_recipe("quads")


def test_alpha_zero_is_the_unquantized_gemm_bit_for_bit():
    x, w = _xw()
    y = _run(replace(W4A4, error_scale=0.0), x, w)
    assert torch.equal(y, ops.lowp_matmul(x, w.to(BF16)).to(x.dtype))
    assert not torch.equal(_run(W4A4, x, w), y)  # the format itself does change the output


@pytest.mark.parametrize("alpha", [0.5, 3.0, 16.0])
@pytest.mark.parametrize("spec", [W4A4, RAC, FP8], ids=["W4A4", "W4A4+RAC", "FP8"])
def test_amplified_gemm_matches_its_fp64_definition(spec, alpha):
    """y = (x + a (X_eff - x)) @ (W + a (QDQ(W) - W)).T with X_eff the (RAC-compensated) operand, in fp64."""
    x, w = _xw()
    wb = w.to(BF16).double()
    wq = ops.quantize_weight(w, spec, BF16)[0].double()
    if spec.act == "nvfp4":
        xq, rq, s = rac_operands(x, n=rac_channels(x.shape[1], spec.rac_ratio))
        x_eff = xq.double() if s is None else xq.double().index_add(1, s, rq.double())
    else:
        x_eff = ops.fp8_act_qdq(x, spec.fp8_scheme).double()
    xd = x.double()
    ref = (xd + alpha * (x_eff - xd)) @ (wb + alpha * (wq - wb)).T
    y = _run(replace(spec, error_scale=alpha), x, w).double()
    err = (y - ref).abs().max().item()
    bound = 1e-5 * ref.abs().max().item()  # fp32 operands and accumulation over K + |S| <= 96 terms
    assert err <= bound, f"alpha={alpha} {spec.describe()}: max error {err:.3g} > {bound:.3g}"


def test_output_error_grows_linearly_with_alpha():
    """Relative output error against the unquantized GEMM: alpha times the format's, to first order."""
    x, w = _xw(t=64, k=128, n=64)
    exact = ops.lowp_matmul(x, w.to(BF16))

    def rel(alpha):
        return ((_run(replace(RAC, error_scale=alpha), x, w) - exact).norm() / exact.norm()).item()

    base = rel(1.0)
    assert base > 0
    for alpha in (2.0, 4.0, 8.0):
        assert 0.9 * alpha <= rel(alpha) / base <= 1.1 * alpha, (alpha, rel(alpha) / base)


def test_bad_alpha_and_fast_paths_refused():
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rollout_error_scale"):
            RecipeSection(rollout_error_scale=bad)
        with pytest.raises(ValueError, match="error_scale"):
            LinearSpec.of(weight="nvfp4", act="nvfp4", error_scale=bad)
    with pytest.raises(ValueError, match="grouped"):
        get_recipe("nvfp4", rollout_error_scale=4.0, expert_path="grouped")
    # auto: the experts loop (the batched path has no amplified GEMM); only the rollout side is amplified
    r = get_recipe("quads", rollout_error_scale=4.0)
    assert r.expert_path == "loop" and r.rollout.error_scale == 4.0 and r.trainer.error_scale == 1.0
    assert get_recipe("bf16", rollout_error_scale=4.0).expert_path == "auto"  # nothing quantized: nothing to amplify
    with pytest.raises(ValueError, match="rollout_backend=quads"):
        TrainConfig(recipe=RecipeSection(rollout_error_scale=4.0), rollout_backend="vllm")


def test_engine_refuses_the_capturable_expert_path_and_config_records_alpha(tmp_path):
    """The static decode's device-side expert dispatch (forward_static, the batched layout) has no amplifier:
    an amplified rollout model dispatches experts on the host, to the loop, and refuses moe_dispatch=device."""
    from conftest import tiny_model

    from quads.model.tokenizer import CharTokenizer
    from quads.quant import quantize_model
    from quads.rollout import RolloutEngine
    from quads.rollout.decode import supports_device_dispatch

    def rollout_model(recipe):
        model = tiny_model()
        quantize_model(model, recipe, side="rollout", verbose=False)
        return model

    cfg = TrainConfig(recipe=RecipeSection(name="nvfp4", rollout_error_scale=8.0), device="cpu")
    amplified = rollout_model(get_recipe(cfg.recipe.name, **cfg.recipe.overrides()))
    assert supports_device_dispatch(rollout_model(get_recipe("nvfp4")))
    assert not supports_device_dispatch(amplified)
    assert all(m.mlp.experts.grouped is False for m in amplified.model.layers)  # the loop, not the batched path
    assert RolloutEngine(amplified, CharTokenizer(), decode="static").decode_plan()[1] == "host"
    with pytest.raises(ValueError, match="capturable"):
        RolloutEngine(amplified, CharTokenizer(), moe_dispatch="device").decode_plan()
    save_config(cfg, tmp_path / "config.yaml")
    assert "rollout_error_scale: 8.0" in (tmp_path / "config.yaml").read_text()
