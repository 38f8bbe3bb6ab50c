"""The GRPO trainer end to end on a tiny model: learning, exact resume, atomic checkpoints."""

import json
import math
import random
from dataclasses import replace

import pytest
import torch
from conftest import save_tiny_checkpoint

from quads import tasks
from quads.metrics.report import NONDETERMINISTIC
from quads.model.checkpoint import load_checkpoint
from quads.rl import checkpoint as ckpt_mod
from quads.rl.config import (
    LogSection,
    ModelSection,
    OptimSection,
    RecipeSection,
    RolloutSection,
    TaskSection,
    TrainConfig,
)
from quads.rl.trainer import GRPOTrainer
from quads.tasks.base import Example, Score


class DigitsTask:
    """Reward = fraction of digits in the response: dense, and learnable in a few steps from scratch."""

    name = "digits"

    def __init__(self, seed: int = 0, **_):
        self.seed = seed

    def examples(self, split, n=None):
        rng = random.Random(f"{self.seed}:{split}")
        return [Example(f"Q{rng.randint(0, 10**6)}:", "", "digits") for _ in range(n or 64)]

    def score(self, example, response):
        frac = sum(c.isdigit() for c in response) / max(len(response), 1)
        return Score(frac, frac > 0.5, "digit fraction")

    def demonstration(self, example):
        return "123"


@pytest.fixture
def digits_task(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "digits", DigitsTask)


def tiny_checkpoint(path, n_layers=1):
    return save_tiny_checkpoint(path, n_layers=n_layers)


def tiny_config(tmp_path, ckpt, **over):
    base = TrainConfig(
        model=ModelSection(checkpoint=str(ckpt)),
        task=TaskSection(name="digits", train_size=64),
        recipe=RecipeSection(name="bf16"),
        rollout=RolloutSection(prompts_per_step=4, n_samples=4, max_new_tokens=6),
        optim=OptimSection(lr=2e-2),
        log=LogSection(tensorboard=False, probe_tokens=16, progress=False),
        steps=6, eval_every=3, eval_n=4, dtype="float32", out_dir=str(tmp_path / "run"),
    )
    return replace(base, **over)


def read_metrics(run_dir):
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)
    return out


def test_short_run_learns_and_changes_every_parameter(tmp_path, digits_task):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    res = GRPOTrainer(tiny_config(tmp_path, ckpt), quiet=True).run()
    m = read_metrics(res.run_dir)
    rewards = [m[s]["reward/mean"] for s in range(1, 7)]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.05, rewards
    before, _ = load_checkpoint(ckpt)
    after, extra = load_checkpoint(res.policy_dir)
    assert extra["step"] == 6
    a = dict(after.named_parameters())
    unchanged = [n for n, p in before.named_parameters() if torch.equal(p, a[n])]
    assert not unchanged, unchanged
    # every metric of DESIGN.md section 5 and the step bookkeeping is logged
    for key in ("mismatch/logp_gap_max", "mismatch/logp_gap_mean", "mismatch/k1", "mismatch/k3", "mismatch/chi2",
                "mismatch/ppl_ratio", "mismatch/frac_rho_outside_0.5_2", "mismatch/frac_rho_outside_0.2_5",
                "mismatch/routing_diff", "mismatch/logp_gap_max_probe", "loss/clip_frac", "loss/entropy",
                "optim/grad_norm", "response/len_mean", "time/rollout_s", "perf/rollout_tokens_per_s"):
        assert key in m[6], key
    assert "eval/pass@1" in m[0] and "eval/pass@1" in m[3] and "eval/pass@1" in m[6]
    assert (res.report_dir / "report.md").is_file() and (res.report_dir / "reward.png").is_file()
    assert (res.run_dir / "config.yaml").is_file()


class Crash(RuntimeError):
    pass


