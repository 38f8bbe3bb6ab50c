"""Tasks: deterministic disjoint splits, demonstrations that score as correct, verifiers on wrong and
malformed answers, and the registry."""

import pytest

from quads.tasks import TASKS, Example, Task, get_task
from quads.tasks.arithmetic import LEVELS, ArithmeticTask, parse_answer, solve
from quads.tasks.countdown import CountdownTask, evaluate


@pytest.mark.parametrize("name,kwargs,n", [("arithmetic", {"difficulty": 4}, 200),
                                           ("countdown", {"difficulty": 2}, 100), ("code", {}, 20)])
def test_splits_deterministic_disjoint_and_demos_correct(name, kwargs, n):
    task = get_task(name, **kwargs)
    assert isinstance(task, Task)
    train, test = task.examples("train", n), task.examples("test", n // 4)
    assert len(train) == n and len(test) == n // 4
    assert [e.prompt for e in train] == [e.prompt for e in get_task(name, **kwargs).examples("train", n)]
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in test})
    assert len({e.prompt for e in train}) == n  # distinct
    other_seed = get_task(name, **kwargs, seed=1).examples("train", n)
    assert [e.prompt for e in other_seed] != [e.prompt for e in train]
    assert {e.prompt for e in other_seed}.isdisjoint({e.prompt for e in test})  # split is by hash, not seed
    for e in (train[:50] if name != "code" else train[:5]) + test[:5]:
        s = task.score(e, task.demonstration(e))
        assert s.correct and s.reward == 1.0, (e, s)


@pytest.mark.parametrize("difficulty", sorted(LEVELS))
def test_arithmetic_answer_matches_python_eval(difficulty):
    task = ArithmeticTask(difficulty)
    for e in task.examples("train", 100):
        assert int(e.answer) == eval(e.meta["expression"])  # the generator's own expression
        assert e.prompt == f"Q: {e.meta['expression']}=\n"
        steps = task.demonstration(e).split()
        assert steps[-1] == f"#{e.answer}"
        if not LEVELS[difficulty].negative:
            assert all(int(s.rsplit("=", 1)[1]) >= 0 for s in steps[:-1])


def test_arithmetic_order_of_operations():
    value, steps = solve([3, "+", 4, "*", 5, "-", 2])
    assert (value, steps) == (21, ["4*5=20", "3+20=23", "23-2=21"])
    value, steps = solve([7, "*", "(", 8, "+", 6, ")", "-", 1])
    assert (value, steps) == (97, ["8+6=14", "7*14=98", "98-1=97"])


@pytest.mark.parametrize("response,correct,reason", [
    ("4*5=20 3+20=23 #23", True, "correct"),
    ("#23\nmore text", True, "correct"),
    ("4*5=20 3+20=24 #24", False, "wrong answer: got 24, expected 23"),
    ("4*5=20 3+20=23", False, "no final answer marker"),
    ("4*5=20 #x23", False, "malformed final answer"),
    ("#", False, "malformed final answer"),
    ("", False, "no final answer marker"),
])
def test_arithmetic_verifier(response, correct, reason):
    ex = Example("Q: 3+4*5=\n", "23", "arithmetic", {"demonstration": "4*5=20 3+20=23 #23"})
    s = ArithmeticTask().score(ex, response)
    assert s.correct is correct and s.reward == float(correct)
    assert s.reason.startswith(reason), s.reason


def test_parse_answer_negative():
    assert parse_answer("1-5=-4 #-4") == (-4, "")


def test_verifier_never_raises_on_broken_example():
    bad = Example("Q: 1+1=\n", "not a number", "arithmetic", {})
    s = ArithmeticTask().score(bad, "#2")
    assert s.reward == 0.0 and not s.correct and s.reason.startswith("verifier error")


@pytest.mark.parametrize("response,correct,reason", [
    ("#3*5+7", True, "correct"),
    ("#(7+5)*3-14", False, "numbers not given"),  # 14 not given
    ("#7*3+5", False, "wrong value"),
    ("#5*5+7", False, "numbers not given"),  # 5 used twice
    ("#__import__('os').system('true')", False, "malformed answer"),
    ("#3**5", False, "malformed answer"),
    ("#3+", False, "malformed answer"),
    ("3*5+7", False, "no final answer marker"),
])
def test_countdown_verifier(response, correct, reason):
    ex = Example("Q: make 22 from 7 3 5\n", "22", "countdown", {"numbers": [7, 3, 5]})
    s = CountdownTask().score(ex, response)
    assert s.correct is correct, s
    assert s.reason.startswith(reason), s.reason


