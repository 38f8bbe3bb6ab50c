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

from quads.io import atomic_dir


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


@contextmanager
def staging_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield an empty temp folder beside ``out``; on success it replaces ``out``, on error it is removed."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not empty; pass --force to replace it")
    with atomic_dir(out) as tmp:
        yield tmp


def write_files(files: dict[str, bytes], folder: Path) -> None:
    for name, blob in files.items():
        (folder / name).write_bytes(blob)
