"""``python -m quads.integrations.verl``: print the verl config entries of a quads recipe."""

from __future__ import annotations

import argparse
import sys

import yaml

from quads.integrations.verl.config import shell_overrides, verl_config
from quads.quant.recipe import PRESETS, get_recipe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quads.integrations.verl",
                                description="verl config entries (Hydra overrides or YAML) that run a quads recipe")
    p.add_argument("--recipe", default="quads", choices=list(PRESETS), help="quads recipe preset (default quads)")
    p.add_argument("--rac-ratio", type=float, default=None, help="RAC ratio of the rollout (recipes with NVFP4 activations)")
    p.add_argument("--format", default="overrides", choices=("overrides", "yaml"),
                   help="overrides: one Hydra override per line, quoted for a shell; yaml: a block to merge into a PPO config")
    a = p.parse_args(argv)
    try:
        recipe = get_recipe(a.recipe, **({} if a.rac_ratio is None else {"rac_ratio": a.rac_ratio}))
    except ValueError as e:
        print(f"python -m quads.integrations.verl: {e}", file=sys.stderr)
        return 2
    if a.format == "yaml":
        print(yaml.safe_dump(verl_config(recipe), sort_keys=False), end="")
    else:
        print("\n".join(shell_overrides(recipe)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