def test_countdown_evaluate_rejects_non_arithmetic():
    assert evaluate("(1+2)*3") == (9, [1, 2, 3])
    for expr in ["x+1", "1/2", "-1", "f(1)", "1 if 1 else 2", "1" * 300]:
        with pytest.raises(ValueError):
            evaluate(expr)


def test_code_verifier_right_wrong_malformed():
    task = get_task("code")
    ex = next(e for e in task.examples("train", 200) if e.answer.startswith("x+"))
    assert task.score(ex, task.demonstration(ex)).correct
    wrong = task.score(ex, "def f(x): return x")
    assert not wrong.correct and "tests passed" in wrong.reason
    syntax = task.score(ex, "def f(x) return x+1")
    assert not syntax.correct and "SyntaxError" in syntax.reason
    exits = task.score(ex, "import sys\nsys.exit(0)\n" + task.demonstration(ex))
    assert not exits.correct and "exited" in exits.reason
    nofunc = task.score(ex, "g = 1")
    assert not nofunc.correct and "no function named 'f'" in nofunc.reason


def test_registry_errors_list_valid_names():
    assert set(TASKS) >= {"arithmetic", "countdown", "code", "dataset"}
    with pytest.raises(ValueError, match="valid tasks are"):
        get_task("nope")
    with pytest.raises(ValueError, match="difficulty must be one of"):
        get_task("arithmetic", difficulty=99)
    with pytest.raises(ValueError, match="split must be one of"):
        get_task("arithmetic").examples("valid", 3)
    with pytest.raises(ValueError, match="distinct"):
        ArithmeticTask(1).examples("test", 500)  # level 1 has ~150 distinct prompts


@pytest.mark.parametrize("name,kwargs,train,test", [("arithmetic", {"difficulty": 1}, 140, 15),
                                                     ("code", {}, 223, 62)])
def test_examples_up_to_returns_the_whole_small_split(name, kwargs, train, test):
    """A split smaller than asked: ``examples_up_to`` gives all of it (disjoint from the other split,
    deterministic); ``examples`` names how many it offers."""
    from quads.tasks import examples_up_to

    task = get_task(name, **kwargs)
    tr, te = examples_up_to(task, "train", 20000), examples_up_to(task, "test", 200)
    assert (len(tr), len(te)) == (train, test)
    assert len({e.prompt for e in tr}) == train and {e.prompt for e in tr}.isdisjoint({e.prompt for e in te})
    assert [e.prompt for e in examples_up_to(get_task(name, **kwargs), "train", 20000)] == [e.prompt for e in tr]
    assert [e.prompt for e in examples_up_to(task, "train", 10)] == [e.prompt for e in tr[:10]]
    with pytest.raises(ValueError, match=f"offers only {train} distinct prompts"):
        task.examples("train", train + 1)


@pytest.mark.parametrize("level,operands,chars,mean", [(8, (32, 40), (200, 400), (260, 310)),
                                                      (9, (8, 10), (40, 95), (55, 70)),
                                                      (10, (270, 290), (1900, 3500), (2350, 2600))])
def test_chain_level_is_a_long_running_sum(level, operands, chars, mean):
    """Level 8 (the chain): 32-40 one-digit operands, +/- only, the scratchpad is the running sum left to
    right, and the responses are long (200-400 characters, mean about 285); level 9 (the short chain) the
    same with 8-10 operands (40-95 characters, mean about 62); level 10 (the long chain) with 270-290
    (1900-3500 characters, mean about 2470)."""
    from quads.tasks.arithmetic import CHAIN_LEVEL, LONG_CHAIN_LEVEL, SHORT_CHAIN_LEVEL

    assert (CHAIN_LEVEL, SHORT_CHAIN_LEVEL, LONG_CHAIN_LEVEL) == (8, 9, 10)
    task = ArithmeticTask(level)
    examples = task.examples("train", 300)
    lengths = []
    for e in examples:
        nums = [int(x) for x in e.meta["expression"].replace("-", "+").split("+")]
        assert operands[0] <= len(nums) <= operands[1] and all(0 <= x <= 9 for x in nums)
        steps = task.demonstration(e).split()
        assert len(steps) == len(nums)  # one step per operand after the first, then the answer
        running = nums[0]
        for step, op in zip(steps[:-1], [c for c in e.meta["expression"] if c in "+-"]):
            a, rest = (step[:1] + step[1:].split(op, 1)[0], step[1:].split(op, 1)[1])
            assert int(a) == running, (step, running)
            running = running + int(rest.split("=")[0]) if op == "+" else running - int(rest.split("=")[0])
            assert int(rest.split("=")[1]) == running
        assert steps[-1] == f"#{running}" and e.answer == str(running)
        lengths.append(len(task.demonstration(e)))
    assert chars[0] <= min(lengths) and max(lengths) <= chars[1] and mean[0] <= sum(lengths) / len(lengths) <= mean[1]
    again = ArithmeticTask(level).examples("train", 300)
    assert [(e.prompt, e.meta["demonstration"]) for e in again] == [(e.prompt, e.meta["demonstration"])
                                                                    for e in examples]


