"""Prompts from jsonl / parquet files with verl-style fields, scored by a verifier per data_source.

Fields of each record (row of a parquet file, line of a jsonl file):
- ``prompt`` (required): a string, or a chat list of ``{"role", "content"}`` messages; a chat is
  flattened to its contents joined by newlines (the list is kept in ``meta["messages"]``);
- the reference answer (required), the first found of ``reward_model.ground_truth`` (verl),
  ``ground_truth``, ``answer``; numbers are turned into text;
- ``data_source`` (optional, default ``"math"``): picks the verifier (``VERIFIERS``); unknown names
  use the math answer check;
- ``extra_info`` (optional): copied into ``meta``.

The math answer check takes the response's final answer from, in this order, the last
``\\boxed{...}``, the text after the first ``#`` / ``####`` marker, or ``"answer is ..."``, and compares
it with the ground truth as numbers when both parse (``1,000`` = ``1000``, ``0.5`` = ``1/2``),
else as normalized text (case, spaces, ``$`` and a trailing period ignored).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from quads.tasks.base import Example, Score, Split, check_split, safe_score, split_of

ANSWER_KEYS = ("reward_model.ground_truth", "ground_truth", "answer")


def _get(record: dict, dotted: str) -> Any:
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _prompt_text(prompt: Any, where: str) -> tuple[str, list | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
        bad = [i for i, m in enumerate(prompt) if not isinstance(m.get("content"), str) or "role" not in m]
        if bad:
            raise ValueError(f"{where}: prompt message {bad[0]} needs string 'role' and 'content' fields, "
                             f"got {prompt[bad[0]]!r}")
        return "\n".join(m["content"] for m in prompt), list(prompt)
    raise ValueError(f"{where}: field 'prompt' must be a string or a non-empty list of "
                     f"{{role, content}} messages, got {type(prompt).__name__}")


def record_to_example(record: Any, where: str) -> Example:
    """One verl-style record to an ``Example``; ``where`` ("file.jsonl line 3") goes into errors."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with a 'prompt' field, got {type(record).__name__}")
    if record.get("prompt") is None:
        raise ValueError(f"{where}: missing field 'prompt' (found fields {sorted(record)})")
    text, messages = _prompt_text(record["prompt"], where)
    answer = next((v for k in ANSWER_KEYS if (v := _get(record, k)) is not None), None)
    if answer is None:
        raise ValueError(f"{where}: missing the reference answer: none of the fields "
                         f"{list(ANSWER_KEYS)} is present (found fields {sorted(record)})")
    if isinstance(answer, list | tuple) and len(answer) == 1:
        answer = answer[0]
    meta: dict[str, Any] = dict(record.get("extra_info") or {})
    if messages is not None:
        meta["messages"] = messages
    return Example(text, str(answer), str(record.get("data_source") or "math"), meta)


def load_dataset(path: str | Path) -> list[Example]:
    """All records of a ``.jsonl`` / ``.json`` (list) / ``.parquet`` file as ``Example``s, in order."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [record_to_example(r, f"{path} row {i}") for i, r in enumerate(rows)]
    if suffix == ".jsonl":
        out = []
        with open(path) as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {i}: not valid JSON ({e.msg})") from None
                out.append(record_to_example(record, f"{path} line {i}"))
        return out
    if suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset must be a list of records, got {type(data).__name__}")
        return [record_to_example(r, f"{path} record {i}") for i, r in enumerate(data)]
    raise ValueError(f"{path}: unsupported dataset format {suffix!r}; use .jsonl, .json or .parquet")


_BOXED = re.compile(r"\\boxed\{")
_ANSWER_IS = re.compile(r"answer is[:\s]*([^\n]+)", re.IGNORECASE)


def _boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a free-form response (see the module docstring), or None."""
    boxed = _boxed(response)
    if boxed is not None:
        return boxed
    at = response.find("#")
    if at >= 0:
        rest = response[at:].lstrip("#").strip()
        return rest.split("\n", 1)[0].split(" ", 1)[0] if rest else ""
    m = _ANSWER_IS.search(response)
    return m.group(1) if m else None


def _normalize(s: str) -> str:
    return re.sub(r"\s+", "", s.strip().strip("$").rstrip(".").lower())


def _number(s: str) -> Fraction | None:
    s = _normalize(s).replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_score(example: Example, response: str) -> Score:
    got = extract_answer(response)
    if got is None:
        return Score(0.0, False, "no final answer (expected \\boxed{...}, '#' or 'answer is')")
    if not got.strip():
        return Score(0.0, False, "malformed final answer: empty")
    a, b = _number(got), _number(example.answer)
    same = a == b if a is not None and b is not None else _normalize(got) == _normalize(example.answer)
    if same:
        return Score(1.0, True, "correct")
    return Score(0.0, False, f"wrong answer: got {got[:40]!r}, expected {example.answer[:40]!r}")


def _task_scorer(name: str) -> Callable[[Example, str], Score]:
    def score(example: Example, response: str) -> Score:
        from quads.tasks import get_task

        return get_task(name).score(example, response)

    return score


VERIFIERS: dict[str, Callable[[Example, str], Score]] = {
    "math": math_score,
    "arithmetic": _task_scorer("arithmetic"),
    "countdown": _task_scorer("countdown"),
    "code": _task_scorer("code"),
}


class DatasetTask:
    """A task over a dataset file: hash-partitioned splits, verifier by each example's data_source."""

    def __init__(self, path: str | Path, test_fraction: float = 0.1, seed: int = 0):
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.path = Path(path)
        self.name = f"dataset:{self.path.name}"
        self.test_fraction = test_fraction
        self.seed = seed
        self._all = load_dataset(self.path)

    def examples(self, split: Split, n: int | None = None) -> list[Example]:
        check_split(split)
        salt = f"{self.seed}:"
        out = [e for e in self._all if split_of(e.prompt, self.test_fraction, salt) == split]
        return out if n is None else out[:n]

    def score(self, example: Example, response: str) -> Score:
        verifier = VERIFIERS.get(example.data_source, math_score)
        return safe_score(verifier, example, response)

    def demonstration(self, example: Example) -> str:
        if "demonstration" in example.meta:
            return str(example.meta["demonstration"])
        return f"#{example.answer}"
