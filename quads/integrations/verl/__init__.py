"""quads inside verl: trainer-side QAT on verl's FSDP2 actor, the ``quads`` vLLM rollout, metrics.

- ``plugin``: the ``verl.plugins`` entry point (``pip install quads[verl]``; verl imports it).
- ``engine``: ``QuadsFSDPEngine`` (actor strategy ``quads_fsdp2``) and ``QuadsFSDPEngineConfig``.
- ``metrics``: quads' ``mismatch/*`` beside verl's ``rollout_corr/*``.
- ``config``: the verl config entries of one recipe (``python -m quads.integrations.verl --help``).

docs/VERL.md has the configs of quads' recipes and what was tested.
"""
