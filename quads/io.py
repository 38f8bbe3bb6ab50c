"""Atomic file writes: write to a temp file in the same folder, fsync, then ``os.replace``.

A crash mid-write leaves the previous file (or none) in place, never a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` then move ``tmp_path`` over ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_replace_dir(src_tmp: Path, dst: Path) -> None:
    """Move a fully written temp folder to ``dst``; an existing ``dst`` is replaced only after success."""
    dst = Path(dst)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
        os.replace(src_tmp, dst)
        shutil.rmtree(old)
    else:
        os.replace(src_tmp, dst)


@contextmanager
def atomic_dir(folder: str | Path) -> Iterator[Path]:
    """Yield an empty temp folder ``.<name>.<random>.tmp`` beside ``folder``; when the block finishes it
    replaces ``folder`` (``atomic_replace_dir``), and on any error it is removed, so ``folder`` is
    either the old one or the complete new one, never half-written."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        yield tmp
        atomic_replace_dir(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
