"""Countdown: reach a target from given numbers with ``+ - *``, each number used at most once.

Prompt ``"Q: make 22 from 7 3 5\\n"``; target response ``"3*5=15 15+7=22 #3*5+7"``: a scratchpad of
steps, then ``#`` and one expression over the given numbers. Examples are built by folding all the
numbers left to right with random operators (targets are positive), so a solution always exists.

The verifier parses the expression after ``#`` (to the end of its line) with ``ast`` and accepts only
integer literals, ``+ - *`` and parentheses; it checks that each literal is one of the given numbers,
used no more often than given, then evaluates the tree itself (no ``eval``) and compares with the
target. Unary minus, division, names and calls are rejected with a reason.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from dataclasses import dataclass

from quads.tasks.base import Example, GeneratedTask, Score

ANSWER_MARKER = "#"
MAX_EXPRESSION_CHARS = 200


@dataclass(frozen=True)
class CountdownLevel:
    numbers: int  # how many numbers are given (all are used by the reference solution)
    max_value: int  # numbers are drawn from [1, max_value]
    ops: str  # operators of the reference solution


LEVELS: dict[int, CountdownLevel] = {
    1: CountdownLevel(3, 9, "+-"),
    2: CountdownLevel(3, 9, "+-*"),
    3: CountdownLevel(4, 9, "+-*"),
    4: CountdownLevel(4, 25, "+-*"),
}
DEFAULT_DIFFICULTY = 2

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expr: str) -> tuple[int, list[int]]:
    """Value of ``expr`` (integers, ``+ - *``, parentheses) and the literals it uses; ValueError else."""
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    used: list[int] = []

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"only integers, + - * and parentheses are allowed, got {type(node).__name__}")

    return walk(tree), used


class CountdownTask(GeneratedTask):
    """Make a target from given numbers; difficulty levels in ``LEVELS``."""

    name = "countdown"

    def __init__(self, difficulty: int = DEFAULT_DIFFICULTY, seed: int = 0, test_fraction: float = 0.1):
        if difficulty not in LEVELS:
            raise ValueError(f"countdown difficulty must be one of {sorted(LEVELS)}, got {difficulty!r}")
        super().__init__(seed=seed, test_fraction=test_fraction)
        self.difficulty = difficulty
        self.level = LEVELS[difficulty]

    def _make(self, rng: random.Random) -> Example:
        lv = self.level
        while True:
            nums = [rng.randint(1, lv.max_value) for _ in range(lv.numbers)]
            value, expr, additive, steps = nums[0], str(nums[0]), False, []
            for b in nums[1:]:
                op = rng.choice(lv.ops)
                new = value + b if op == "+" else value - b if op == "-" else value * b
                steps.append(f"{value}{op}{b}={new}")
                if op == "*" and additive:
                    expr = f"({expr})*{b}"
                else:
                    expr = f"{expr}{op}{b}"
                additive = op in "+-"
                value = new
            if value > 0:
                break
        shown = nums[:]
        rng.shuffle(shown)
        demo = " ".join(steps + [f"{ANSWER_MARKER}{expr}"])
        return Example(
            prompt=f"Q: make {value} from {' '.join(map(str, shown))}\n",
            answer=str(value),
            data_source=self.name,
            meta={"demonstration": demo, "numbers": shown, "difficulty": self.difficulty},
        )

    def _score(self, example: Example, response: str) -> Score:
        at = response.find(ANSWER_MARKER)
        if at < 0:
            return Score(0.0, False, f"no final answer marker {ANSWER_MARKER!r}")
        expr = response[at + 1:].split("\n", 1)[0].strip()
        if not expr:
            return Score(0.0, False, f"malformed answer: empty expression after {ANSWER_MARKER!r}")
        try:
            value, used = evaluate(expr)
        except ValueError as e:
            return Score(0.0, False, f"malformed answer {expr[:40]!r}: {e}")
        allowed = Counter(example.meta["numbers"])
        extra = Counter(used) - allowed
        if extra:
            return Score(0.0, False, f"numbers not given or used too often: {sorted(extra.elements())}")
        if value != int(example.answer):
            return Score(0.0, False, f"wrong value: {expr} = {value}, target {example.answer}")
        return Score(1.0, True, "correct")
