"""The rollout seam: ``make_backend`` picks the backend from the config; quads' engine implements the
``RolloutBackend`` protocol (``score`` = its own teacher-forced path, ``load_weights`` = the one weight sync);
``WeightSync`` refuses a disagreement its source reports (another rank's replica)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from quads.model import ModelConfig, MoEForCausalLM
from quads.model.tokenizer import CharTokenizer
from quads.quant import WeightSyncError, get_recipe, quantize_model
from quads.quant.sync import LocalWeights, ReplicaTarget, WeightSync
from quads.rl.config import RolloutSection
from quads.rollout import RolloutBackend, RolloutEngine, SamplingParams, make_backend
from quads.rollout.backend import check_backend


def _pair(recipe="quads"):
    torch.manual_seed(0)
    tok = CharTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                      n_experts=4, top_k=2, moe_intermediate_size=32, max_seq_len=64)
    trainer = MoEForCausalLM(cfg)
    rollout = copy.deepcopy(trainer)
    quantize_model(trainer, get_recipe(recipe), "trainer", verbose=False)
    quantize_model(rollout, get_recipe(recipe), "rollout", verbose=False)
    return trainer, rollout, tok


def _cfg(backend, attention="triton"):
    return SimpleNamespace(rollout_backend=backend, device="cpu", rollout=SimpleNamespace(cuda_graphs=False, compile=True,
                                                                                     compile_prefill=False,
                                                                                     share_prefill=False,
                                                                                     fuse_qkv=False,
                                                                                     decode_attention=attention))


def test_make_backend_picks_quads_engine_and_refuses_unknown(tmp_path):
    _, rollout, tok = _pair()
    engine = make_backend(_cfg("quads"), rollout, tok, get_recipe("quads"), tmp_path)
    assert isinstance(engine, RolloutEngine) and isinstance(engine, RolloutBackend)
    assert engine.model is rollout and engine.recipe == "quads"
    assert engine.decode_attention == "triton"  # rollout.decode_attention reaches the engine
    assert engine.compile and not engine.compile_prefill and RolloutSection().compile_prefill  # the flags reach it
    assert not engine.share_prefill and RolloutSection().share_prefill
    assert not engine.fuse_qkv and RolloutSection().fuse_qkv
    assert make_backend(_cfg("quads", "auto"), rollout, tok, get_recipe("quads"), tmp_path).decode_attention == "sdpa"
    assert RolloutSection().decode_attention == "auto"
    with pytest.raises(ValueError, match="rollout.decode_attention must be auto, sdpa or triton"):
        RolloutSection(decode_attention="flash")
    with pytest.raises(ValueError, match="the quads engine's"):  # vLLM attends its own way
        make_backend(_cfg("vllm"), rollout, tok, get_recipe("quads"), tmp_path)
    with pytest.raises(ValueError, match="rollout_backend must be one of"):
        make_backend(_cfg("sglang"), rollout, tok, get_recipe("quads"), tmp_path)
    check_backend("quads", world=2)  # one engine per rank under torchrun
    with pytest.raises(ValueError, match="runs in one process only"):
        check_backend("vllm", world=2)


def test_engine_load_weights_then_score_reproduces_its_rollout():
    trainer, rollout, tok = _pair()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = RolloutEngine(rollout, tok, recipe="quads")
    rep = engine.load_weights(LocalWeights(trainer))
    assert rep.ok and rep.n_checked == 2 and rep.n_tensors == len(trainer.state_dict())
    for name, p in trainer.named_parameters():
        assert torch.equal(p, rollout.get_parameter(name)), name
    batch = engine.generate(["12+3=", "7*8="], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    assert torch.equal(engine.score(batch, 1.0), batch.logprobs)  # the engine's own path, bit for bit


def test_sync_refuses_what_the_source_reports():
    trainer, rollout, _ = _pair()

    class OtherRankDiffers(LocalWeights):
        def agree(self, fingerprints):
            return [f"{next(iter(fingerprints))} (rank 1 vs rank 0)"]

    with pytest.raises(WeightSyncError, match="rank 1 vs rank 0"):
        WeightSync(OtherRankDiffers(trainer), ReplicaTarget(rollout)).run()
    rep = WeightSync(OtherRankDiffers(trainer), ReplicaTarget(rollout)).run(raise_on_mismatch=False)
    assert not rep.ok and rep.n_checked == 2
    assert WeightSync(LocalWeights(trainer), ReplicaTarget(rollout)).run().ok
