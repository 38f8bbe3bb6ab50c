"""``quads train`` from the command line: config resolution and bad input (errors name the field)."""

from pathlib import Path

import pytest
import yaml
from conftest import save_tiny_checkpoint

from quads.cli import main
from quads.config import build_config
from quads.rl.config import TrainConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("echo_task")  # conftest: the "echo" task


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


def test_kernel_backend_and_dist_timeout_are_config_fields(tmp_path, capsys):
    """The kernel backend and the collective timeout are typed fields: recorded in config.yaml, applied by the
    trainer, and a bad value names its field (no environment variable decides them)."""
    from quads.kernels import dispatch

    ckpt = make_ckpt(tmp_path / "ckpt")
    run = tmp_path / "run"
    try:
        assert train("--steps", 1, "--model.checkpoint", ckpt, "--out-dir", run, "--kernels", "reference",
                     "--dist-timeout-s", 30, *TINY) == 0
        assert dispatch.backend() == "reference"
    finally:
        dispatch.set_backend("auto")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["kernels"] == "reference" and saved["dist_timeout_s"] == 30.0
    assert train("--kernels", "fast", "--out-dir", tmp_path / "bad") == 2
    assert "kernels: expected one of ['auto', 'triton', 'reference'], got 'fast'" in capsys.readouterr().err
    assert train("--dist-timeout-s", 0, "--out-dir", tmp_path / "bad") == 2
    assert "dist_timeout_s must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kernels must be auto, triton or reference; got 'fast'"):
        TrainConfig(kernels="fast")
def test_resuming_a_finished_run_reports_its_last_step_and_cleans_temp_folders(tmp_path, capsys):
    ckpt = make_ckpt(tmp_path / "ckpt")
    run = tmp_path / "run"
    assert train("--steps", 1, "--model.checkpoint", ckpt, "--out-dir", run, *TINY) == 0
    first = capsys.readouterr().out
    last_line = next(x for x in first.splitlines() if x.startswith("last step:"))
    stale = run / ".policy.k1ll3d.tmp"  # what a kill during the policy write leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"torn")
    assert train("--out-dir", run, "--resume", "true", "--quiet") == 0
    out = capsys.readouterr().out
    assert "nan" not in out
    assert last_line in out  # the finished run's last step, not "reward nan"
    assert not stale.exists()


def test_adv_eps_zero_is_refused(tmp_path, capsys):
    ckpt = make_ckpt(tmp_path / "ckpt")
    run = tmp_path / "run"
    assert train("--grpo.adv-eps", 0, "--model.checkpoint", ckpt, "--steps", 1, "--out-dir", run, *TINY) == 2
    err = capsys.readouterr().err
    assert "grpo.adv_eps" in err and "> 0" in err
    assert not run.exists()


def test_a_dataset_without_held_out_prompts_is_refused_before_the_run_folder(tmp_path, capsys):
    import json

    from quads.tasks import split_of

    prompts = [p for p in (f"Q: {i}+1=\n" for i in range(50)) if split_of(p, 0.1, "0:") == "train"][:5]
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    run = tmp_path / "run"
    assert train("--task.name", "dataset", "--task.dataset", data, "--model.checkpoint", make_ckpt(tmp_path / "c"),
                 "--out-dir", run, *TINY[2:]) == 2  # TINY without its --task.name
    assert "no held-out (test) examples" in capsys.readouterr().err
    assert not run.exists()
