"""Recipes: presets per DESIGN.md section 4, overrides, validation, round trip."""

import json

import pytest

from quads.quant.recipe import (
    PRESETS,
    FP8ActConfig,
    FP8WeightConfig,
    LinearSpec,
    NVFP4ActConfig,
    NVFP4WeightConfig,
    Recipe,
    get_recipe,
)

# (trainer weight, trainer act, rollout weight, rollout act, rollout rac ratio) from the DESIGN table
TABLE = {
    "bf16": ("none", "none", "none", "none", 0.0),
    "fp8": ("none", "none", "fp8", "fp8", 0.0),
    "nvfp4": ("none", "none", "nvfp4", "nvfp4", 0.0),
    "w4a16-qat": ("nvfp4", "none", "nvfp4", "nvfp4", 0.0),
    "w4a4-qat": ("nvfp4", "nvfp4", "nvfp4", "nvfp4", 0.0),
    "quads": ("nvfp4", "none", "nvfp4", "nvfp4", 0.5),
    "w4a16": ("nvfp4", "none", "nvfp4", "none", 0.0),  # beside the DESIGN table: the weight-only pair
}


@pytest.mark.parametrize("name", list(TABLE))
def test_presets_match_design_table(name):
    r = get_recipe(name)
    assert (r.trainer.weight, r.trainer.act, r.rollout.weight, r.rollout.act, r.rollout.rac_ratio) == TABLE[
        name
    ]
    assert r.trainer.rac_ratio == 0.0
    assert r.targets == ("*.mlp.experts",)
    assert set(PRESETS) == set(TABLE)


@pytest.mark.parametrize("name", list(TABLE))
def test_round_trip_through_json(name):
    r = get_recipe(name, weight_tile=(16, 16), act_scale="token")
    d = json.loads(json.dumps(r.to_dict()))
    assert Recipe.from_dict(d) == r


def test_overrides_route_to_sides():
    r = get_recipe(
        "quads",
        rac_ratio=0.25,
        rac_selection="static",
        act_scale="token",
        trainer_weight_tile=(16, 16),
        rollout_weight_tile=(16, 16),
        targets=["*.experts", "*.mlp.gate"],
    )
    assert r.rollout.rac_ratio == 0.25 and r.rollout.rac_selection == "static"
    assert r.trainer.rac_ratio == 0.0  # RAC overrides go to the rollout side only
    assert r.rollout.act_config == NVFP4ActConfig(scale="token", rac_ratio=0.25, rac_selection="static")
    assert r.trainer.act_config is None  # the W4A16 trainer has no activation quantizer to carry act_scale
    assert r.trainer.weight_tile == r.rollout.weight_tile == (16, 16)
    assert r.targets == ("*.experts", "*.mlp.gate")
    assert get_recipe("w4a4-qat", trainer_rac_ratio=0.5).trainer.rac_ratio == 0.5
    w4a4 = get_recipe("w4a4-qat", act_scale="token")  # unprefixed: every side with NVFP4 activations
    assert w4a4.trainer.act_scale == w4a4.rollout.act_scale == "token"
    assert get_recipe("bf16", act_scale="token", weight_tile=(16, 16)) == PRESETS["bf16"]  # nothing to carry them


def test_unknown_recipe_lists_valid_ones():
    with pytest.raises(ValueError, match="valid: bf16, fp8, nvfp4, w4a16-qat, w4a4-qat, quads"):
        get_recipe("nvfp8")


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), "half", True])
def test_ratio_outside_unit_interval(ratio):
    with pytest.raises(ValueError, match="rac_ratio"):
        get_recipe("quads", rac_ratio=ratio)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rac_selection="random"), "valid: dynamic, static"),
        (dict(act_scale="channel"), "valid: tensor, token"),
        (dict(weight_tile=(1, 32)), "weight tile"),
        (dict(nvfp4_mode="cutlass"), "te, torchao, vllm, modelopt, compressed_tensors"),
        (dict(fp8_scheme="col"), "valid: tensor, row, block"),
        (dict(rollout_weight="int4"), "valid: none, nvfp4, fp8"),
        (dict(bogus=1), "unknown recipe override 'bogus'"),
        (dict(weight_dtype="float64"), "bfloat16"),
        (dict(targets=[]), "non-empty"),
    ],
)
def test_invalid_values(kw, match):
    with pytest.raises(ValueError, match=match):
        get_recipe("quads", **kw)


