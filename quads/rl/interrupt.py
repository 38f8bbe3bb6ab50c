"""Ctrl-C during training: finish the step, save a checkpoint, then stop (exit 130 through the CLI).

``StopRequest.install()`` replaces the SIGINT handler for the training loop: the first Ctrl-C only
sets ``requested``; the loop checks it after each step, saves a resumable checkpoint and raises
``KeyboardInterrupt`` naming the resume command. A second Ctrl-C interrupts at once (the last saved
checkpoint stays resumable: checkpoints are written atomically). ``restore()`` puts the previous
handler back. Off the main thread, and under torchrun (where every rank would have to agree), the
handler is left alone.

``StopClock`` times a run's steps, evals and checkpoint saves, so that ``time_limit_s`` stops a run
before its deadline, closing eval and checkpoint included.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
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


class StopClock:
    """Durations of a run's steps, evals and checkpoint saves, for ``time_limit_s`` as a deadline.

    ``past_deadline(elapsed, limit)`` is true when one more step (as long as the longest of the last three)
    followed by the closing held-out eval and checkpoint (as long as the latest ones; an eval not timed yet
    counts as a step, a save as nothing) would end after ``limit`` seconds: the run stops now, so that it
    ends, eval and checkpoint written, before its limit rather than one step plus an eval after it.
    """

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.steps: list[float] = []

    @contextlib.contextmanager
    def timing(self, what: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            dt = time.monotonic() - t0
            self.last[what] = dt
            if what == "step":
                self.steps = (self.steps + [dt])[-3:]

    def past_deadline(self, elapsed: float, limit: float) -> bool:
        step = max(self.steps, default=0.0)
        return elapsed + step + self.last.get("eval", step) + self.last.get("save", 0.0) >= limit
