"""User mistakes: ``UsageError`` and the up-front checks every command shares.

A ``UsageError`` is a bad flag, file or folder the user can fix; ``quads`` prints it as one line
(``quads <command>: error: <message>``) and exits 2, whichever depth raised it. It is a ``ValueError``,
so the commands' own config-error handlers treat it the same way. Internal failures stay exceptions
with a traceback.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A mistake in the user's input: what was expected, what came, how to fix it."""


def check_device(device: str, field: str = "device") -> None:
    """``device`` must name a device this build of torch can use (``cuda`` needs a CUDA build and a GPU)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"{field}: {device!r} is not a device ({e}); pass cpu or cuda") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no visible CUDA GPU"
            raise UsageError(f"{field}: {device!r} asked for, but this machine has {build}; pass --{field.replace('_', '-')} cpu "
                             "or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"{field}: {device!r}, but only {torch.cuda.device_count()} CUDA devices are visible")
    elif dev.type != "cpu":
        raise UsageError(f"{field}: {device!r} is not supported; pass cpu or cuda")
