"""Weight sync: bit-exact rollout weights for every recipe, corruption detected, static RAC recalibration."""

import copy

import pytest
import torch

from quads.model import ModelConfig, MoEForCausalLM
from quads.quant import (
    PRESETS,
    WeightSyncError,
    fingerprint,
    get_recipe,
    quantize_model,
    sync_weights,
    verify_sync,
)
from quads.quant.ops import quantize_weight


def _pair(recipe, trainer_dtype=torch.float32, rollout_dtype=torch.float32):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=4,
                      moe_intermediate_size=32)  # fmt: skip
    trainer = MoEForCausalLM(cfg).to(trainer_dtype)
    rollout = copy.deepcopy(trainer).to(rollout_dtype)
    quantize_model(trainer, recipe, "trainer", verbose=False)
    quantize_model(rollout, recipe, "rollout", verbose=False)
    return trainer, rollout


def _train_step(model, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids).logits.square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("recipe", list(PRESETS) + ["quads-static", "w4a4-16x16"])
def test_sync_is_bit_exact_for_every_recipe(recipe):
    r = {
        "quads-static": get_recipe("quads", rac_selection="static", act_scale="token"),
        "w4a4-16x16": get_recipe("w4a4-qat", weight_tile=(16, 16)),
    }.get(recipe, recipe)
    trainer, rollout = _pair(r)
    _train_step(trainer)
    report = sync_weights(trainer, rollout)
    assert report.ok and report.n_checked == 4 and report.n_tensors == len(trainer.state_dict())
    for name, p in trainer.named_parameters():
        assert torch.equal(p, rollout.get_parameter(name)), name
    for i in range(2):
        te, re_ = trainer.model.layers[i].mlp.experts, rollout.model.layers[i].mlp.experts
        for pname in ("gate_up_proj", "down_proj"):
            expected = quantize_weight(getattr(te, pname), re_.spec, re_.weight_dtype)[0]
            got = re_.stores[pname].get()
            assert torch.equal(got, expected)
            if te.spec.weight != "none":  # the trainer's own cached QDQ(W)
                assert torch.equal(te.stores[pname].get(), got)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.isfinite(rollout(ids).logits).all()


@pytest.mark.parametrize("recipe", ["quads", "bf16", "fp8"])
def test_bf16_rollout_of_fp32_trainer_is_bit_exact(recipe):
    trainer, rollout = _pair(recipe, rollout_dtype=torch.bfloat16)
    _train_step(trainer)
    assert sync_weights(trainer, rollout).ok  # both quantize master.to(bfloat16)


@pytest.mark.parametrize("where", ["dequantized", "master_then_refresh"])
def test_corrupted_rollout_weight_is_detected(where):
    trainer, rollout = _pair("quads")
    sync_weights(trainer, rollout)
    e = rollout.model.layers[1].mlp.experts
    with torch.no_grad():
        if where == "dequantized":
            w = e.stores["down_proj"].w_q
            w.view(-1)[123] = -w.view(-1)[123] if w.view(-1)[123] != 0 else 1.0  # flip one element
        else:
            e.gate_up_proj.view(-1)[7] += 1.0
            e.refresh()
    with pytest.raises(WeightSyncError, match="differ"):
        verify_sync(trainer, rollout)
    report = verify_sync(trainer, rollout, raise_on_mismatch=False)
    assert len(report.mismatches) == 1 and report.mismatches[0].startswith("model.layers.1.mlp.experts.")
    assert sync_weights(trainer, rollout).ok  # a fresh sync repairs it


def test_stale_rollout_after_trainer_step_is_detected():
    trainer, rollout = _pair("w4a16-qat")
    _train_step(trainer)
    with pytest.raises(WeightSyncError):
        verify_sync(trainer, rollout)


def test_fingerprint_catches_single_bit_and_swaps():
    x = torch.randn(64, 32).bfloat16()
    fp = fingerprint(x)
    y = x.clone()
    y.view(torch.int16).view(-1)[5] ^= 1  # lowest mantissa bit of one element
    assert fingerprint(y) != fp
    z = x.clone().view(-1)
    z[[3, 4]] = z[[4, 3]]
    assert z[3] == z[4] or fingerprint(z.view(64, 32)) != fp
    assert fingerprint(x.clone()) == fp


def test_static_orders_recalibrated_at_sync():
    trainer, rollout = _pair(get_recipe("quads", rac_selection="static", act_scale="token"))
    sel = rollout.model.layers[0].mlp.experts.selectors["gate_up_proj"]
    before = sel.order.clone()
    with torch.no_grad():
        rollout(torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3)))
    assert sel.count.sum() > 0  # residual statistics gathered during rollout
    assert torch.equal(sel.order, before)  # but the order is frozen until the next sync
    report = sync_weights(trainer, rollout)
    assert report.n_static_refreshed == 2 and sel.count.sum() == 0
    assert not torch.equal(sel.order, before)


def test_mismatched_models_rejected():
    trainer, rollout = _pair("quads")
    other = MoEForCausalLM(ModelConfig(vocab_size=64, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                       n_experts=4, moe_intermediate_size=32))  # fmt: skip
    quantize_model(other, "quads", "rollout", verbose=False)
    with pytest.raises(ValueError, match="state-dict keys"):
        sync_weights(trainer, other)


def test_calibrate_static_channels_and_parameter_swap():
    from quads.quant import calibrate_static_channels

    trainer, rollout = _pair(get_recipe("quads", rac_selection="static"))
    sel = rollout.model.layers[1].mlp.experts.selectors["down_proj"]
    before = sel.order.clone()
    n = calibrate_static_channels(rollout, lambda m: m(torch.randint(0, 64, (4, 16))))
    assert n == 2 * 2 * 4 and not torch.equal(sel.order, before)  # layers x GEMMs x experts
    with pytest.raises(ValueError, match="static RAC"):
        calibrate_static_channels(trainer, lambda m: None)
    # the store follows the module's current parameter object (e.g. after FSDP2 or a user swap)
    e = trainer.model.layers[0].mlp.experts
    e.down_proj = torch.nn.Parameter(e.down_proj.detach() * 2)
    assert torch.equal(e.stores["down_proj"].get(), quantize_weight(e.down_proj, e.spec, e.weight_dtype)[0])
