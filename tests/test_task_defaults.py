"""Every documented task and level trains with the defaults of ``quads train``: the warm start and the RL
prompt sets take what the task offers (code has 223 training prompts, countdown level 2 about 8500,
arithmetic level 1 about 140), with the held-out split disjoint. Sizes are the defaults; only the step
counts and batch sizes are tiny, and arithmetic level 10 (the long chain, sequences up to ~4,000 tokens)
warm-starts with a 4096-position context (``warm_start.max_seq_len``)."""

import pytest

from quads.pretrain import PretrainConfig, warm_start
from quads.rl.config import (
    LogSection,
    RecipeSection,
    RolloutSection,
    TaskSection,
    TrainConfig,
    WarmStartSection,
)
from quads.rl.trainer import GRPOTrainer
from quads.tasks.arithmetic import LEVELS as ARITHMETIC_LEVELS
from quads.tasks.arithmetic import LONG_CHAIN_LEVEL
from quads.tasks.countdown import LEVELS as COUNTDOWN_LEVELS

CASES = ([("arithmetic", d) for d in sorted(ARITHMETIC_LEVELS)] + [("countdown", d) for d in sorted(COUNTDOWN_LEVELS)]
         + [("code", None)])


@pytest.mark.slow
@pytest.mark.parametrize("name,difficulty", CASES, ids=lambda x: str(x))
def test_every_task_and_level_warm_starts_and_trains_with_default_sizes(tmp_path, name, difficulty):
    default = TrainConfig()
    long_chain = (name, difficulty) == ("arithmetic", LONG_CHAIN_LEVEL)
    cfg = TrainConfig(
        task=TaskSection(name=name, difficulty=difficulty),
        warm_start=WarmStartSection(steps=1, batch_size=2, cache_dir=str(tmp_path / "cache"),
                                    max_seq_len=4096 if long_chain else None),
        recipe=RecipeSection(name="bf16"),
        rollout=RolloutSection(prompts_per_step=2, n_samples=2, max_new_tokens=4),
        log=LogSection(tensorboard=False, progress=False),
        steps=1, eval_every=0, threads=1, out_dir=str(tmp_path / "run"),
        # the long chain's two held-out evals would prefill 200 prompts of ~580 tokens each (half the test's
        # time on a 2-core CPU): 8 here, and its test split is checked to offer the default 200 below
        eval_n=8 if long_chain else default.eval_n,
    )
    assert (cfg.task.train_size, cfg.warm_start.train_size) == (default.task.train_size, default.warm_start.train_size)
    if long_chain:
        from quads.tasks import get_task
        from quads.tasks.base import examples_up_to

        assert len(examples_up_to(get_task(name, difficulty=difficulty), "test", default.eval_n)) == default.eval_n
    trainer = GRPOTrainer(cfg, quiet=True)
    res = trainer.run()
    assert res.steps == 1 and (res.policy_dir / "config.json").is_file()
    train = {e.prompt for e in trainer.sampler.items}
    assert 0 < len(train) <= cfg.task.train_size and 0 < len(trainer.eval_set) <= cfg.eval_n
    assert train.isdisjoint(e.prompt for e in trainer.eval_set)


def test_pretrain_defaults_evaluate_on_a_small_held_out_split(tmp_path):
    """``quads pretrain --task code``: its 62 held-out prompts are fewer than the default eval_size."""
    cfg = PretrainConfig(task="code", steps=1, batch_size=2, max_new_tokens=4, cache_dir=str(tmp_path),
                         progress=False, threads=1)
    assert cfg.eval_size > 62
    folder = warm_start(cfg)
    assert (folder / "config.json").is_file()