def test_rac_needs_nvfp4_acts():
    with pytest.raises(ValueError, match="needs NVFP4 activations"):
        LinearSpec.of(weight="nvfp4", act="none", rac_ratio=0.5)


def test_mismatched_weight_quantizers_rejected():
    with pytest.raises(ValueError, match="bit for bit"):
        get_recipe("quads", trainer_weight_tile=(16, 16))
    with pytest.raises(ValueError, match="bit for bit"):
        get_recipe("w4a16-qat", rollout_weight="fp8", rollout_act="fp8")


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown recipe keys"):
        Recipe.from_dict({"name": "x", "ratio": 1})
    with pytest.raises(ValueError, match="unknown rollout spec keys"):
        Recipe.from_dict({"name": "x", "rollout": {"ratio": 1}})


# ------------------------------------------------------------------ typed per-operand configs


def test_presets_are_built_from_typed_operand_configs():
    q = PRESETS["quads"]
    assert q.trainer == LinearSpec(weight_config=NVFP4WeightConfig())
    assert q.rollout == LinearSpec(NVFP4WeightConfig(tile=(1, 16), mode="te"), NVFP4ActConfig(rac_ratio=0.5))
    assert PRESETS["fp8"].rollout == LinearSpec(FP8WeightConfig("row"), FP8ActConfig("row"))
    assert PRESETS["bf16"].trainer == LinearSpec() and PRESETS["bf16"].trainer.is_identity


# The flat form of every preset, exactly as the flat LinearSpec wrote it (the vLLM quantization_config and
# verl configs carry it, so their hashes stay the same).
FLAT_W16A16 = {"weight": "none", "act": "none", "rac_ratio": 0.0, "rac_selection": "dynamic", "act_scale": "tensor",
               "weight_tile": [1, 16], "nvfp4_mode": "te", "fp8_scheme": "row", "error_scale": 1.0}


@pytest.mark.parametrize("name", list(TABLE))
def test_preset_flat_form_is_unchanged(name):
    tw, ta, rw, ra, ratio = TABLE[name]
    want = {"name": name, "trainer": {**FLAT_W16A16, "weight": tw, "act": ta},
            "rollout": {**FLAT_W16A16, "weight": rw, "act": ra, "rac_ratio": ratio},
            "targets": ["*.mlp.experts"], "weight_dtype": "bfloat16", "expert_path": "auto"}
    assert json.dumps(PRESETS[name].to_dict()) == json.dumps(want)  # same keys, same order, same values


@pytest.mark.parametrize("flat", [
    dict(weight="nvfp4", act="nvfp4", rac_ratio=0.25, rac_selection="static", act_scale="token",
         weight_tile=[16, 16], nvfp4_mode="torchao"),
    dict(weight="fp8", act="fp8", fp8_scheme="block", error_scale=2.0),
    dict(weight="nvfp4", act="fp8", fp8_scheme="tensor", weight_tile=(16, 16)),
    dict(act="nvfp4", rac_ratio=1.0),
    dict(),
])
def test_flat_form_round_trip(flat):
    spec = LinearSpec.of(**flat)
    assert LinearSpec.of(**json.loads(json.dumps(spec.to_dict()))) == spec
    full = {**FLAT_W16A16, **{k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()}}
    assert spec.to_dict() == full


