"""Gradient accumulation (``optim.micro_batch_size``, ``quads.rl.microbatch``): micro-batches that divide a
mini-batch and ones that do not take the same optimizer steps and log the same metrics as whole
mini-batches, up to the floating-point summation order; the split; the refusals; the config field.

Tolerances (fp32 on the CPU): every optimizer step's gradient within 1e-5 of its largest entry, the
parameters after two RL steps (four AdamW steps) within 1e-5 of the largest update, each metric within
1e-5 relative or 1e-5 absolute (the mismatch metrics of an fp32 run measure rounding, ~1e-6, and move by as
much as the log-probs' summation order does). Measured: gradients and parameters 1e-6 and below. The runs use AdamW ``eps`` 0.1, about
the gradients' size, so that an update is close to linear in its gradient: with the default 1e-8 the first
AdamW step is ``lr * sign(g)``, and a gradient entry within rounding of 0 may flip its sign (a 2 lr jump
that says nothing about the accumulation).
"""

import pytest
import torch
from conftest import save_tiny_checkpoint
from test_trainer import DigitsTask, tiny_config

from quads import tasks
from quads.config import from_dict
from quads.metrics.report import NONDETERMINISTIC
from quads.model.config import ModelConfig
from quads.quant import get_recipe
from quads.rl import microbatch
from quads.rl.config import OptimSection, TrainConfig
from quads.rl.grpo import GRPOLossConfig
from quads.rl.trainer import GRPOTrainer

TOL = 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("mb") / "ckpt")


@pytest.fixture(autouse=True)
def digits_task(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "digits", DigitsTask)


def _run(tmp_path, ckpt, micro, agg, monkeypatch):
    """Two RL steps of 16 sequences in 2 mini-batches of 8: (start and end parameters, the gradient at every
    optimizer step, the metrics of each step, the rows of every trainer forward)."""
    from quads.rl import trainer as trainer_mod

    rows = []
    for mod in (trainer_mod, microbatch):
        real = mod.forward_logprobs
        monkeypatch.setattr(mod, "forward_logprobs",
                            lambda m, b, *a, _real=real, **k: rows.append(b.input_ids.shape[0]) or _real(m, b, *a, **k))
    cfg = tiny_config(tmp_path / f"{agg}-{micro}", ckpt, steps=2, eval_every=0, grpo=GRPOLossConfig(agg=agg),
                      optim=OptimSection(lr=0.1, eps=0.1, mini_batches=2, micro_batch_size=micro))
    t = GRPOTrainer(cfg, quiet=True)
    t.setup()
    grads, real_step = [], t.opt.step

    def step(*a, **k):
        grads.append(torch.cat([p.grad.flatten() for p in t.params]))
        return real_step(*a, **k)

    t.opt.step = step
    flat = lambda: torch.cat([p.detach().flatten() for p in t.params])  # noqa: E731
    start = flat()
    metrics = [t.step(s) for s in (1, 2)]
    return start, flat(), grads, metrics, rows


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_micro_batches_take_the_same_optimizer_steps(tmp_path, ckpt, monkeypatch, agg):
    """Micro-batches of 4 (dividing the mini-batches of 8) and of 3 (2, 3, 3 rows) against whole mini-batches."""
    start, end, grads, metrics, rows = _run(tmp_path, ckpt, None, agg, monkeypatch)
    assert rows == [16, 8, 8, 16, 8, 8]  # per step: the old log-probs of the whole batch, then two mini-batches
    update = (end - start).abs().max().item()
    for micro, chunks in ((4, [4, 4, 4, 4]), (3, [2, 3, 3, 2, 3, 3])):
        _, end_m, grads_m, metrics_m, rows_m = _run(tmp_path, ckpt, micro, agg, monkeypatch)
        assert rows_m == chunks * 4, rows_m  # every trainer forward takes one micro-batch, the old log-probs too
        assert len(grads_m) == len(grads) == 4
        for i, (g, want) in enumerate(zip(grads_m, grads)):
            err = (g - want).abs().max().item() / want.abs().max().item()
            assert err <= TOL, f"{agg}, micro {micro}: optimizer step {i + 1}: gradient off by {err:.3g} of its max"
        err = (end_m - end).abs().max().item() / update
        assert err <= TOL, f"{agg}, micro {micro}: parameters off by {err:.3g} of the largest update {update:.3g}"
        for step, (got, want) in enumerate(zip(metrics_m, metrics), 1):
            keys = {k for k in want if not k.startswith(NONDETERMINISTIC)}
            assert keys == {k for k in got if not k.startswith(NONDETERMINISTIC)}
            off = {k: (got[k], want[k]) for k in keys if got[k] != pytest.approx(want[k], rel=TOL, abs=TOL)}
            assert not off, f"{agg}, micro {micro}, step {step}: {off}"
        assert metrics_m[1]["loss/tokens"] == metrics[1]["loss/tokens"] > 0


def test_split_rows():
    sizes = lambda cuts: [c.stop - c.start for c in cuts]  # noqa: E731
    assert sizes(microbatch.split_rows(0, 64, 24)) == [21, 21, 22]
    assert sizes(microbatch.split_rows(64, 128, 16)) == [16] * 4
    assert microbatch.split_rows(8, 16, None) == microbatch.split_rows(8, 16, 100) == [slice(8, 16)]
    assert microbatch.split_rows(0, 3, 1) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert microbatch.step_chunks(16, 2, 3) == [[slice(0, 2), slice(2, 5), slice(5, 8)],
                                                [slice(8, 10), slice(10, 13), slice(13, 16)]]


def test_config_field():
    assert OptimSection().micro_batch_size is None
    for value, want in (("16", 16), (32, 32), ("none", None), (None, None)):
        assert from_dict(TrainConfig, {"optim": {"micro_batch_size": value}}).optim.micro_batch_size == want
    for bad in (0, -4, True):
        with pytest.raises(ValueError, match=r"optim.micro_batch_size must be a whole number of sequences >= 1"):
            OptimSection(micro_batch_size=bad)
    with pytest.raises(ValueError, match="micro_batch_size"):
        from_dict(TrainConfig, {"optim": {"micro_batch_size": 2.5}})


def test_splits_that_would_change_the_numbers_are_refused():
    """A trainer that quantizes activations with batch-wide scales, and a router load-balance loss, make a
    row's result depend on the rest of its forward: refused when the forward is split, with the fix."""
    cfg = TrainConfig(optim=OptimSection(mini_batches=2, micro_batch_size=16))  # 64 x 8 rows: mini-batches of 256
    plain = ModelConfig.preset("tiny")
    microbatch.check(cfg, get_recipe("quads"), plain)  # W4A16 QAT: the weights only
    with pytest.raises(ValueError, match=r"recipe 'w4a4-qat'.*amax over the batch.*act_scale=token"):
        microbatch.check(cfg, get_recipe("w4a4-qat"), plain)
    microbatch.check(cfg, get_recipe("w4a4-qat", act_scale="token"), plain)
    with pytest.raises(ValueError, match="RAC"):
        microbatch.check(cfg, get_recipe("w4a4-qat", act_scale="token", trainer_rac_ratio=0.5), plain)
    aux = ModelConfig.preset("tiny", router_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="load-balance loss"):
        microbatch.check(cfg, get_recipe("bf16"), aux)
    whole = TrainConfig(optim=OptimSection(mini_batches=2, micro_batch_size=256))
    microbatch.check(whole, get_recipe("bf16"), aux)  # each mini-batch is one forward: its aux loss is exact
    microbatch.check(TrainConfig(), get_recipe("w4a4-qat"), aux)  # unset: nothing to check
