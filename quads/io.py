"""Atomic file writes: write to a temp file in the same folder, fsync, then ``os.replace``.

A crash mid-write leaves the previous file (or none) in place, never a half-written one. Outputs get
the mode a plain ``open`` / ``mkdir`` would give (0666 / 0777 less the umask), not ``tempfile``'s (or
``safetensors``') owner-only 0600 / 0700, so they can be shared as the user's umask allows.
``check_output_dir`` checks a destination before any expensive work.
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

from quads.errors import UsageError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output_dir(path: str | Path, flag: str) -> Path:
    """``path`` is a folder that exists or can be made, and its first existing ancestor is writable.

    Raises ``UsageError`` naming ``flag`` when ``path`` (or an ancestor) is a file or not writable.
    """
    path = Path(path)
    node = path
    while not node.exists() and node != node.parent:
        node = node.parent
    if not node.is_dir():
        what = "is a file" if node == path else f"cannot be made: {node} is a file"
        raise UsageError(f"{flag} {str(path)!r} {what}; pass a folder path")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".quads-write-check.", dir=node)
    except OSError as e:
        raise UsageError(f"{flag} {str(path)!r}: cannot write in {str(node)!r} ({e.strerror}); pass a writable "
                         "folder") from None
    os.close(fd)
    os.unlink(tmp)
    return path


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` then move ``tmp_path`` over ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())
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


def _apply_umask(folder: Path, mask: int) -> None:
    """Give every file under ``folder`` the mode a plain ``open`` would (0666 less ``mask``, execute bits
    kept): some writers (``safetensors.save_file``) create their files owner-only."""
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            os.chmod(path, (0o666 | (os.stat(path).st_mode & 0o111)) & ~mask)


@contextmanager
def atomic_dir(folder: str | Path) -> Iterator[Path]:
    """Yield an empty temp folder ``.<name>.<random>.tmp`` beside ``folder``; when the block finishes it
    replaces ``folder`` (``atomic_replace_dir``), and on any error it is removed, so ``folder`` is
    either the old one or the complete new one, never half-written."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    mask = _umask()
    tmp.chmod(0o777 & ~mask)
    try:
        yield tmp
        _apply_umask(tmp, mask)
        atomic_replace_dir(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