def test_resume_reproduces_uninterrupted_run(tmp_path, digits_task):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    over = dict(steps=4, eval_every=0, recipe=RecipeSection(name="quads"),
                log=LogSection(tensorboard=True, probe_tokens=16, progress=False, save_every=2))
    straight = GRPOTrainer(tiny_config(tmp_path / "a", ckpt, **over), quiet=True).run()

    def crash(step, metrics):
        if step == 2:
            raise Crash("simulated crash after the step-2 checkpoint")

    cfg_b = tiny_config(tmp_path / "b", ckpt, **over)
    with pytest.raises(Crash):
        GRPOTrainer(cfg_b, on_step_end=crash, quiet=True).run()
    # a torn line, as a crash mid-append would leave, is dropped on resume
    with open(tmp_path / "b" / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')
    resumed = GRPOTrainer(replace(cfg_b, resume=True), quiet=True).run()
    a, b = read_metrics(straight.run_dir), read_metrics(resumed.run_dir)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        ka = {k: v for k, v in a[step].items() if not k.startswith(NONDETERMINISTIC)}
        kb = {k: v for k, v in b[step].items() if not k.startswith(NONDETERMINISTIC)}
        assert ka == kb, step
    pa, _ = load_checkpoint(straight.policy_dir)
    pb, _ = load_checkpoint(resumed.policy_dir)
    for (n, x), (_, y) in zip(pa.named_parameters(), pb.named_parameters()):
        assert torch.equal(x, y), n


def test_interrupted_checkpoint_write_keeps_previous(tmp_path, monkeypatch):
    run = tmp_path / "run"
    ckpt_mod.save_train_state(run, 1, {"model": {"w": torch.ones(3)}}, {"steps": 4})
    real_save = torch.save

    def torn_save(obj, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod.torch, "save", torn_save)
    with pytest.raises(OSError):
        ckpt_mod.save_train_state(run, 2, {"model": {"w": torch.zeros(3)}}, {"steps": 4})
    monkeypatch.setattr(ckpt_mod.torch, "save", real_save)
    latest = ckpt_mod.latest_checkpoint(run)
    assert latest.name == "step_000001"
    state = ckpt_mod.load_train_state(latest)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(3))
    assert not (run / "checkpoints" / "step_000002").exists()
    # a process killed mid-write leaves a temp folder: ignored, then cleaned by the next save
    stale = run / "checkpoints" / ".step_000002.abc.tmp"
    stale.mkdir()
    (stale / "state.pt").write_bytes(b"torn")
    assert ckpt_mod.latest_checkpoint(run).name == "step_000001"
    ckpt_mod.save_train_state(run, 2, {"model": {"w": torch.zeros(3)}}, {"steps": 4})
    assert not stale.exists() and ckpt_mod.latest_checkpoint(run).name == "step_000002"


