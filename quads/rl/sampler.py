"""The prompt sampler: epochs over the training examples in a seeded random order, with a saveable state.

Each epoch is a fresh permutation drawn from ``random.Random(seed)``; ``take(k)`` returns the next
``k`` examples, crossing epoch boundaries as needed. ``state_dict()`` / ``load_state_dict()`` capture the
RNG state, the current permutation and the position, so a resumed run draws exactly the same prompts.
"""

from __future__ import annotations

import random
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PromptSampler(Generic[T]):
    def __init__(self, items: list[T], seed: int) -> None:
        if not items:
            raise ValueError("the prompt sampler got no training examples; check task.name / task.dataset")
        self.items = items
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.pos = 0
        self.epoch = 0

    def _new_epoch(self) -> None:
        self.order = list(range(len(self.items)))
        self.rng.shuffle(self.order)
        self.pos = 0
        self.epoch += 1

    def take(self, k: int) -> list[T]:
        out: list[T] = []
        while len(out) < k:
            if self.pos >= len(self.order):
                self._new_epoch()
            out.append(self.items[self.order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "order": list(self.order), "pos": self.pos, "epoch": self.epoch,
                "n_items": len(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["n_items"] != len(self.items):
            raise ValueError(
                f"sampler state is for {state['n_items']} training examples but the task now has "
                f"{len(self.items)}; resume with the same task.name / task.dataset / task.train_size"
            )
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])
        self.pos = int(state["pos"])
        self.epoch = int(state["epoch"])
