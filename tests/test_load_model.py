"""One loader for every command: a quads checkpoint or a Hugging Face folder (Qwen3-MoE, OLMoE, Mixtral)
-> model + tokenizer (``quads.model.checkpoint.load_model``), used by ``quads train / eval / diagnose``."""

import json

import pytest
import torch

from quads.cli import main
from quads.model.checkpoint import load_model, save_checkpoint
from quads.model.config import ModelConfig
from quads.model.hf import save_hf_model
from quads.model.tokenizer import CharTokenizer
from quads.model.transformer import MoEForCausalLM

QK_NORM = {"qwen3_moe": "head", "olmoe": "full", "mixtral": "none"}


def tiny(arch, seed=0):
    torch.manual_seed(seed)
    tok = CharTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                      n_experts=4, top_k=2, moe_intermediate_size=32, max_seq_len=64, qk_norm=QK_NORM[arch],
                      norm_topk_prob=arch == "mixtral", dtype="float32", architecture=arch)
    return MoEForCausalLM(cfg).eval(), tok


@pytest.fixture(params=list(QK_NORM))
def hf_folder(request, tmp_path):
    model, tok = tiny(request.param)
    return save_hf_model(model, tok, tmp_path / request.param, architecture=request.param), model, tok


def test_load_model_reads_hf_and_quads_folders_alike(hf_folder, tmp_path):
    folder, model, tok = hf_folder
    ids = torch.tensor([tok.encode("12+34=")])
    want = model(ids).logits
    for path in (folder, save_checkpoint(model, tmp_path / "q", tokenizer=tok)):
        got_model, got_tok, _ = load_model(path, "float32")
        got = got_model(ids).logits
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert got_tok.encode("12+34=") == tok.encode("12+34=") and got_tok.eos_id == tok.eos_id


def test_eval_and_train_accept_an_hf_folder(tmp_path, capsys, monkeypatch):
    model, tok = tiny("qwen3_moe")
    folder = save_hf_model(model, tok, tmp_path / "hf", architecture="qwen3_moe")
    assert main(["eval", "--checkpoint", str(folder), "--task", "arithmetic", "--difficulty", "1",
                 "--n-prompts", "2", "--max-new-tokens", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n_prompts"] == 2
    run = tmp_path / "run"
    assert main(["train", "--model.checkpoint", str(folder), "--out-dir", str(run), "--steps", "1",
                 "--task.name", "arithmetic", "--task.difficulty", "1", "--task.train-size", "8",
                 "--recipe.name", "bf16", "--rollout.prompts-per-step", "2", "--rollout.n-samples", "2",
                 "--rollout.max-new-tokens", "4", "--eval-n", "2", "--dtype", "float32",
                 "--log.tensorboard", "false", "--log.probe-tokens", "4", "--quiet"]) == 0
    policy, _, extra = load_model(run / "policy")
    assert policy.config.architecture == "qwen3_moe" and extra["task"] == "arithmetic" and extra["difficulty"] == 1


def test_diagnose_accepts_an_hf_folder(tmp_path):
    model, tok = tiny("mixtral")
    folder = save_hf_model(model, tok, tmp_path / "hf", architecture="mixtral")
    out = tmp_path / "diag"
    assert main(["diagnose", "--checkpoint", str(folder), "--prompts", "2", "--n-samples", "2",
                 "--max-new-tokens", "4", "--rac-ratios", "1.0", "--layer-errors", "false", "--dtype", "float32",
                 "--out-dir", str(out)]) == 0
    assert (out / "decomposition.jsonl").is_file()