def test_time_limit_stops_early_with_eval_checkpoint_and_policy(tmp_path, digits_task):
    """time_limit_s: the run stops after the step that crosses it, evaluates, saves and can be resumed."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    cfg = tiny_config(tmp_path, ckpt, steps=50, eval_every=0, time_limit_s=1e-9)
    res = GRPOTrainer(cfg, quiet=True).run()
    m = read_metrics(res.run_dir)
    assert sorted(m) == [0, 1] and res.steps == 1
    assert "eval/pass@1" in m[1]  # the held-out eval ran at the early stop
    assert (res.policy_dir / "config.json").is_file()
    assert ckpt_mod.latest_checkpoint(res.run_dir) is not None
    resumed = GRPOTrainer(replace(cfg, resume=True, time_limit_s=0, steps=3), quiet=True).run()
    assert sorted(read_metrics(resumed.run_dir)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="time_limit_s"):
        replace(cfg, time_limit_s=-1)


def test_default_checkpoint_period_lets_a_crashed_run_resume_exactly(tmp_path, digits_task):
    """With the default log.save_every, a run that crashes between checkpoints continues exactly."""
    every = LogSection().save_every
    assert every > 0, "the default run must write checkpoints before its end"
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    over = dict(steps=every + 2, eval_every=0)
    straight = GRPOTrainer(tiny_config(tmp_path / "a", ckpt, **over), quiet=True).run()

    def crash(step, metrics):
        if step == every + 1:
            raise Crash("simulated crash one step after the first periodic checkpoint")

    cfg_b = tiny_config(tmp_path / "b", ckpt, **over)
    with pytest.raises(Crash):
        GRPOTrainer(cfg_b, on_step_end=crash, quiet=True).run()
    assert ckpt_mod.latest_checkpoint(cfg_b.out_dir).name == f"step_{every:06d}"
    resumed = GRPOTrainer(replace(cfg_b, resume=True), quiet=True).run()
    a, b = read_metrics(straight.run_dir), read_metrics(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(every + 3))
    for step in (every + 1, every + 2):
        assert ({k: v for k, v in a[step].items() if not k.startswith(NONDETERMINISTIC)}
                == {k: v for k, v in b[step].items() if not k.startswith(NONDETERMINISTIC)}), step


def test_resume_before_the_first_checkpoint_starts_again_from_step_0(tmp_path, digits_task):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    over = dict(steps=3, eval_every=0, log=LogSection(tensorboard=False, probe_tokens=16, progress=False,
                                                      save_every=0))
    straight = GRPOTrainer(tiny_config(tmp_path / "a", ckpt, **over), quiet=True).run()

    def crash(step, metrics):
        if step == 2:
            raise Crash("simulated crash before any checkpoint")

    cfg_b = tiny_config(tmp_path / "b", ckpt, **over)
    with pytest.raises(Crash):
        GRPOTrainer(cfg_b, on_step_end=crash, quiet=True).run()
    assert ckpt_mod.latest_checkpoint(cfg_b.out_dir) is None
    resumed = GRPOTrainer(replace(cfg_b, resume=True), quiet=True).run()
    lines = (resumed.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]  # the crashed run's records were replaced
    a, b = read_metrics(straight.run_dir), read_metrics(resumed.run_dir)
    for step in range(4):
        assert ({k: v for k, v in a[step].items() if not k.startswith(NONDETERMINISTIC)}
                == {k: v for k, v in b[step].items() if not k.startswith(NONDETERMINISTIC)}), step
    with pytest.raises(ValueError, match="holds no run"):
        GRPOTrainer(tiny_config(tmp_path / "c", ckpt, resume=True), quiet=True)


@pytest.fixture
def nan_loss_at(monkeypatch):
    """``nan_loss_at(step)``: the GRPO loss of that RL step's (single) mini-batch becomes NaN."""
    from quads.rl import trainer as trainer_mod

    real, calls, when = trainer_mod.grpo_loss, [0], []

    def grpo_loss(*a, **k):
        loss, m = real(*a, **k)
        calls[0] += 1
        return (loss * float("nan") if calls[0] in when else loss), m

    monkeypatch.setattr(trainer_mod, "grpo_loss", grpo_loss)
    return when.append


def test_nonfinite_loss_aborts_with_a_checkpoint_that_resumes_exactly(tmp_path, digits_task, nan_loss_at):
    from quads.rl.trainer import NonFiniteError

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    over = dict(steps=3, eval_every=0)
    straight = GRPOTrainer(tiny_config(tmp_path / "a", ckpt, **over), quiet=True).run()
    nan_loss_at(5)  # the straight run made calls 1-3 (one mini-batch per step): call 5 is the next run's step 2
    cfg_b = tiny_config(tmp_path / "b", ckpt, **over)
    assert cfg_b.guard.nonfinite == "abort"  # the default
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss nan.*checkpoint of step 1.*nonfinite skip"):
        GRPOTrainer(cfg_b, quiet=True).run()
    assert ckpt_mod.latest_checkpoint(cfg_b.out_dir).name == "step_000001"
    assert sorted(read_metrics(tmp_path / "b" / "run")) == [0, 1]
    policy, _ = load_checkpoint(tmp_path / "b" / "run" / "policy")
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    resumed = GRPOTrainer(replace(cfg_b, resume=True), quiet=True).run()
    a, b = read_metrics(straight.run_dir), read_metrics(resumed.run_dir)
    for step in (2, 3):
        assert ({k: v for k, v in a[step].items() if not k.startswith(NONDETERMINISTIC)}
                == {k: v for k, v in b[step].items() if not k.startswith(NONDETERMINISTIC)}), step


