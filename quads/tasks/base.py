"""The task interface: prompts with known answers, a verifier, and SFT demonstrations.

A ``Task`` hands out ``Example``s for a split and scores a model response with a ``Score``.
Splits are made by hashing the prompt text (``split_of``), so the train and test splits can never
share a prompt, whatever the seeds or sizes asked for; generation is deterministic given the seed.
Verifiers never raise: any failure (malformed answer, sandbox crash, a bug in the verifier itself)
is reward 0 with a reason.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Split = Literal["train", "test"]
SPLITS: tuple[str, ...] = ("train", "test")


@dataclass(frozen=True)
class Example:
    """One prompt with what a verifier needs to score a response to it."""

    prompt: str  # the text the model continues (ends where the response starts)
    answer: str  # the reference answer (a number, a target, a task id ...), as text
    data_source: str  # which verifier scores it (a task name or a dataset's data_source)
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # task-specific extras


@dataclass(frozen=True)
class Score:
    """A verifier's verdict on one response."""

    reward: float  # the RL reward, in [0, 1]
    correct: bool  # the response solves the example (counts for pass@k)
    reason: str  # why: "correct", "wrong answer: got 7, expected 9", "no final answer marker '#'" ...


@runtime_checkable
class Task(Protocol):
    """What the trainer, ``quads pretrain`` and ``quads eval`` need from a task."""

    name: str

    def examples(self, split: Split, n: int | None = None) -> list[Example]:
        """``n`` distinct examples of ``split`` (the task's default count when None), deterministic."""
        ...

    def score(self, example: Example, response: str) -> Score:
        """Score ``response`` (the generated text after the prompt, without EOS); never raises."""
        ...

    def demonstration(self, example: Example) -> str:
        """The target response for supervised fine-tuning (what ``score`` rates as correct)."""
        ...


def split_of(prompt: str, test_fraction: float, salt: str = "") -> str:
    """``"test"`` for a stable ``test_fraction`` of prompts (by SHA-256 of the text), else ``"train"``."""
    h = int.from_bytes(hashlib.sha256((salt + prompt).encode()).digest()[:8], "big")
    return "test" if h / 2**64 < test_fraction else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")


def safe_score(fn, example: Example, response: str) -> Score:
    """Run a verifier body ``fn(example, response)``; any exception becomes reward 0 with a reason."""
    try:
        return fn(example, response)
    except Exception as e:  # a verifier must never raise into the trainer
        return Score(0.0, False, f"verifier error: {type(e).__name__}: {e}")


EXHAUSTED_DRAWS = 2000  # fewest draws without a new prompt before a generated split counts as exhausted


class GeneratedTask:
    """Base for tasks whose examples come from a seeded generator ``_make(rng) -> Example``.

    ``examples(split, n)`` draws from ``random.Random(f"{seed}:{split}")`` and keeps the draws whose
    prompt hashes into ``split`` (``split_of``), dropping duplicates, until it has ``n`` of them. The split
    counts as exhausted when as many draws again as it took to find the last new prompt (at least
    ``EXHAUSTED_DRAWS``) bring no new one, or after ``50 * n + 1000`` draws: then ``examples`` raises,
    naming how many prompts the split offers, or with ``at_most=True`` returns all it found.
    """

    name = "generated"
    default_n = {"train": 10000, "test": 500}

    def __init__(self, seed: int = 0, test_fraction: float = 0.1):
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.seed = seed
        self.test_fraction = test_fraction

    def _make(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def examples(self, split: Split, n: int | None = None, *, at_most: bool = False) -> list[Example]:
        """``n`` distinct examples of ``split``; fewer (all the split offers) with ``at_most=True``."""
        check_split(split)
        n = self.default_n[split] if n is None else n
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(f"{self.name}:{self.seed}:{split}")
        out: list[Example] = []
        seen: set[str] = set()
        attempts, last_new, max_attempts = 0, 0, 50 * n + 1000
        while len(out) < n:
            if attempts >= max_attempts or attempts - last_new > max(EXHAUSTED_DRAWS, last_new):
                if at_most:
                    break
                raise ValueError(
                    f"{self.name}: the {split} split offers only {len(out)} distinct prompts (none new in the "
                    f"last {attempts - last_new} of {attempts} draws), {n} asked; ask for at most {len(out)} "
                    "(or a level with more distinct prompts)"
                )
            attempts += 1
            ex = self._make(rng)
            if ex.prompt in seen or split_of(ex.prompt, self.test_fraction) != split:
                continue
            seen.add(ex.prompt)
            out.append(ex)
            last_new = attempts
        return out

    def score(self, example: Example, response: str) -> Score:
        return safe_score(self._score, example, response)

    def _score(self, example: Example, response: str) -> Score:
        raise NotImplementedError

    def demonstration(self, example: Example) -> str:
        return example.meta["demonstration"]


def examples_up_to(task: Task, split: Split, n: int) -> list[Example]:
    """Up to ``n`` distinct examples of ``split``: all the split offers when that is fewer.

    Generated tasks stop drawing once the split is exhausted (``GeneratedTask.examples(at_most=True)``);
    a dataset's split is its records; any other task is asked for ``n`` as is.
    """
    if isinstance(task, GeneratedTask):
        return task.examples(split, n, at_most=True)
    return task.examples(split, n)
