"""Tasks, datasets and verifiers: prompts with known answers and rewards for model responses.

``get_task(name, **kwargs)`` builds a registered task (``TASKS``); ``get_task("dataset", path=...)``
wraps a jsonl / parquet file. See ``docs/TASKS.md`` for formats, verifiers and the sandbox's limits.
"""

from __future__ import annotations

from typing import Any

from quads.tasks.arithmetic import ArithmeticTask
from quads.tasks.base import Example, Score, Task, examples_up_to, split_of
from quads.tasks.code import CodeTask
from quads.tasks.countdown import CountdownTask
from quads.tasks.datasets import DatasetTask, load_dataset

TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "code": CodeTask,
    "dataset": DatasetTask,
}


def require_sandbox(data_sources: set[str], level: str, field: str = "sandbox") -> None:
    """Fail closed: when a verifier among ``data_sources`` runs model-written code (``code``), the
    sandbox must run at ``level`` on this machine (``sandbox.require_isolation``); a ``ValueError``
    names the config ``field``, what is missing and how to install it. Tasks that run no code need nothing."""
    if "code" in data_sources:
        from quads.tasks.sandbox import SandboxUnavailable, require_isolation

        try:
            require_isolation(level)
        except SandboxUnavailable as e:
            raise ValueError(f"{field}: {e}") from None


def get_task(name: str, **kwargs: Any) -> Task:
    """A task by name; ``kwargs`` go to its constructor (``difficulty``, ``seed``, ``path`` ...)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks are {sorted(TASKS)}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"task {name!r}: bad arguments {sorted(kwargs)}: {e}") from None


__all__ = ["Example", "Score", "Task", "TASKS", "examples_up_to", "get_task", "load_dataset", "require_sandbox",
           "split_of",
           "ArithmeticTask", "CountdownTask", "CodeTask", "DatasetTask"]