def test_nonfinite_loss_skips_the_optimizer_step_when_asked(tmp_path, digits_task, nan_loss_at):
    from quads.rl.config import GuardSection

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    nan_loss_at(2)
    cfg = tiny_config(tmp_path, ckpt, steps=3, eval_every=0, guard=GuardSection(nonfinite="skip"))
    res = GRPOTrainer(cfg, quiet=True).run()
    m = read_metrics(res.run_dir)
    assert [m[s]["optim/skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert [m[s]["optim/steps"] for s in (1, 2, 3)] == [1.0, 1.0, 2.0]
    assert math.isnan(m[2]["loss/total"]) or math.isnan(m[2]["optim/grad_norm"])
    assert all(math.isfinite(m[3][k]) for k in ("loss/total", "optim/grad_norm", "reward/mean"))
    policy, _ = load_checkpoint(res.policy_dir)
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    assert "nonfinite: skip" in (res.run_dir / "config.yaml").read_text()


def test_adv_eps_must_be_positive():
    from quads.rl.grpo import GRPOLossConfig

    for bad in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="grpo.adv_eps"):
            GRPOLossConfig(adv_eps=bad)


def test_two_mini_batches_without_correction_take_an_off_policy_second_step(tmp_path, digits_task, monkeypatch):
    """optim.mini_batches=2, correction none (the paper's naive baseline): two optimizer steps per batch. The
    first mini-batch is on-policy (logp = logp_old, ratio 1, IS weight 1); the second is evaluated after the first
    optimizer step, so its PPO ratio exp(logp - logp_old) against the step-start trainer log-probs is off 1
    (quads.rl.grpo: both sides of the ratio from the trainer; the rollout log-probs only enter the IS weight)."""
    from quads.rl import trainer as trainer_mod
    from quads.rl.correction import CorrectionConfig

    calls = []
    real = trainer_mod.grpo_loss

    def spy(logp, logp_old, adv, mask, cfg, **kw):
        calls.append((logp.detach().clone(), logp_old.clone(), kw["is_weights"].clone(), mask.clone()))
        return real(logp, logp_old, adv, mask, cfg, **kw)

    monkeypatch.setattr(trainer_mod, "grpo_loss", spy)
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    cfg = tiny_config(tmp_path, ckpt, steps=1, eval_every=0, recipe=RecipeSection(name="nvfp4"),
                      correction=CorrectionConfig(kind="none"),
                      optim=OptimSection(lr=2e-2, mini_batches=2))
    res = GRPOTrainer(cfg, quiet=True).run()
    m = read_metrics(res.run_dir)
    assert m[1]["optim/steps"] == 2.0 and len(calls) == 2
    (lp1, old1, w1, mask1), (lp2, old2, w2, mask2) = calls
    assert old1.shape[0] == old2.shape[0] == 8  # 16 samples in two halves
    for w, mask in ((w1, mask1), (w2, mask2)):
        assert torch.equal(w, mask)  # correction none: weight 1 on every response token, nothing dropped
    on = mask1.bool()
    assert torch.allclose(lp1[on], old1[on], atol=1e-6)  # the first step is on-policy
    off = (lp2 - old2)[mask2.bool()].abs().max().item()
    assert off > 1e-4, off  # the second step's ratio moved: its weights are one optimizer step newer
    assert m[1]["correction/weight_mean"] == 1.0


def test_heldout_set_is_fixed_by_task_eval_seed_not_the_run_seed(tmp_path, digits_task):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")

    def eval_set(seed, eval_seed):
        cfg = tiny_config(tmp_path, ckpt, seed=seed, out_dir=str(tmp_path / f"run{seed}-{eval_seed}"),
                          task=TaskSection(name="digits", train_size=64, eval_seed=eval_seed))
        t = GRPOTrainer(cfg, quiet=True)
        t.setup()
        return [e.prompt for e in t.eval_set]

    fixed = eval_set(0, None)
    assert eval_set(1, 0) == eval_set(2, 0) == fixed == eval_set(0, 0)  # fixed: seed 0's set for every seed
    assert eval_set(1, None) != fixed and eval_set(1, None) == eval_set(3, 1)  # None: the run seed's own set


def test_a_fixed_heldout_set_shares_no_prompt_with_the_run_seeds_training_prompts():
    from quads.rl.build import build_task, heldout_examples

    cfg = TrainConfig(task=TaskSection(name="arithmetic", difficulty=8, eval_seed=0), seed=3, eval_n=200)
    task = build_task(cfg)
    held = [e.prompt for e in heldout_examples(cfg, task)]
    assert held == [e.prompt for e in tasks.get_task("arithmetic", difficulty=8, seed=0).examples("test", 200)]
    assert held != [e.prompt for e in task.examples("test", 200)]  # the run seed's own set differs
    assert not set(held) & {e.prompt for e in task.examples("train", 4000)}
    with pytest.raises(ValueError, match="task.eval_seed applies to generated tasks only"):
        TaskSection(name="dataset", dataset="x.jsonl", eval_seed=0)


@pytest.mark.parametrize("warmup", [0, 4])
def test_the_first_adamw_step_moves_every_weight_by_lr_unless_warmed_up(tmp_path, digits_task, warmup):
    """AdamW's bias-corrected first update is lr * g / |g|: every weight with a gradient moves by the full lr
    whatever its gradient's size (the start-of-RL shock of docs/TRAINING.md); optim.warmup_steps W scales
    the first step to lr / W."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    cfg = tiny_config(tmp_path, ckpt, optim=OptimSection(lr=1e-3, warmup_steps=warmup), steps=1)
    t = GRPOTrainer(cfg, quiet=True)
    t.setup()
    before = [p.detach().clone() for p in t.params]
    t.step(1)
    moved = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(t.params, before)])
    moved = moved[moved > 0]
    assert moved.numel() > 1000
    lr = 1e-3 / (warmup or 1)
    assert moved.median().item() == pytest.approx(lr, rel=1e-2) and moved.max().item() <= lr * 1.001


def test_time_limit_is_a_deadline_for_the_next_step_eval_and_save():
    """time_limit_s stops a run when one more step (the longest of the last three) + the closing eval and
    checkpoint (as long as the latest ones; an untimed eval counts as a step) would end past the limit."""
    from quads.rl.interrupt import StopClock

    clock = StopClock()
    assert not clock.past_deadline(0.0, 1.0)  # nothing timed yet: only the elapsed time counts
    assert clock.past_deadline(1.0, 1.0)
    for dt in (1.0, 3.0, 2.0, 0.5):
        clock.steps = (clock.steps + [dt])[-3:]
    assert clock.steps == [3.0, 2.0, 0.5]
    assert not clock.past_deadline(10.0, 16.1)  # 10 + 3 (step) + 3 (untimed eval = a step) < 16.1
    assert clock.past_deadline(10.0, 16.0)
    clock.last.update(eval=5.0, save=1.0)
    assert not clock.past_deadline(10.0, 19.5)  # 10 + 3 + 5 + 1 = 19
    assert clock.past_deadline(10.0, 19.0)
    with clock.timing("step"):
        pass
    assert len(clock.steps) == 3 and clock.steps[-1] < 0.5 and clock.last["step"] == clock.steps[-1]


def test_eval_trainer_scores_the_trainers_own_policy(tmp_path, digits_task):
    """eval_trainer: the held-out prompts also go through the trainer's model (eval/trainer_pass@1). For
    bf16 that is the rollout's function (the same greedy texts); under an amplified W4A4 rollout it is not."""
    from quads.evaluation import evaluate_backend

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    res = GRPOTrainer(tiny_config(tmp_path, ckpt, steps=3, eval_every=3, eval_trainer=True), quiet=True).run()
    m = read_metrics(res.run_dir)
    assert {0, 3} <= {s for s, r in m.items() if "eval/trainer_pass@1" in r}
    assert all(0.0 <= m[s]["eval/trainer_pass@1"] <= 1.0 for s in (0, 3))

    def texts(recipe, **rec):
        cfg = tiny_config(tmp_path / recipe, ckpt, eval_trainer=True, recipe=RecipeSection(name=recipe, **rec))
        t = GRPOTrainer(cfg, quiet=True)
        t.setup()
        ex = t.eval_set[:4]
        kw = dict(max_new_tokens=6, batch_size=None, seed=0)
        own = evaluate_backend(t.trainer_engine, t.task, ex, **kw)
        return evaluate_backend(t.engine, t.task, ex, **kw), own

    roll, own = texts("bf16")
    assert [s["response"] for s in roll.samples] == [s["response"] for s in own.samples]
    roll, own = texts("nvfp4", rollout_error_scale=16.0)
    assert [s["response"] for s in roll.samples] != [s["response"] for s in own.samples]


def test_weight_only_recipe_rolls_out_what_its_qat_trainer_computes(tmp_path, digits_task):
    """``w4a16``: the rollout's W4A16 forward is the QAT trainer's QDQ(W) x X, so its log-prob gap is BF16's floor
    (the engine's drift alone: KV-cache decode against the full forward), where W4A4 rollouts against the same
    trainer (``w4a16-qat``) sit far above it."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")

    def gaps(recipe):
        cfg = tiny_config(tmp_path / recipe, ckpt, steps=2, eval_every=0, recipe=RecipeSection(name=recipe))
        m = read_metrics(GRPOTrainer(cfg, quiet=True).run().run_dir)
        return [(m[s]["mismatch/logp_gap_max"], m[s]["mismatch/k3"]) for s in (1, 2)]

    floor, matched, w4a4 = gaps("bf16"), gaps("w4a16"), gaps("w4a16-qat")
    for (f_gap, _), (gap, k3), (q_gap, _) in zip(floor, matched, w4a4):
        assert gap <= 4 * max(f_gap, 1e-6) and abs(k3) < 1e-9, (floor, matched)
        assert q_gap > 100 * max(gap, 1e-6), (matched, w4a4)


def test_mismatch_guard_thresholds_include_the_per_sequence_gap():
    """check_guard trips on each configured threshold (NaN too) and ignores the ones set to None; the
    per-sequence gap (default 5.0, the amplifier's budget per sequence) is one of them."""
    from quads.rl.config import GuardSection
    from quads.rl.trainer import check_guard

    cfg = TrainConfig()
    assert cfg.guard.seq_gap == 5.0
    ok = {"mismatch/logp_gap_mean": 0.01, "mismatch/k3": 1e-3, "mismatch/seq_gap_mean": 1.2}
    assert check_guard(ok, cfg) == []
    tripped = check_guard({**ok, "mismatch/seq_gap_mean": 7.5}, cfg)
    assert tripped == ["mismatch/seq_gap_mean=7.5 > 5"]
    assert check_guard({**ok, "mismatch/seq_gap_mean": math.nan}, cfg) == ["mismatch/seq_gap_mean=nan > 5"]
    off = replace(cfg, guard=GuardSection(seq_gap=None))
    assert check_guard({**ok, "mismatch/seq_gap_mean": 7.5}, off) == []
    assert len(check_guard({**ok, "mismatch/k3": 0.5, "mismatch/seq_gap_mean": 9.0}, cfg)) == 2
