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
    # only the rollout side is amplified; the batched expert path has the amplifier too (grouped_linear)
    r = get_recipe("quads", rollout_error_scale=4.0)
    assert r.expert_path == "auto" and r.rollout.error_scale == 4.0 and r.trainer.error_scale == 1.0
    assert get_recipe("nvfp4", rollout_error_scale=4.0, expert_path="grouped").expert_path == "grouped"
    with pytest.raises(ValueError, match="rollout_backend=quads"):
        TrainConfig(recipe=RecipeSection(rollout_error_scale=4.0), rollout_backend="vllm")


@pytest.mark.parametrize("spec", [LinearSpec.of(weight="nvfp4"), W4A4, RAC, LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, act_scale="token"),
                                  LinearSpec.of(weight="fp8", act="fp8", fp8_scheme="row")],
                         ids=["W4A16", "W4A4", "W4A4+RAC", "W4A4+RAC-token", "FP8"])
@pytest.mark.parametrize("alpha", [0.0, 4.0])
def test_batched_amplified_experts_equal_the_loop(spec, alpha):
    """grouped_linear (the padded [E, C, K] layout of the captured decode step) forms the same amplified
    operands as amplified_linear per expert: equal outputs up to the fp32 GEMMs' accumulation order."""
    from quads.quant.grouped import grouped_linear

    g = torch.Generator().manual_seed(1)
    E, C, K, N = 3, 10, 64, 32
    counts = [10, 4, 0]  # a full expert, a padded one, an empty one
    x = torch.zeros(E, C, K)
    for e, c in enumerate(counts):
        x[e, :c] = torch.randn(c, K, generator=g)
        x[e, :c, 5] *= 30  # an outlier channel
    w = torch.randn(E, N, K, generator=g) * 0.1
    amp = replace(spec, error_scale=alpha)
    w_q = ops.quantize_weight(w, spec, BF16)[0]
    got = grouped_linear(x, w, w_q, amp)
    assert torch.equal(got, grouped_linear(x, w, w_q, amp, w_amp=_amp_weight(w, w_q, amp)))  # a kept operand
    for e, c in enumerate(counts):
        if c:
            ref = spec_linear(x[e, :c], w[e], amp, w_q=w_q[e])
            torch.testing.assert_close(got[e, :c], ref, atol=1e-5 * max(1.0, ref.abs().max().item()), rtol=0)
        assert (got[e, c:] == 0).all()  # zero rows stay zero (no bias, zero operands)
    if alpha != 1.0:
        assert not torch.allclose(got, grouped_linear(x, w, w_q, spec), atol=1e-3)


def _amp_weight(w, w_q, spec):
    from quads.quant.amplify import amplify_weight

    return amplify_weight(w, w_q, spec)


def test_captured_expert_path_runs_the_amplifier_and_sync_updates_it_in_place():
    """The static decode's device-side expert dispatch implements the amplifier: its tokens equal the eager
    loop's, the rollout engine keeps device dispatch, and a weight sync refreshes the kept amplified weight
    in place (a captured graph reads it)."""
    from test_engine_static import PROMPTS, TOK, finishing_params, tiny

    from quads.quant.sync import sync_weights
    from quads.rollout import RolloutEngine
    from quads.rollout.decode import supports_device_dispatch, weights_key

    spec = replace(RAC, error_scale=4.0)
    model = tiny(spec, dtype="float32")
    assert supports_device_dispatch(model)
    params = finishing_params(model, 1.0)
    ref = RolloutEngine(model, TOK, decode="eager").generate(PROMPTS, params)
    got = RolloutEngine(model, TOK, decode="static", moe_dispatch="device").generate(PROMPTS, params)
    assert got.response_ids == ref.response_ids and got.finish_reasons == ref.finish_reasons
    assert torch.equal(got.routing, ref.routing) and got.stats.decode_path == "static+fused-qkv/device"
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    plain = RolloutEngine(tiny(RAC, dtype="float32"), TOK, decode="static", moe_dispatch="device").generate(
        PROMPTS, params)
    assert not torch.allclose(plain.logprobs, got.logprobs, atol=1e-4)  # the amplifier changes the sampler
    store = model.model.layers[0].mlp.experts.stores["gate_up_proj"]
    kept, key = store.get_amplified(), weights_key(model)
    before = kept.clone()
    source = tiny(None, dtype="float32", seed=3)
    sync_weights(source, model)
    assert store.get_amplified() is kept and weights_key(model) == key  # same storage: no re-capture
    assert not torch.equal(kept, before)
    torch.testing.assert_close(kept, _amp_weight(store.param, store.get(), spec), atol=0, rtol=0)


def test_config_records_alpha(tmp_path):
    cfg = TrainConfig(recipe=RecipeSection(name="nvfp4", rollout_error_scale=8.0), device="cpu")
    save_config(cfg, tmp_path / "config.yaml")
    assert "rollout_error_scale: 8.0" in (tmp_path / "config.yaml").read_text()
