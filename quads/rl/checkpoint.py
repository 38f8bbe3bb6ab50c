"""Training checkpoints: everything needed to continue a run exactly where it stopped.

Layout under the run folder::

    checkpoints/step_000020/state.pt     master weights, AdamW state, RNG states, sampler state, step,
                                         the resolved TrainConfig and the ModelConfig
    checkpoints/step_000020/config.yaml  the resolved config (human-readable copy)
    checkpoints/latest                   the name of the newest complete checkpoint folder

Writes are atomic: a checkpoint is assembled in a hidden temp folder, renamed into place, and only
then is ``latest`` replaced (itself atomically). A crash at any point leaves ``latest`` naming the
previous, complete checkpoint; leftover temp folders are removed by the next save.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from quads.io import atomic_dir, atomic_write_text

CKPT_DIR = "checkpoints"
LATEST = "latest"
STATE_FILE = "state.pt"
KEEP = 2  # complete checkpoints kept (the newest ones)


def rng_state() -> dict[str, Any]:
    """Python, torch CPU and (when present) CUDA RNG states."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_train_state(run_dir: str | Path, step: int, state: dict[str, Any], config: dict[str, Any]) -> Path:
    """Write ``checkpoints/step_{step:06d}`` atomically, point ``latest`` at it, prune old ones."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step:06d}"
    with atomic_dir(final) as tmp:
        torch.save({**state, "step": step, "config": config}, tmp / STATE_FILE)
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    atomic_write_text(root / LATEST, final.name + "\n")
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-KEEP]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder named by ``checkpoints/latest``, or None when the run has no complete checkpoint."""
    root = Path(run_dir) / CKPT_DIR
    ptr = root / LATEST
    if not ptr.is_file():
        return None
    folder = root / ptr.read_text().strip()
    if not (folder / STATE_FILE).is_file():
        raise ValueError(
            f"{ptr} names {folder.name!r} but {folder / STATE_FILE} is missing; the run folder was edited "
            "by hand: point 'latest' at an existing checkpoints/step_* folder"
        )
    return folder


def load_train_state(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / STATE_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a corrupt file: say which and what to do
        raise ValueError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}; delete that folder and "
                         "point checkpoints/latest at the previous one") from None
