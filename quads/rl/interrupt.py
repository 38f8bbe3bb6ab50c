"""Ctrl-C during training: finish the step, save a checkpoint, then stop (exit 130 through the CLI).

``StopRequest.install()`` replaces the SIGINT handler for the training loop: the first Ctrl-C only
sets ``requested``; the loop checks it after each step, saves a resumable checkpoint and raises
``KeyboardInterrupt`` naming the resume command. A second Ctrl-C interrupts at once (the last saved
checkpoint stays resumable: checkpoints are written atomically). ``restore()`` puts the previous
handler back. Off the main thread, and under torchrun (where every rank would have to agree), the
handler is left alone.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self._old: Any = None

    @classmethod
    def install(cls, enabled: bool = True) -> StopRequest:
        stop = cls()
        if enabled and threading.current_thread() is threading.main_thread():
            stop._old = signal.signal(signal.SIGINT, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt("second Ctrl-C: stopped mid-step; the last saved checkpoint is resumable")
        self.requested = True
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop now)", file=sys.stderr)

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
