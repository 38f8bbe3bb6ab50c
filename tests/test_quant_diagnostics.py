"""Per-layer relative error between two specs, replayed on the same captured inputs."""

import pytest
import torch

from quads.model import ModelConfig, MoEForCausalLM
from quads.quant import LinearSpec, get_recipe, quantize_model
from quads.quant.diagnostics import layer_errors, recipe_layer_errors


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=4,
                      moe_intermediate_size=32)  # fmt: skip
    return MoEForCausalLM(cfg)


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
BF16 = LinearSpec()


def test_same_spec_gives_zero_and_errors_order(model):
    w4a4 = LinearSpec.of(weight="nvfp4", act="nvfp4")
    assert all(v == 0.0 for v in layer_errors(model, IDS, w4a4, w4a4).values())
    e_w4 = layer_errors(model, IDS, BF16, LinearSpec.of(weight="nvfp4"))
    e_w4a4 = layer_errors(model, IDS, BF16, w4a4)
    e_rac = layer_errors(model, IDS, BF16, LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=1.0))
    assert list(e_w4) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for name in e_w4:
        assert 0 < e_w4[name] < e_w4a4[name] < 0.5
        assert e_rac[name] < e_w4a4[name]  # RAC closes most of the activation error


def test_quantized_model_untouched(model):
    before = {n: p.clone() for n, p in model.named_parameters()}
    r = get_recipe("quads")
    quantize_model(model, r, "rollout", verbose=False)
    kinds = {n: type(m) for n, m in model.named_modules()}
    errs = recipe_layer_errors(model, lambda m: m(IDS), r)
    assert set(errs) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert all(0 < v < 0.3 for v in errs.values()), errs
    assert kinds == {n: type(m) for n, m in model.named_modules()}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_no_targets():
    m = torch.nn.Sequential(torch.nn.ReLU())
    with pytest.raises(ValueError, match="nothing matches"):
        layer_errors(m, torch.randn(2, 4), BF16, BF16)
