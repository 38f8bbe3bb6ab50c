"""Held-out evaluation of a policy: pass@1 and pass@k over a task's examples (library: ``quads eval``,
the warm start's final measurement and the trainer's periodic held-out eval call it).

For each example ``n_samples`` responses are drawn with the rollout engine (greedy when ``temperature``
is 0), the ``c`` correct ones counted, and the unbiased estimator of Chen et al. (2021) applied:
``pass@k = 1 - C(n - c, k) / C(n, k)``, averaged over examples (k <= n required). pass@1 reduces to
``c / n``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from quads.tasks import Example, Task


@dataclass
class EvalResult:
    pass_at: dict[int, float]  # k -> mean pass@k over prompts
    n_prompts: int
    n_samples: int
    mean_response_chars: float
    reasons: dict[str, int]  # failure reason (first words) -> count
    samples: list[dict] = field(default_factory=list)  # a few (prompt, response, reason) for inspection
    correct: list[int] = field(default_factory=list)  # per example: correct responses out of n_samples
    response_tokens: int = 0  # response tokens over all samples (stop token included)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, tokenizer, task: Task, examples: list[Example], *,
                   n_samples: int = 1, ks: tuple[int, ...] = (1,), temperature: float = 0.0,
                   max_new_tokens: int = 64, batch_size: int = 64, seed: int = 0,
                   recipe: str | None = None) -> EvalResult:
    """Generate ``n_samples`` responses per example with the rollout engine and score them."""
    from quads.rollout import RolloutEngine

    return evaluate_backend(RolloutEngine(model, tokenizer, recipe=recipe), task, examples, n_samples=n_samples,
                            ks=ks, temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                            seed=seed)


@torch.no_grad()
def evaluate_backend(backend, task: Task, examples: list[Example], *, n_samples: int = 1,
                     ks: tuple[int, ...] = (1,), temperature: float = 0.0, max_new_tokens: int = 64,
                     batch_size: int | None = 64, seed: int | None = 0) -> EvalResult:
    """``evaluate_model`` on a rollout backend (``quads.rollout.backend.RolloutBackend``: the quads engine
    or vLLM). ``batch_size`` None: all examples in one generation (the trainer's held-out eval, whose
    W4A4 activation scales then see the same batch every time); ``seed`` None: a fresh seed."""
    from quads.rollout import SamplingParams

    params = SamplingParams(n=n_samples, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                            record_routing=False)
    correct: list[int] = []
    reasons: Counter[str] = Counter()
    samples, chars, tokens = [], 0, 0
    step = batch_size or max(len(examples), 1)
    for i in range(0, len(examples), step):
        chunk = examples[i:i + step]
        batch = backend.generate([e.prompt for e in chunk], params)
        tokens += int(batch.response_lengths().sum())
        for j, ex in enumerate(chunk):
            c = 0
            for text in batch.texts[j * n_samples:(j + 1) * n_samples]:
                s = task.score(ex, text)
                c += s.correct
                chars += len(text)
                if not s.correct:
                    reasons[s.reason.split(":")[0]] += 1
                if len(samples) < 8:
                    samples.append({"prompt": ex.prompt, "response": text, "reason": s.reason})
            correct.append(c)
    n = len(examples)
    pass_at = {k: sum(pass_at_k(n_samples, c, k) for c in correct) / max(n, 1) for k in ks}
    return EvalResult(pass_at, n, n_samples, chars / max(n * n_samples, 1), dict(reasons.most_common(8)),
                      samples, correct, tokens)