@pytest.mark.parametrize("flat, match", [
    (dict(weight="nvfp4", act="none", rac_ratio=0.5), r"rac_ratio=0.5 needs NVFP4 activations .*act='none'"),
    (dict(weight="nvfp4", act="fp8", rac_ratio=0.5), r"needs NVFP4 activations .*act='fp8'"),
    (dict(weight="nvfp4", rac_selection="static"), r"rac_selection='static' is a setting of NVFP4 operands"),
    (dict(weight="nvfp4", act="fp8", act_scale="token"), r"act_scale='token' is a setting of NVFP4 .*act='fp8'"),
    (dict(weight="fp8", act="fp8", weight_tile=(16, 16)), r"weight_tile=\(16, 16\) .*weight='fp8'"),
    (dict(nvfp4_mode="vllm"), r"nvfp4_mode='vllm' is a setting of NVFP4 operands"),
    (dict(weight="nvfp4", act="nvfp4", fp8_scheme="block"), r"fp8_scheme='block' is a setting of FP8 operands"),
    (dict(weight="nvfp4", ratio=0.5), r"unknown LinearSpec field\(s\) \['ratio'\]"),
])
def test_flat_settings_without_their_operand_are_rejected(flat, match):
    with pytest.raises(ValueError, match=match) as e:
        LinearSpec.of(**flat)
    assert "\n" not in str(e.value)


def test_one_mode_and_one_scheme_per_side():
    with pytest.raises(ValueError, match="nvfp4_mode: the weights use 'te' but the activations 'vllm'"):
        LinearSpec(NVFP4WeightConfig(mode="te"), NVFP4ActConfig(mode="vllm"))
    with pytest.raises(ValueError, match="fp8_scheme: the weights use 'row' but the activations 'block'"):
        LinearSpec(FP8WeightConfig("row"), FP8ActConfig("block"))


def test_operand_configs_validate_themselves():
    with pytest.raises(ValueError, match="rac_ratio must be a number in"):
        NVFP4ActConfig(rac_ratio=2.0)
    with pytest.raises(ValueError, match="weight tile"):
        NVFP4WeightConfig(tile=(1, 32))
    with pytest.raises(ValueError, match="LinearSpec.act_config must be NVFP4ActConfig | FP8ActConfig or None"):
        LinearSpec(NVFP4WeightConfig(), "nvfp4")
    with pytest.raises(ValueError, match="LinearSpec.weight_config must be"):
        LinearSpec(NVFP4ActConfig())  # an activation config in the weight slot


@pytest.mark.parametrize("kw, match", [
    (dict(trainer_act_scale="token"), r"recipe 'quads', trainer side: act_scale='token' is a setting of NVFP4"),
    (dict(trainer_rac_ratio=0.5), r"recipe 'quads', trainer side: rac_ratio=0.5 needs NVFP4 activations"),
    (dict(rollout_act="fp8", rollout_fp8_scheme="row"), r"rollout side: rac_ratio=0.5 needs NVFP4 activations"),
])
def test_side_overrides_need_their_operand(kw, match):
    with pytest.raises(ValueError, match=match):
        get_recipe("quads", **kw)


def test_unprefixed_rac_ratio_still_needs_nvfp4_rollout_activations():
    with pytest.raises(ValueError, match="rollout side: rac_ratio=0.5 needs NVFP4 activations"):
        get_recipe("fp8", rac_ratio=0.5)
    assert get_recipe("fp8", rac_ratio=0) == PRESETS["fp8"]


def test_from_dict_rejects_a_setting_without_its_operand():
    d = PRESETS["w4a16-qat"].to_dict()
    d["trainer"]["act_scale"] = "token"
    with pytest.raises(ValueError, match=r"recipe 'w4a16-qat', trainer side: act_scale='token'"):
        Recipe.from_dict(d)
    d = PRESETS["quads"].to_dict()
    d["rollout"]["act"] = "none"  # RAC ratio 0.5 left without its activations
    with pytest.raises(ValueError, match="rollout side: rac_ratio=0.5 needs NVFP4 activations"):
        Recipe.from_dict(d)


def test_spec_replace_switches_operand_format():
    spec = PRESETS["quads"].rollout.replace(act="fp8", rac_ratio=0)
    assert spec == LinearSpec(NVFP4WeightConfig(), FP8ActConfig())
