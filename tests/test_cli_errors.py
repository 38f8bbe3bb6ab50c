"""Bad input to the CLI is one line on stderr and exit 2, found before any expensive work; Ctrl-C is
exit 130 with one line and, during training, a resumable checkpoint (``quads.errors``, ``quads.cli``)."""

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint

from quads import tasks
from quads.cli import main
from quads.rl.checkpoint import latest_checkpoint
from quads.tasks.arithmetic import ArithmeticTask

pytestmark = pytest.mark.usefixtures("echo_task")  # conftest: the "echo" task


TINY = ["--task.name", "echo", "--recipe.name", "bf16", "--rollout.prompts-per-step", "2", "--rollout.n-samples",
        "2", "--rollout.max-new-tokens", "4", "--eval-n", "2", "--dtype", "float32", "--log.tensorboard", "false",
        "--log.probe-tokens", "4", "--quiet"]


@pytest.fixture
def ckpt(tmp_path):
    return save_tiny_checkpoint(tmp_path / "ckpt", {"task": "echo"})


def one_line_error(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


def train(*argv):
    return main(["train", *map(str, argv)])


def test_yaml_syntax_error_names_file_and_line(tmp_path, capsys):
    yml = tmp_path / "bad.yaml"
    yml.write_text("steps: 3\noptim:\n  lr: [1e-3\n")
    assert train("--config", yml, "--out-dir", tmp_path / "run") == 2
    one_line_error(capsys, "bad.yaml", "line", "not valid YAML")
    assert not (tmp_path / "run").exists()


@pytest.fixture
def truncated(ckpt):
    w = ckpt / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    return ckpt


def test_truncated_weights_train(truncated, tmp_path, capsys):
    assert train("--model.checkpoint", truncated, "--out-dir", tmp_path / "run", *TINY) == 2
    one_line_error(capsys, "model.checkpoint", "truncated")
    assert not (tmp_path / "run").exists()


def test_truncated_weights_eval(truncated, capsys):
    assert main(["eval", "--checkpoint", str(truncated), "--task", "echo", "--n-prompts", "2"]) == 2
    one_line_error(capsys, "truncated")


def test_truncated_weights_export(truncated, tmp_path, capsys):
    assert main(["export", "--checkpoint", str(truncated), "--format", "bf16", "--out", str(tmp_path / "e")]) == 2
    one_line_error(capsys, "truncated")
    assert not (tmp_path / "e").exists()


def test_truncated_weights_diagnose(truncated, tmp_path, capsys):
    out = tmp_path / "diag"
    assert main(["diagnose", "--checkpoint", str(truncated), "--out-dir", str(out), "--prompts", "2"]) == 2
    one_line_error(capsys, "checkpoint", "truncated")
    assert not out.exists()


def test_checkpoint_without_tokenizer(ckpt, tmp_path, capsys):
    (ckpt / "tokenizer.json").unlink()
    assert train("--model.checkpoint", ckpt, "--out-dir", tmp_path / "run", *TINY) == 2
    one_line_error(capsys, "model.checkpoint", "tokenizer.json")
    assert not (tmp_path / "run").exists()
    assert main(["eval", "--checkpoint", str(ckpt), "--task", "echo", "--n-prompts", "2"]) == 2
    one_line_error(capsys, "tokenizer.json")


def test_out_dir_naming_a_file(ckpt, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert train("--model.checkpoint", ckpt, "--out-dir", f, *TINY) == 2
    one_line_error(capsys, "out_dir", "is a file")
    assert train("--model.checkpoint", ckpt, "--out-dir", f / "run", *TINY) == 2
    one_line_error(capsys, "out_dir", "is a file")
    assert f.read_text() == "x"


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder no file can be created in: a chmod 555 folder, or for root (who ignores modes) /sys."""
    if os.geteuid() == 0:
        yield Path("/sys")
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    yield ro
    ro.chmod(0o755)


def test_read_only_out_dir_is_refused_before_the_work(ckpt, read_only_dir, tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the expensive work started before the output folder was checked")

    monkeypatch.setattr("quads.rl.build.build_models", no_work)
    monkeypatch.setattr("quads.export.load_source", no_work)
    monkeypatch.setattr("quads.experiments.diagnose._load", no_work)
    assert train("--model.checkpoint", ckpt, "--out-dir", read_only_dir / "quads-run", *TINY) == 2
    one_line_error(capsys, "out_dir", "cannot write")
    assert main(["export", "--checkpoint", str(ckpt), "--format", "bf16", "--out",
                 str(read_only_dir / "quads-export")]) == 2
    one_line_error(capsys, "--out", "cannot write")
    assert main(["diagnose", "--checkpoint", str(ckpt), "--out-dir", str(read_only_dir / "quads-diag")]) == 2
    one_line_error(capsys, "out_dir", "cannot write")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda(ckpt, tmp_path, capsys):
    assert train("--model.checkpoint", ckpt, "--out-dir", tmp_path / "run", "--device", "cuda", *TINY) == 2
    one_line_error(capsys, "device", "cuda")
    assert not (tmp_path / "run").exists()
    assert main(["eval", "--checkpoint", str(ckpt), "--task", "echo", "--device", "cuda"]) == 2
    one_line_error(capsys, "device", "cuda")


def test_dataset_too_small_for_a_held_out_split(ckpt, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Q{i}:", "answer": "1"}) for i in range(3)) + "\n")
    run = tmp_path / "run"
    assert train("--task.dataset", data, "--model.checkpoint", ckpt, "--out-dir", run, *TINY,
                 "--task.name", "dataset") == 2
    one_line_error(capsys, "held-out split")
    assert not run.exists()


class FewPromptsTask(ArithmeticTask):
    """A generated task with five distinct prompts (the base class's draw loop gives up on more)."""

    def _make(self, rng):
        return super()._make(random.Random(rng.randrange(5)))


def test_train_size_larger_than_the_task_offers(ckpt, tmp_path, capsys, monkeypatch):
    """A task with fewer distinct prompts than task.train_size trains on all it has and says so (the
    draw loop of a generated task gives up quickly instead of failing after a million draws)."""
    monkeypatch.setitem(tasks.TASKS, "few", FewPromptsTask)
    loud = [a for a in TINY if a != "--quiet"]
    assert train("--model.checkpoint", ckpt, "--out-dir", tmp_path / "run", "--task.train-size", 50, *loud,
                 "--task.name", "few", "--steps", 1) == 0
    err = capsys.readouterr().err
    assert "distinct training prompts" in err and "task.train_size 50" in err and "the task offers no more" in err


def test_ctrl_c_stops_after_the_step_with_a_resumable_checkpoint(ckpt, tmp_path, capsys, monkeypatch):
    from quads.rl.trainer import GRPOTrainer

    step = GRPOTrainer.step

    def step_then_ctrl_c(self, i):
        out = step(self, i)
        if i == 2:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(GRPOTrainer, "step", step_then_ctrl_c)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN in a shell's background job
    run = tmp_path / "run"
    assert train("--model.checkpoint", ckpt, "--out-dir", run, "--steps", 4, "--log.save-every", 0, *TINY) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("quads train: interrupted") and "--resume true" in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert latest_checkpoint(run).name.endswith("2")
    assert signal.getsignal(signal.SIGINT) is before  # the handler is given back
    monkeypatch.setattr(GRPOTrainer, "step", step)
    assert train("--out-dir", run, "--resume", "true", "--quiet") == 0
    assert "done: 4 steps" in capsys.readouterr().out


def test_ctrl_c_outside_training_is_exit_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("quads.evaluate.build_config", interrupted)
    assert main(["eval", "--checkpoint", "x"]) == 130
    assert capsys.readouterr().err.strip() == "quads eval: interrupted"
