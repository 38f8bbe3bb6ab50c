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


def get_task(name: str, **kwargs: Any) -> Task:
    """A task by name; ``kwargs`` go to its constructor (``difficulty``, ``seed``, ``path`` ...)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks are {sorted(TASKS)}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"task {name!r}: bad arguments {sorted(kwargs)}: {e}") from None


__all__ = ["Example", "Score", "Task", "TASKS", "examples_up_to", "get_task", "load_dataset", "split_of",
           "ArithmeticTask", "CountdownTask", "CodeTask", "DatasetTask"]