def test_long_chain_lengths_fit_a_4096_context_and_its_verifier_reads_the_answer():
    """Level 10 (the long chain): over 2000 training draws of seed 0 the demonstration's mean is about 2,500
    characters and the longest prompt + demonstration is under 4,000 (an SFT sequence, with <bos> and <eos>,
    fits configs/chain_100m_long.yaml's warm_start.max_seq_len 4096); the verifier scores the final answer."""
    from quads.tasks.arithmetic import LONG_CHAIN_LEVEL

    task = ArithmeticTask(LONG_CHAIN_LEVEL, seed=0)
    examples = task.examples("train", 2000)
    lengths = [len(task.demonstration(e)) for e in examples]
    total = max(len(e.prompt) + len(task.demonstration(e)) for e in examples)
    assert 2350 <= sum(lengths) / len(lengths) <= 2600 and max(lengths) < 3500, (sum(lengths) / len(lengths), max(lengths))
    assert 3500 < total < 4000 and max(len(e.prompt) for e in examples) <= 584
    e = examples[0]
    demo = task.demonstration(e)
    assert task.score(e, demo).correct and demo.count(" ") == len(e.meta["expression"]) // 2
    assert "no final answer marker" in task.score(e, demo[:2048]).reason  # cut at the 100m preset's context
    assert "wrong answer" in task.score(e, demo.rsplit("#", 1)[0] + f"#{int(e.answer) + 1}").reason


def test_chains_fold_left_to_right_as_the_general_solver_does():
    """``solve``'s linear-time fold of +/- chains gives the steps of the general reduction (``_reduce_once``)."""
    import random

    from quads.tasks.arithmetic import LEVELS, _reduce_once, solve

    for level in (1, 2, 8, 9, 10):
        task, rng = ArithmeticTask(level), random.Random(level)
        for _ in range(50):
            tokens, steps = task._draw(rng), []
            general = list(tokens)
            while len(general) > 1:
                general, step = _reduce_once(general)
                steps.append(step)
            assert solve(list(tokens)) == (general[0], steps) and "*" not in LEVELS[level].ops


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_draws_are_those_of_randint_and_choice(level):
    """``ArithmeticTask._operands`` takes its values from ``rng.getrandbits`` directly: the same operands and
    operators, and the same generator state after, as ``rng.randint`` / ``rng.choice`` per draw, so every
    level's examples are the ones it always had."""
    import random

    task, lv = ArithmeticTask(level), LEVELS[level]
    fast, ref = random.Random(f"draw:{level}"), random.Random(f"draw:{level}")
    for _ in range(30 if level == 10 else 300):
        n = ref.randint(*lv.operands)
        want = ([ref.randint(0, 10**lv.digits - 1) for _ in range(n)], [ref.choice(lv.ops) for _ in range(n - 1)])
        assert task._operands(fast) == want
    assert fast.getstate() == ref.getstate()


def test_chain_verifier_rewards_the_final_answer_only():
    from quads.tasks.arithmetic import CHAIN_LEVEL

    task = ArithmeticTask(CHAIN_LEVEL)
    e = task.examples("test", 1)[0]
    demo = task.demonstration(e)
    steps, ans = demo.split()[:-1], int(e.answer)
    wrong_pad = " ".join(s.rsplit("=", 1)[0] + "=999" for s in steps) + f" #{ans}"
    cases = [
        (demo, True, "correct"),
        (wrong_pad, True, "correct"),  # a wrong scratchpad with the right answer: full reward
        (f"#{ans}", True, "correct"),  # no scratchpad at all
        (demo + " and some extra text #0", True, "correct"),  # the first marker counts, trailing text ignored
        (demo[: demo.index("#")], False, "no final answer marker"),  # truncated before the answer
        (demo[: demo.index("#") + 1], False, "malformed final answer"),  # truncated right after the marker
        (" ".join(steps) + f" #{ans + 1}", False, "wrong answer"),  # right scratchpad, wrong answer
        (" ".join(steps) + f" #{ans}0", False, "wrong answer"),  # an extra digit
        ("", False, "no final answer marker"),
    ]
    for response, correct, reason in cases:
        s = task.score(e, response)
        assert s.correct == correct and s.reward == float(correct) and reason in s.reason, (response[-30:], s)
    if abs(ans) >= 10:  # an answer cut mid-number is a different (wrong) number
        s = task.score(e, demo[:-1])
        assert not s.correct and "wrong answer" in s.reason
