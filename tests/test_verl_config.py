"""The verl config entries of a recipe (``quads.integrations.verl.config``; needs no verl). That verl
itself builds its configs from them is tested in tests/test_verl_plugin.py (``make test-verl``)."""

import pytest

from quads.integrations.verl import config as vconfig
from quads.integrations.verl.__main__ import main
from quads.quant.recipe import PRESETS, get_recipe

RECIPES = [get_recipe(n) for n in PRESETS] + [get_recipe("quads", rac_ratio=0.25, act_scale="token"),
                                              get_recipe("w4a16-qat", weight_tile=(16, 16))]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}-{r.rollout.describe()}")
def test_both_sides_get_the_same_recipe(recipe):
    cfg = vconfig.verl_config(recipe)["actor_rollout_ref"]
    actor, rollout = cfg["actor"], cfg["rollout"]
    if recipe.trainer.is_identity:
        assert actor == {"strategy": "fsdp2"}
    else:
        fc = actor["fsdp_config"]
        assert actor["strategy"] == "quads_fsdp2"
        assert get_recipe(fc["quads_recipe"], **fc["quads_recipe_overrides"]) == recipe
    if recipe.rollout.is_identity:
        assert "engine_kwargs" not in rollout
    else:
        qc = rollout["engine_kwargs"]["vllm"]["hf_overrides"]["quantization_config"]
        got = get_recipe(qc["recipe"]) if isinstance(qc["recipe"], str) else type(recipe).from_dict(qc["recipe"])
        assert got == recipe


def test_cli_prints_overrides_and_refuses_bad_input(capsys):
    assert main(["--recipe", "quads", "--rac-ratio", "0.25"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "\"actor_rollout_ref.actor.strategy='quads_fsdp2'\"" in out
    assert any("rac_ratio:0.25" in line for line in out)
    assert main(["--recipe", "bf16", "--rac-ratio", "0.3"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "rac_ratio=0.3 needs NVFP4 activations" in err


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}-{r.rollout.describe()}")
def test_shell_quoting_gives_hydra_the_overrides_unchanged(recipe):
    """What bash hands ``main_ppo`` for the printed lines is ``hydra_overrides`` word for word (no brace
    expansion of ``{a:1,b:2}``, Hydra's quotes kept)."""
    import subprocess

    lines = vconfig.shell_overrides(recipe)
    got = subprocess.run(["bash", "-c", "printf '%s\\n' " + " ".join(lines)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert got == vconfig.hydra_overrides(recipe)
    unquoted = subprocess.run(["bash", "-c", "printf '%s\\n' " + " ".join(vconfig.hydra_overrides(recipe))],
                              capture_output=True, text=True, check=True).stdout.splitlines()
    if any("{" in o for o in vconfig.hydra_overrides(recipe)):
        assert unquoted != vconfig.hydra_overrides(recipe)  # why the quoting is needed
