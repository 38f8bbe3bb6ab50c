"""quads eval: the unbiased pass@k estimator and an end-to-end run on a tiny checkpoint."""

import json
import math
from itertools import combinations

import pytest

from quads.evaluate import EvalConfig, evaluate_model, pass_at_k, register, run
from quads.model import ModelConfig, MoEForCausalLM
from quads.model.checkpoint import save_checkpoint
from quads.model.tokenizer import CharTokenizer
from quads.tasks import Example, get_task


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 2), (4, 4, 4), (7, 1, 7)])
def test_pass_at_k_matches_enumeration(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    expected = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(n, c, n + 1)


class _EchoTask:
    """Scores a response as correct when it starts with the example's answer."""

    name = "echo"

    def score(self, example, response):
        from quads.tasks import Score

        ok = response.startswith(example.answer)
        return Score(float(ok), ok, "correct" if ok else "wrong")


def _tiny_checkpoint(tmp_path):
    tok = CharTokenizer()
    model = MoEForCausalLM(ModelConfig.preset("tiny", vocab_size=tok.vocab_size, n_layers=1, hidden_size=32,
                                              moe_intermediate_size=32, n_experts=4, max_seq_len=64))
    return model, tok, save_checkpoint(model, tmp_path / "ckpt", {}, tokenizer=tok)


def test_evaluate_model_counts_correct_samples(tmp_path):
    model, tok, _ = _tiny_checkpoint(tmp_path)
    examples = [Example(f"Q{i}\n", "", "echo", {}) for i in range(3)]  # "" prefixes everything: all correct
    res = evaluate_model(model, tok, _EchoTask(), examples, n_samples=2, ks=(1, 2), temperature=1.0,
                         max_new_tokens=4)
    assert res.pass_at == {1: 1.0, 2: 1.0} and res.n_prompts == 3
    never = [Example("Q\n", "\x01impossible", "echo", {})]
    assert evaluate_model(model, tok, _EchoTask(), never, max_new_tokens=4).pass_at == {1: 0.0}


def test_eval_cli_runs_on_tiny_checkpoint(tmp_path, capsys):
    import argparse

    _, _, folder = _tiny_checkpoint(tmp_path)
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["--checkpoint", str(folder), "--task", "arithmetic", "--difficulty", "1",
                              "--n-prompts", "4", "--n-samples", "2", "--k", "1,2", "--temperature", "1",
                              "--max-new-tokens", "8"])
    assert run(args) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["metric"] == "eval" and line["n_prompts"] == 4 and line["n_samples"] == 2
    assert 0.0 <= line["pass@1"] <= line["pass@2"] <= 1.0


def test_eval_config_validation():
    with pytest.raises(ValueError, match="n_samples"):
        EvalConfig(checkpoint="x", k=(4,), n_samples=2, temperature=1.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        EvalConfig(checkpoint="x", n_samples=4, k=(1,))


def test_dataset_eval(tmp_path, capsys):
    import argparse

    _, _, folder = _tiny_checkpoint(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Q: {i}+1=\n", "answer": str(i + 1)}) for i in range(3)))
    parser = argparse.ArgumentParser()
    register(parser)
    data.write_text("\n".join(json.dumps({"prompt": f"Q: {i}+1=\n", "answer": str(i + 1)}) for i in range(40)))
    held_out = get_task("dataset", path=data).examples("test")
    assert 0 < len(held_out) < 40
    assert run(parser.parse_args(["--checkpoint", str(folder), "--dataset", str(data),
                                  "--max-new-tokens", "4"])) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the held-out split only, as training holds it out (docs/TASKS.md), not the whole file
    assert line["n_prompts"] == len(held_out) and "held-out" in line["source"]
    assert line["pass@1"] == 0.0  # an untrained model never writes "#i+1"


def test_empty_dataset_is_an_error(tmp_path, capsys):
    from quads.cli import main

    _, _, folder = _tiny_checkpoint(tmp_path)
    for name, text in (("empty.jsonl", ""), ("one.jsonl", json.dumps({"prompt": "Q", "answer": "1"}))):
        (tmp_path / name).write_text(text)
        assert main(["eval", "--checkpoint", str(folder), "--dataset", str(tmp_path / name)]) == 2
        err = capsys.readouterr()
        assert "nothing to evaluate" in err.err and name in err.err and "pass@1" not in err.out


def test_eval_defaults_to_the_task_and_level_the_policy_trained_on(tmp_path, capsys):
    import argparse

    from quads.rl.build import policy_task
    from quads.rl.config import TrainConfig

    model, tok, _ = _tiny_checkpoint(tmp_path)
    cfg = TrainConfig()
    cfg.task.difficulty = 2
    extra = {"recipe": "bf16", "step": 1, **policy_task(cfg, get_task("arithmetic", difficulty=2))}
    folder = save_checkpoint(model, tmp_path / "policy", extra, tokenizer=tok)
    parser = argparse.ArgumentParser()
    register(parser)
    assert run(parser.parse_args(["--checkpoint", str(folder), "--n-prompts", "2", "--max-new-tokens", "2"])) == 0
    out = capsys.readouterr()
    line = json.loads(out.out.strip().splitlines()[-1])
    assert "task arithmetic (difficulty 2)" in line["source"] and "the checkpoint's task" in line["source"]
    assert "evaluating task arithmetic (difficulty 2)" in out.err
    # a checkpoint that records no task: the default task, and the output says so
    assert run(parser.parse_args(["--checkpoint", str(tmp_path / "ckpt"), "--n-prompts", "2",
                                  "--max-new-tokens", "2"])) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "default task" in line["source"] and "difficulty 6" in line["source"]


def test_dataset_eval_holds_out_what_training_held_out(tmp_path, capsys, monkeypatch):
    import argparse

    from quads.rl.build import policy_task
    from quads.rl.config import TrainConfig
    from quads.tasks import DatasetTask

    model, tok, _ = _tiny_checkpoint(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Q: {i}+2=\n", "answer": str(i + 2)}) for i in range(60)))
    held_out = {s: [e.prompt for e in DatasetTask(data, seed=s).examples("test")] for s in (0, 3)}
    assert held_out[0] != held_out[3]  # the split depends on the training seed
    cfg = TrainConfig(seed=3)
    cfg.task.name, cfg.task.dataset = "dataset", str(data)
    folder = save_checkpoint(model, tmp_path / "policy", policy_task(cfg, DatasetTask(data, seed=3)), tokenizer=tok)
    monkeypatch.chdir(tmp_path)  # the same file named by a relative path
    parser = argparse.ArgumentParser()
    register(parser)
    for argv in (["--dataset", "d.jsonl"], []):  # asked for, and the checkpoint's own task by default
        assert run(parser.parse_args(["--checkpoint", str(folder), "--max-new-tokens", "2", *argv])) == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert line["n_prompts"] == len(held_out[3]) and "split seed 3" in line["source"]
