"""``quads train`` from the command line: config resolution and bad input (errors name the field)."""

import random
from pathlib import Path

import pytest
import yaml
from conftest import save_tiny_checkpoint

from quads import tasks
from quads.cli import main
from quads.config import build_config
from quads.rl.config import TrainConfig
from quads.tasks.base import Example, Score

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


class EchoTask:
    name = "echo"

    def __init__(self, seed=0, **_):
        self.seed = seed

    def examples(self, split, n=None):
        rng = random.Random(f"{self.seed}:{split}")
        return [Example(f"Q{rng.randint(0, 999)}:", "1", "echo") for _ in range(n or 32)]

    def score(self, example, response):
        ok = response.startswith("1")
        return Score(float(ok), ok, "first char")

    def demonstration(self, example):
        return "1"


@pytest.fixture(autouse=True)
def echo_task(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "echo", EchoTask)


def make_ckpt(path, n_layers=1):
    return save_tiny_checkpoint(path, n_layers=n_layers)


TINY = ["--task.name", "echo", "--recipe.name", "bf16", "--rollout.prompts-per-step", "2", "--rollout.n-samples",
        "2", "--rollout.max-new-tokens", "4", "--eval-n", "2", "--dtype", "float32", "--log.tensorboard", "false",
        "--log.probe-tokens", "4", "--quiet"]


def train(*argv):
    return main(["train", *map(str, argv)])


def test_run_saves_resolved_config_and_prints_report(tmp_path, capsys):
    ckpt = make_ckpt(tmp_path / "ckpt")
    yml = tmp_path / "c.yaml"
    yml.write_text(yaml.safe_dump({"steps": 5, "optim": {"lr": 1e-3, "betas": [0.8, 0.9]}}))
    run = tmp_path / "run"
    assert train("--config", yml, "--steps", 2, "--model.checkpoint", ckpt, "--out-dir", run, *TINY) == 0
    out = capsys.readouterr().out
    assert f"report: {run / 'report' / 'report.md'}" in out
    saved = build_config(TrainConfig, run / "config.yaml")
    assert saved.steps == 2  # flag over YAML
    assert saved.optim.lr == 1e-3 and saved.optim.betas == (0.8, 0.9)  # YAML over defaults
    assert saved.rollout.max_new_tokens == 4 and saved.model.checkpoint == str(ckpt)
    # a finished run is not clobbered by a second start in the same folder
    assert train("--model.checkpoint", ckpt, "--out-dir", run, *TINY) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_configs_parse(path):
    cfg = build_config(TrainConfig, path)
    assert cfg.steps >= 1


@pytest.mark.parametrize("content, field", [
    ({"optim": {"lr": 1e-3, "learning_rate": 1}}, "learning_rate"),
    ({"stepz": 3}, "stepz"),
    ({"optim": {"lr": "fast"}}, "optim.lr"),
    ({"rollout": {"n_samples": 1.5}}, "rollout.n_samples"),
    ({"correction": {"kind": "clip"}}, "correction.kind"),
    ({"rollout": {"n_samples": 1}}, "rollout.n_samples"),
])
def test_bad_yaml_names_the_field(tmp_path, capsys, content, field):
    yml = tmp_path / "bad.yaml"
    yml.write_text(yaml.safe_dump(content))
    run = tmp_path / "run"
    assert train("--config", yml, "--out-dir", run) == 2
    err = capsys.readouterr().err
    assert field in err
    assert not run.exists()


def test_bad_flags_and_inputs(tmp_path, capsys):
    ckpt = make_ckpt(tmp_path / "ckpt")
    run = tmp_path / "run"
    assert train("--steps", "many", "--out-dir", run) == 2
    assert "steps: expected int" in capsys.readouterr().err
    assert train("--config", tmp_path / "nope.yaml", "--out-dir", run) == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert train("--task.name", "dataset", "--task.dataset", tmp_path / "missing.jsonl", "--model.checkpoint",
                 ckpt, "--out-dir", run) == 2
    err = capsys.readouterr().err
    assert "task.dataset" in err and "missing.jsonl" in err and "does not exist" in err
    assert train("--model.checkpoint", tmp_path / "no_ckpt", "--out-dir", run, *TINY) == 2
    assert "model.checkpoint" in capsys.readouterr().err
    assert train(*TINY, "--recipe.name", "int3", "--model.checkpoint", ckpt, "--out-dir", run) == 2
    assert "recipe" in capsys.readouterr().err
    assert not run.exists()


def test_resume_with_another_architecture(tmp_path, capsys):
    ckpt = make_ckpt(tmp_path / "ckpt")
    other = make_ckpt(tmp_path / "other", n_layers=2)
    run = tmp_path / "run"
    assert train("--steps", 1, "--model.checkpoint", ckpt, "--out-dir", run, *TINY) == 0
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert train("--out-dir", run, "--resume", "true", "--steps", 2, "--model.checkpoint", other, "--quiet") == 2
    err = capsys.readouterr().err
    assert "another architecture" in err and "n_layers" in err and "model.checkpoint" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing written
    # with the run's own config (read from run/config.yaml) the resume goes through
    assert train("--out-dir", run, "--resume", "true", "--steps", 2, "--quiet") == 0
    assert "step_000002" in (run / "checkpoints" / "latest").read_text()
    assert train("--out-dir", tmp_path / "empty", "--resume", "true") == 2
    assert "no checkpoint" in capsys.readouterr().err
