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


# ------------------------------------------------------------------ batched fingerprints (one host sync)


@pytest.mark.parametrize("n", [0, 1, 1000, 1_000_003, 1_000_004, 3 * 1_000_003 + 17], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn], ids=str)
def test_batched_fingerprint_equals_the_definition(n, dtype, monkeypatch):
    """``FingerprintBatch`` (column sums over rows of P, a few rows at a time) gives the numbers of the
    one-pass int64 definition exactly, across row and chunk boundaries (chunk of 2 rows here)."""
    from quads.quant import sync

    monkeypatch.setattr(sync, "FINGERPRINT_CHUNK", 2 * 1_000_003)
    g = torch.Generator().manual_seed(n)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.int64).to(torch.uint8)
    t, swapped = raw.view(dtype), raw.view(-1, size).flip(0).reshape(-1).view(dtype)  # elements reversed
    assert sync.fingerprint(t) == sync.fingerprint_reference(t)
    got = sync.fingerprints({"a": t, "b": swapped})
    assert got == {"a": sync.fingerprint_reference(t), "b": sync.fingerprint_reference(swapped)}
    assert n < 2 or got["a"].weighted != got["b"].weighted  # a permutation changes the weighted sum


def _tiny_pair(recipe):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=64, dtype="float32")
    trainer = MoEForCausalLM(cfg)
    rollout = MoEForCausalLM(ModelConfig.preset("tiny", vocab_size=64, dtype="bfloat16"))
    quantize_model(trainer, recipe, "trainer", verbose=False)
    quantize_model(rollout, recipe, "rollout", verbose=False)
    return trainer, rollout


@pytest.mark.parametrize("recipe", list(PRESETS))
def test_sync_matches_the_per_tensor_definition(recipe):
    """Tiny preset, fp32 trainer, BF16 rollout: every rollout operand equals the old path's
    ``ops.quantize_weight(master)[0]`` (or the master in the rollout dtype) and the sync's fingerprints,
    reference and rollout side, equal ``fingerprint_reference`` of those operands; then a single flipped
    bit in one rollout operand is caught."""
    from quads.quant.sync import fingerprint_reference

    trainer, rollout = _tiny_pair(recipe)
    _train_step(trainer)
    report = sync_weights(trainer, rollout)
    assert report.ok and report.n_checked == 8
    params = dict(trainer.named_parameters())
    for key, fp in report.fingerprints.items():
        mod, _, pname = key.rpartition(".")
        m = rollout.get_submodule(mod)
        if m.spec.weight == "none":
            want = params[key].detach().to(torch.bfloat16)
        else:
            want = quantize_weight(params[key], m.spec, m.weight_dtype)[0]
        got = m.stores[pname].get()
        assert got.dtype == want.dtype and torch.equal(got.view(torch.int16), want.view(torch.int16)), key
        assert fp == fingerprint_reference(want), key
    e = rollout.model.layers[2].mlp.experts
    store = e.stores["gate_up_proj"]
    w = e.gate_up_proj if e.spec.weight == "none" else store.w_q
    with torch.no_grad():
        w.view(torch.int16).view(-1)[4321] ^= 1  # the lowest mantissa bit of one element
    with pytest.raises(WeightSyncError, match="layers.2.mlp.experts.gate_up_proj"):
        verify_sync(trainer, rollout)
