"""Sharded safetensors + JSON files into a temp folder next to the destination, renamed at the end.

Shards follow the Hugging Face layout: ``model.safetensors`` when everything fits in one shard, else
``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json`` (``metadata.total_size`` in bytes,
``weight_map`` tensor -> shard file).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from quads.errors import UsageError
from quads.io import atomic_dir, check_output_dir


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` in insertion order, cutting a new shard before it would exceed ``max_shard_bytes``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        b = _nbytes(t)
        if shards[-1] and size + b > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t.contiguous()
        size += b
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, shard in zip(names, shards):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
                 "weight_map": {k: names[i] for i, s in enumerate(shards) for k in s}}
        write_json(folder / "model.safetensors.index.json", index)
    return names


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


MARKER_FILE = "quads_export.json"  # every export holds it ({"producer": "quads", ...}): what --force may replace


def is_export(folder: Path) -> bool:
    """Whether ``folder`` is an earlier quads export (its ``quads_export.json`` names quads as producer)."""
    try:
        return json.loads((Path(folder) / MARKER_FILE).read_text()).get("producer") == "quads"
    except (OSError, ValueError, AttributeError):
        return False


def check_out(out: Path, force: bool, source: Path) -> None:
    """``out`` may be written: new, empty, or (with ``force``) an earlier export that is not ``source``.

    A run folder, a policy, a checkpoint or any other folder is never replaced, ``--force`` or not.
    """
    out = check_output_dir(out, "--out")
    if not out.exists() or not any(out.iterdir()):
        return
    o, src = out.resolve(), Path(source).resolve()
    if o == src or o in src.parents:
        raise UsageError(f"--out {out} holds the checkpoint being exported ({source}); pass another folder")
    if not is_export(out):
        raise UsageError(f"--out {out} is not empty and is not a quads export (no {MARKER_FILE}); it may be a "
                         "run folder or a policy, so it is never replaced: pass a new or empty folder")
    if not force:
        raise UsageError(f"--out {out} already exists (an earlier quads export); pass --force to replace it")


@contextmanager
def staging_dir(out: Path, force: bool, source: Path) -> Iterator[Path]:
    """Yield an empty temp folder beside ``out``; on success it replaces ``out``, on error it is removed."""
    check_out(out, force, source)
    with atomic_dir(out) as tmp:
        yield tmp


def write_files(files: dict[str, bytes], folder: Path) -> None:
    for name, blob in files.items():
        (folder / name).write_bytes(blob)
