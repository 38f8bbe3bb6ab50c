"""The ``verl.plugins`` entry point: importing this module registers quads with verl.

verl (0.9.1, ``verl/__init__.py``) loads every entry point of the group ``verl.plugins`` when it is
imported, in every process (driver, workers, rollout servers), unless ``VERL_USE_EXTERNAL_PLUGINS``
is ``none`` (or a list of names without ``quads``). It *loads* the entry point (imports the module)
and does not call anything, so registration happens at import:

- ``QuadsFSDPEngine`` under the actor strategy ``quads_fsdp2`` (``quads.integrations.verl.engine``);
- quads' ``mismatch/*`` metrics beside verl's ``rollout_corr/*`` (``quads.integrations.verl.metrics``).

verl swallows an exception raised by a plugin (it logs it at DEBUG level only), so a failure here is
logged at WARNING first, with its cause, then raised.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Register quads' engine and metrics with verl (idempotent)."""
    from quads.integrations.verl import engine, metrics  # noqa: F401  (the engine registers on import)

    metrics.install()


try:
    register()
except Exception as e:  # verl hides plugin errors: say what failed before it does
    logger.warning("quads verl plugin not loaded: %s: %s", type(e).__name__, e)
    raise
