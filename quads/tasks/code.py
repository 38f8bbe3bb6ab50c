"""Tiny Python functions from one-line specs, checked by running them in the sandbox.

Prompt ``"Q: def f(x): add 3\\n"``; target response ``"def f(x): return x+3"``. Specs come from
templates (``SPECS``) with a parameter ``k``; the examples' test inputs are fixed per template
(ints, lists or strings) and the expected outputs come from a reference lambda. The verifier runs
the response in ``sandbox.run_python`` with those inputs and compares ``repr`` of each result
(so ``True`` is not ``1``); reward 1 only when every test passes, 0 otherwise, with the reason
(``"2/5 tests passed"``, a syntax error, an early exit, a timeout ...).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from quads.tasks.base import Example, GeneratedTask, Score
from quads.tasks.sandbox import SandboxLimits, run_python

_INTS = [(-3,), (0,), (1,), (7,), (12,)]
_LISTS = [([1, 2, 3],), ([5],), ([4, -1, 9, 0],), ([2, 2, 7, 1, 8],)]
_STRS = [("abc",), ("hello",), ("",), ("aab",)]


@dataclass(frozen=True)
class Spec:
    text: str  # the spec in the prompt, with {k}
    body: str  # the reference expression over x, with {k}
    ref: Callable[[object, int], object]  # reference implementation (x, k) -> value
    inputs: list[tuple]  # test argument tuples
    ks: range  # values of k


SPECS: list[Spec] = [
    Spec("add {k}", "x+{k}", lambda x, k: x + k, _INTS, range(1, 50)),
    Spec("subtract {k}", "x-{k}", lambda x, k: x - k, _INTS, range(1, 50)),
    Spec("multiply by {k}", "x*{k}", lambda x, k: x * k, _INTS, range(2, 20)),
    Spec("square plus {k}", "x*x+{k}", lambda x, k: x * x + k, _INTS, range(0, 20)),
    Spec("remainder mod {k}", "x%{k}", lambda x, k: x % k, _INTS, range(2, 20)),
    Spec("divisible by {k}", "x%{k}==0", lambda x, k: x % k == 0, _INTS, range(2, 20)),
    Spec("sum plus {k}", "sum(x)+{k}", lambda x, k: sum(x) + k, _LISTS, range(0, 30)),
    Spec("max times {k}", "max(x)*{k}", lambda x, k: max(x) * k, _LISTS, range(1, 10)),
    Spec("min plus {k}", "min(x)+{k}", lambda x, k: min(x) + k, _LISTS, range(0, 30)),
    Spec("first {k} items", "x[:{k}]", lambda x, k: x[:k], _LISTS + _STRS, range(1, 5)),
    Spec("count of {k}", "x.count({k})", lambda x, k: x.count(k), _LISTS, range(0, 10)),
    Spec("length plus {k}", "len(x)+{k}", lambda x, k: len(x) + k, _LISTS + _STRS, range(0, 20)),
    Spec("repeat {k} times", "x*{k}", lambda x, k: x * k, _STRS, range(1, 5)),
    Spec("reverse then repeat {k} times", "x[::-1]*{k}", lambda x, k: x[::-1] * k, _STRS, range(1, 4)),
    Spec("sorted, drop first {k}", "sorted(x)[{k}:]", lambda x, k: sorted(x)[k:], _LISTS, range(0, 3)),
]


class CodeTask(GeneratedTask):
    """Write ``def f(x): return ...`` for a one-line spec; scored by running tests in the sandbox."""

    name = "code"
    default_n = {"train": 200, "test": 40}

    def __init__(self, seed: int = 0, test_fraction: float = 0.2, limits: SandboxLimits | None = None):
        super().__init__(seed=seed, test_fraction=test_fraction)
        self.limits = limits or SandboxLimits(cpu_time_s=2, wall_time_s=5.0, memory_mb=256)

    def _make(self, rng: random.Random) -> Example:
        i = rng.randrange(len(SPECS))
        spec = SPECS[i]
        k = rng.choice(spec.ks)
        expected = [repr(spec.ref(*args, k)) for args in spec.inputs]
        return Example(
            prompt=f"Q: def f(x): {spec.text.format(k=k)}\n",
            answer=spec.body.format(k=k),
            data_source=self.name,
            meta={
                "demonstration": f"def f(x): return {spec.body.format(k=k)}",
                "inputs": [list(a) for a in spec.inputs],
                "expected": expected,
            },
        )

    def _score(self, example: Example, response: str) -> Score:
        inputs = [tuple(a) for a in example.meta["inputs"]]
        res = run_python(response, tests=inputs, func="f", limits=self.limits)
        if res.test_results is None:
            return Score(0.0, False, res.test_error or res.reason)
        passed = sum(r == ("ok", e) for r, e in zip(res.test_results, example.meta["expected"]))
        total = len(inputs)
        if passed == total and res.ok:
            return Score(1.0, True, "correct")
        return Score(0.0, False, f"{passed}/{total} tests passed" + ("" if res.ok else f" ({res.reason})"))
