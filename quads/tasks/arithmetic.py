"""Integer arithmetic with a step-by-step scratchpad, sized for a tiny character-level model.

Prompt ``"Q: 3+4*5-2=\\n"``; target response ``"4*5=20 3+20=23 23-2=21 #21"``: one operation per step,
in the usual order (innermost parentheses first, then ``*`` left to right, then ``+``/``-`` left to
right), each step ``a<op>b=c`` on the values computed so far, then ``#`` and the final answer.
Responses are tens of characters long, so a per-token error rate compounds over the sequence.
Level 8 (``CHAIN_LEVEL``) is the long-response "chain": 32-40 one-digit operands joined by ``+``/``-``,
so the scratchpad is the running sum (``3+6=9 9-5=4 4-3=1 ...``), 200-390 characters (mean 284).
Level 9 (``SHORT_CHAIN_LEVEL``) is the same chain with 8-10 operands, responses about a quarter as long:
with level 8 and the 20-40-character levels it measures how a quantity (the mismatch budget) moves with
response length on one kind of task.
Level 10 (``LONG_CHAIN_LEVEL``) is the "long chain": the same chain with 270-290 operands, responses of
2,000-3,400 characters (mean ~2,470; the running sum wanders to three digits, so steps lengthen), prompt +
response under 4,000 characters (prompts up to 584): past the 2,048 positions of the 100m preset, so its
warm start lengthens the context (``PretrainConfig.max_seq_len``, configs/chain_100m_long.yaml).

The verifier reads the integer right after the first ``#``; no marker or no integer after it is
reward 0 with the reason. Only the final answer is checked, not the scratchpad.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from quads.tasks.base import Example, GeneratedTask, Score

ANSWER_MARKER = "#"
_ANSWER_RE = re.compile(r"\s*(-?\d+)")


@dataclass(frozen=True)
class Level:
    """One difficulty level of the generator."""

    operands: tuple[int, int]  # min and max number of operands
    digits: int  # operands are drawn from [0, 10**digits - 1]
    ops: str  # operator alphabet
    parens: bool  # wrap one random run of operands in parentheses (half of the examples)
    negative: bool  # allow negative intermediate values (otherwise such expressions are redrawn)


LEVELS: dict[int, Level] = {
    1: Level((2, 2), 1, "+-", False, False),
    2: Level((3, 3), 1, "+-", False, False),
    3: Level((3, 3), 1, "+-*", False, False),
    4: Level((3, 4), 1, "+-*", True, False),
    5: Level((4, 4), 1, "+-*", True, False),
    6: Level((5, 5), 1, "+-*", True, False),
    7: Level((4, 5), 2, "+-*", True, True),
    8: Level((32, 40), 1, "+-", False, True),  # the chain: a running-sum scratchpad of 31-39 steps
    9: Level((8, 10), 1, "+-", False, True),  # the short chain: the same scratchpad, 7-9 steps
    10: Level((270, 290), 1, "+-", False, True),  # the long chain: the same scratchpad, 269-289 steps
}
DEFAULT_DIFFICULTY = 6
CHAIN_LEVEL = 8
SHORT_CHAIN_LEVEL = 9
LONG_CHAIN_LEVEL = 10


def _below(rng: random.Random, bound: int, count: int) -> list[int]:
    """``count`` draws of ``rng.randrange(bound)``: ``random.Random._randbelow``'s rejection sampling over
    ``rng.getrandbits(bound.bit_length())``, the same values and the same generator state after."""
    bits, draw, out = bound.bit_length(), rng.getrandbits, []
    for _ in range(count):
        r = draw(bits)
        while r >= bound:
            r = draw(bits)
        out.append(r)
    return out


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _reduce_once(tokens: list) -> tuple[list, str | None]:
    """Do the next operation of ``tokens`` (ints, operator and parenthesis strings).

    Returns the new token list and the step text ``"a<op>b=c"`` (None when only parentheses were
    dropped). Order: the innermost parenthesized group, inside it ``*`` first, then ``+``/``-``.
    """
    close = tokens.index(")") if ")" in tokens else len(tokens)
    open_ = max((i for i in range(close) if tokens[i] == "("), default=-1) if "(" in tokens else -1
    lo, hi = open_ + 1, close  # the group is tokens[lo:hi]
    group = tokens[lo:hi]
    if len(group) == 1:  # "(7)" -> "7"
        return tokens[:open_] + group + tokens[close + 1:], None
    idx = next((i for i in range(1, len(group), 2) if group[i] == "*"), 1) if "*" in group else 1
    a, op, b = group[idx - 1], group[idx], group[idx + 1]
    c = _apply(a, op, b)
    j = lo + idx - 1
    return tokens[:j] + [c] + tokens[j + 3:], f"{a}{op}{b}={c}"


def _fold(tokens: list) -> tuple[int, list[str]]:
    """The value and steps of ``a op b op c ...`` (``+``/``-`` only), one step per operator from the left."""
    value, steps = tokens[0], []
    for op, b in zip(tokens[1::2], tokens[2::2]):
        c = value + b if op == "+" else value - b
        steps.append(f"{value}{op}{b}={c}")
        value = c
    return value, steps


def solve(tokens: list) -> tuple[int, list[str]]:
    """The value of a token list and its scratchpad steps."""
    if "(" not in tokens and "*" not in tokens:  # a +/- chain: _reduce_once's steps, left to right, in linear time
        return _fold(tokens)
    steps: list[str] = []
    while len(tokens) > 1:
        tokens, step = _reduce_once(tokens)
        if step is not None:
            steps.append(step)
    return tokens[0], steps


def parse_answer(response: str) -> tuple[int | None, str]:
    """The integer after the first ``#`` in ``response``, or None and why not."""
    at = response.find(ANSWER_MARKER)
    if at < 0:
        return None, f"no final answer marker {ANSWER_MARKER!r}"
    m = _ANSWER_RE.match(response, at + 1)
    if m is None:
        tail = response[at + 1:at + 11]
        return None, f"malformed final answer: expected an integer after {ANSWER_MARKER!r}, got {tail!r}"
    return int(m.group(1)), ""


