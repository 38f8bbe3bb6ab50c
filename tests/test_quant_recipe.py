"""Recipes: presets per DESIGN.md section 4, overrides, validation, round trip."""

import json

import pytest

from quads.quant.recipe import PRESETS, LinearSpec, Recipe, get_recipe

# (trainer weight, trainer act, rollout weight, rollout act, rollout rac ratio) from the DESIGN table
TABLE = {
    "bf16": ("none", "none", "none", "none", 0.0),
    "fp8": ("none", "none", "fp8", "fp8", 0.0),
    "nvfp4": ("none", "none", "nvfp4", "nvfp4", 0.0),
    "w4a16-qat": ("nvfp4", "none", "nvfp4", "nvfp4", 0.0),
    "w4a4-qat": ("nvfp4", "nvfp4", "nvfp4", "nvfp4", 0.0),
    "quads": ("nvfp4", "none", "nvfp4", "nvfp4", 0.5),
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
    assert r.trainer.act_scale == r.rollout.act_scale == "token"
    assert r.trainer.weight_tile == r.rollout.weight_tile == (16, 16)
    assert r.targets == ("*.experts", "*.mlp.gate")
    assert get_recipe("w4a4-qat", trainer_rac_ratio=0.5).trainer.rac_ratio == 0.5


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
        LinearSpec(weight="nvfp4", act="none", rac_ratio=0.5)


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