class ArithmeticTask(GeneratedTask):
    """Integer expressions over ``+ - *`` with a scratchpad; difficulty levels in ``LEVELS``."""

    name = "arithmetic"

    def __init__(self, difficulty: int = DEFAULT_DIFFICULTY, seed: int = 0, test_fraction: float = 0.1):
        if difficulty not in LEVELS:
            raise ValueError(f"arithmetic difficulty must be one of {sorted(LEVELS)}, got {difficulty!r}")
        super().__init__(seed=seed, test_fraction=test_fraction)
        self.difficulty = difficulty
        self.level = LEVELS[difficulty]

    def _operands(self, rng: random.Random) -> tuple[list[int], list[str]]:
        """The operands and operators of one expression. Draws what ``n = rng.randint(*operands)``, then
        ``rng.randint(0, 10**digits - 1)`` per operand and ``rng.choice(ops)`` per operator draw, from
        ``rng.getrandbits`` as ``random.Random`` does (``_below``), without their per-call overhead: the
        long chain draws ~560 values per example."""
        lv = self.level
        n = rng.randint(*lv.operands)
        nums = _below(rng, 10**lv.digits, n)
        return nums, [lv.ops[i] for i in _below(rng, len(lv.ops), n - 1)]

    def _draw(self, rng: random.Random) -> list:
        """The expression's tokens: ``_operands`` interleaved, half the time (levels with ``parens``) one
        random run of operands parenthesized."""
        nums, ops = self._operands(rng)
        n = len(nums)
        tokens: list = [nums[0]]
        for op, x in zip(ops, nums[1:]):
            tokens += [op, x]
        if self.level.parens and n >= 3 and rng.random() < 0.5:
            length = rng.randint(2, n - 1)
            start = rng.randint(0, n - length)
            a, b = 2 * start, 2 * (start + length - 1) + 1
            tokens = tokens[:a] + ["("] + tokens[a:b] + [")"] + tokens[b:]
        return tokens

    def _make(self, rng: random.Random) -> Example:
        while True:
            tokens = self._draw(rng)
            value, steps = solve(list(tokens))
            if self.level.negative or all(int(s.rsplit("=", 1)[1]) >= 0 for s in steps):
                break
        expr = "".join(map(str, tokens))
        demo = " ".join(steps + [f"{ANSWER_MARKER}{value}"])
        return Example(
            prompt=f"Q: {expr}=\n",
            answer=str(value),
            data_source=self.name,
            meta={"demonstration": demo, "expression": expr, "difficulty": self.difficulty},
        )

    def _score(self, example: Example, response: str) -> Score:
        got, why = parse_answer(response)
        if got is None:
            return Score(0.0, False, why)
        if got != int(example.answer):
            return Score(0.0, False, f"wrong answer: got {got}, expected {example.answer}")
        return Score(1.0, True, "correct")
