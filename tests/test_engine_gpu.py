"""GPU only (skipped without CUDA): the static decode step replayed from a CUDA graph.

Graph replay against the same path without graphs (same kernels: identical tokens, log-probs and
routing), rescoring a graph batch bit for bit, weight sync reaching the captured graph without a
re-capture, and no host sync inside a decode step. Run on the device: `bash scripts/gpu_engine.sh`.
"""

import pytest
import torch

from quads.model import ModelConfig, MoEForCausalLM
from quads.model.tokenizer import CharTokenizer
from quads.quant import quantize_model
from quads.quant.recipe import LinearSpec, Recipe
from quads.quant.sync import sync_weights
from quads.rollout import RolloutEngine, SamplingParams, policy_engine
from quads.rollout.decode import StaticDecoder, device_groups
from quads.rollout.score import score_rollout
from quads.rollout.types import prompt_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")

TOK = CharTokenizer()
CFG = dict(vocab_size=128, hidden_size=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=8,
           top_k=2, moe_intermediate_size=64, max_seq_len=256, dtype="bfloat16")
PROMPTS = ["1+2=", "a longer prompt:", "x", "12*3="]
SPECS = {
    "bf16": None,
    "fp8": LinearSpec.of(weight="fp8", act="fp8"),
    "w4a16": LinearSpec.of(weight="nvfp4"),
    "w4a4": LinearSpec.of(weight="nvfp4", act="nvfp4"),
    "w4a4+rac50": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5),
    # the mismatch amplifier: the captured step's padded fp32 GEMMs of quads.quant.amplify's operands
    "w4a4+rac50x4": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, error_scale=4.0),
}


def model_for(recipe, seed=0):
    torch.manual_seed(seed)
    model = MoEForCausalLM(ModelConfig(**CFG)).cuda()
    if SPECS[recipe] is not None:
        quantize_model(model, Recipe("t", rollout=SPECS[recipe]), side="rollout", verbose=False)
    return model


def stopping_params(model, temperature):
    """Rows that stop at different steps: a stop id taken from a first run."""
    base = RolloutEngine(model, TOK, cuda_graphs=False).generate(
        PROMPTS, SamplingParams(n=4, temperature=temperature, max_new_tokens=24, ignore_eos=True, seed=1))
    return SamplingParams(n=4, temperature=temperature, max_new_tokens=24, seed=1,
                          stop_token_ids=(base.response_ids[2][5],))


def graph_runs_match_no_graph(model, params, **engine_kw):
    """Three generations of an engine with CUDA graphs (the second captures the prefill graph, the third replays
    it) = one without, bit for bit, and rescoring replays the last: -> (the engine, the three batches)."""
    off = RolloutEngine(model, TOK, cuda_graphs=False, **engine_kw).generate(PROMPTS, params)
    eng = RolloutEngine(model, TOK, cuda_graphs=True, done_check_interval=4, **engine_kw)
    runs = [eng.generate(PROMPTS, params) for _ in range(3)]
    for b in runs:
        assert b.response_ids == off.response_ids and torch.equal(b.logprobs, off.logprobs)
        assert torch.equal(b.routing, off.routing)
    res = score_rollout(model, runs[-1])
    assert torch.equal(res.logprobs, runs[-1].logprobs) and torch.equal(res.routing, runs[-1].routing)
    return eng, runs


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("recipe", list(SPECS))
def test_graph_matches_no_graph(recipe, temperature, compile):
    """Also with the compiled step and prefill (the engine's default on CUDA): its graph = its no-graph run, and
    rescoring replays the compiled step and prefill (their rounding, not the plain ones')."""
    model = model_for(recipe)
    params = stopping_params(model, temperature)
    off = RolloutEngine(model, TOK, cuda_graphs=False, compile=compile, compile_prefill=compile).generate(PROMPTS, params)
    eng = RolloutEngine(model, TOK, cuda_graphs=True, done_check_interval=4, compile=compile, compile_prefill=compile)
    on = eng.generate(PROMPTS, params)
    again = eng.generate(PROMPTS, params)  # the prompt block's second sight: its prefill graph is captured
    third = eng.generate(PROMPTS, params)  # and replayed
    assert [d.n_prefill_captures for d in eng._decoders.values()] == [1]
    c = "+compile+compiled-prefill" if compile else ""
    a = "+triton-attention" if eng.decode_attention == "triton" else ""  # "auto": Triton attention on CUDA
    assert on.stats.decode_path == f"static{c}+graph{a}+fused-qkv/device"  # the fused q/k/v projection: the default
    assert off.stats.decode_path == f"static{c}{a}+fused-qkv/device"
    assert on.compiled == off.compiled == on.compiled_prefill == off.compiled_prefill == compile
    assert on.stats.graph_captures == 1 and again.stats.graph_captures == 0
    assert len({len(r) for r in on.response_ids}) > 1
    for b in (on, again, third):
        assert b.response_ids == off.response_ids and b.finish_reasons == off.finish_reasons
        assert torch.equal(b.logprobs, off.logprobs) and torch.equal(b.routing, off.routing)
    res = score_rollout(model, third)  # rescoring on the engine's path (its prefill eager), graph replayed
    assert torch.equal(res.logprobs, third.logprobs) and torch.equal(res.routing, third.routing)


@pytest.mark.parametrize("recipe", list(SPECS))
def test_compiled_prefill_graph_matches_no_graph_and_rescores(recipe):
    """``compile_prefill`` (Inductor, the prompt width dynamic): its graph replay = its no-graph run, every prompt
    block width served by the same compiled graph (two widths here, one compile per padding case), and rescoring
    replays it bit for bit; the batch records it."""
    model = model_for(recipe)
    params = stopping_params(model, 1.0)
    eng, runs = graph_runs_match_no_graph(model, params, compile_prefill=True)
    assert all(b.compiled_prefill and "+compiled-prefill" in b.stats.decode_path for b in runs)
    other = eng.generate(PROMPTS[:2] + ["a much longer prompt than the others:"], params)  # another width
    res = score_rollout(model, other)
    assert torch.equal(res.logprobs, other.logprobs) and torch.equal(res.routing, other.routing)


@pytest.mark.parametrize("recipe", ["bf16", "w4a16", "w4a4+rac50"])
def test_fused_qkv_graph_matches_no_graph_and_rescores(recipe):
    """``fuse_qkv`` on the default path (compiled step and prefill, Triton attention reading the product's column
    slices): its graph replay = its no-graph run, rescoring bit for bit, and an in-place weight update reaches the
    stacked weights the captured graphs read."""
    model = model_for(recipe)
    params = stopping_params(model, 1.0)
    eng, runs = graph_runs_match_no_graph(model, params, fuse_qkv=True)
    assert all(b.fused_qkv and "+fused-qkv" in b.stats.decode_path for b in runs)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(0.5)
    after = eng.generate(PROMPTS, params)
    want = RolloutEngine(model, TOK, cuda_graphs=False, fuse_qkv=True).generate(PROMPTS, params)
    assert after.response_ids == want.response_ids and torch.equal(after.logprobs, want.logprobs)
    assert after.stats.graph_captures == 0  # the same graphs, the new weights


@pytest.mark.parametrize("recipe", ["bf16", "w4a4+rac50"])
def test_prefill_graph_matches_eager_prefill(recipe):
    """The prefill replayed from its graph = the eager prefill, with and without padding in the prompt block
    (no padding: plain causal attention; padding: the mask, which the graph takes without a host read), the
    routing recorded or not, the prefill shared by each prompt's rows or not; a new prompt width runs eagerly
    first; a replaced weight drops the graphs."""
    model = model_for(recipe)
    B = 8
    for prompts in (["1+2=", "3*4=", "9-8=", "7+7="], PROMPTS):  # equal widths, then left padding
        dec = StaticDecoder(model, B, 128, device_dispatch=True, cuda_graphs=True)
        ref = StaticDecoder(model, B, 128, device_dispatch=True, cuda_graphs=False)
        P = max(len(p) for p in prompts)
        ids = torch.zeros(B, P, dtype=torch.long, device="cuda")
        mask = torch.zeros(B, P, dtype=torch.bool, device="cuda")
        for i in range(B):
            t = TOK.encode(prompts[i % len(prompts)])
            ids[i, P - len(t):], mask[i, P - len(t):] = torch.tensor(t), True
        shared = device_groups(prompt_groups([TOK.encode(prompts[i % len(prompts)]) for i in range(B)]), "cuda")
        assert shared[0].numel() == len(prompts)
        for routing, groups in ((True, None), (False, None), (True, shared), (False, shared)):
            ref.begin()
            want = ref.prefill(ids, mask, return_routing=routing, groups=groups)
            want_k = [k[:, :, :P].clone() for k in ref.cache.k]
            base = dec.n_prefill_captures
            for sight in range(3):  # eager, captured (and replayed), replayed
                dec.begin()
                logits, rt = dec.prefill(ids, mask, return_routing=routing, groups=groups)
                assert dec.n_prefill_captures == base + (sight >= 1)
                assert torch.equal(logits, want[0]) and (rt is None) == (not routing)
                if routing:
                    assert torch.equal(rt, want[1])
                assert dec.cache.length == P and int(dec.cache.pos) == P
                assert all(torch.equal(k[:, :, :P], w) for k, w in zip(dec.cache.k, want_k))
        assert dec.n_prefill_captures == 4  # one graph per (width, padding, routing, shared rows) seen twice
    with torch.no_grad():  # a replaced tensor: the next generation captures again
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
    dec.begin()
    assert not dec._prefills


def test_large_prompt_block_prefills_eagerly(monkeypatch):
    """A prompt block above ``PREFILL_GRAPH_TOKENS`` is never captured, however often it is seen."""
    from quads.rollout import decode

    model = model_for("bf16")
    dec = StaticDecoder(model, 2, 128, device_dispatch=True, cuda_graphs=True)
    ids = torch.randint(1, 100, (2, 8), device="cuda")
    mask = torch.ones(2, 8, dtype=torch.bool, device="cuda")
    monkeypatch.setattr(decode, "PREFILL_GRAPH_TOKENS", 15)
    for _ in range(3):
        dec.begin()
        dec.prefill(ids, mask, return_routing=False)
    assert dec.n_prefill_captures == 0
    monkeypatch.setattr(decode, "PREFILL_GRAPH_TOKENS", 16)
    for _ in range(2):
        dec.begin()
        dec.prefill(ids, mask, return_routing=False)
    assert dec.n_prefill_captures == 1


@pytest.mark.parametrize("recipe", ["bf16", "w4a16", "w4a4+rac50"])
def test_static_tokens_match_eager_reference_greedy(recipe):
    model = model_for(recipe)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=16, ignore_eos=True)
    ref = RolloutEngine(model, TOK, decode="eager").generate(PROMPTS, params)
    got = RolloutEngine(model, TOK, compile_prefill=False, share_prefill=False).generate(PROMPTS, params)  # its bits
    same = sum(a == b for a, b in zip(ref.response_ids, got.response_ids))
    # BF16 GEMMs of different batch shapes round differently, so long greedy runs may part; most must not
    assert [r[0] for r in got.response_ids] == [r[0] for r in ref.response_ids]  # same prefill
    assert torch.equal(got.logprobs[:, 0], ref.logprobs[:, 0])
    assert same >= len(ref.response_ids) // 2, same


@pytest.mark.parametrize("recipe", ["bf16", "w4a16", "w4a4+rac50", "w4a4+rac50x4"])  # w4a16: packed weights
def test_weight_sync_reaches_captured_graph(recipe):
    model = model_for(recipe)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12, ignore_eos=True)
    eng = RolloutEngine(model, TOK, cuda_graphs=True)
    first = eng.generate(PROMPTS, params)
    assert first.stats.graph_captures == 1
    trainer = MoEForCausalLM(ModelConfig(**CFG)).cuda()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if recipe == "bf16":  # nothing to re-quantize (sync_weights refuses an unquantized rollout model)
        with torch.no_grad():
            for dst, src in zip(model.parameters(), trainer.parameters(), strict=True):
                dst.copy_(src)
    else:
        sync_weights(trainer, model)
    after = eng.generate(PROMPTS, params)
    assert after.stats.graph_captures == 0  # no re-capture: the graph reads the synced storages
    fresh = RolloutEngine(model, TOK, cuda_graphs=False).generate(PROMPTS, params)
    assert after.response_ids == fresh.response_ids and torch.equal(after.logprobs, fresh.logprobs)
    assert not torch.equal(after.logprobs, first.logprobs)


@pytest.mark.parametrize("recipe", ["bf16", "fp8", "w4a16", "w4a4+rac50", "w4a4+rac50x4"])
def test_decode_step_has_no_host_sync(recipe):
    model = model_for(recipe).eval()
    B, P = 8, 4
    dec = StaticDecoder(model, B, 128, device_dispatch=True, cuda_graphs=False)
    cache = dec.begin()
    ids = torch.randint(4, 100, (B, P), device="cuda")
    mask = torch.ones(B, P, dtype=torch.bool, device="cuda")
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        cache.start_decode(mask)
        rows = torch.ones(B, dtype=torch.bool, device="cuda")
        rows[3] = False
        dec.step(ids[:, -1], rows)  # first call: lazy initialisations (Triton compiles, cuBLAS handles)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            dec.step(ids[:, -1], rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")



@pytest.mark.parametrize("recipe", ["bf16", "w4a16"])
def test_triton_decode_attention_graph_compiled_and_rescored(recipe):
    """decode_attention="triton" on the engine's default path (compiled step in a CUDA graph): the graph =
    no graph, the step stays one Dynamo graph, rescoring replays it bit for bit (its agreement with SDPA:
    tests/test_engine_static.py on the interpreter, tests/test_decode_attention.py at the 1b sizes)."""
    from quads.rollout.decode import StaticKVCache

    model = model_for(recipe)
    params = stopping_params(model, 1.0)
    off = RolloutEngine(model, TOK, cuda_graphs=False, decode_attention="triton").generate(PROMPTS, params)
    on = RolloutEngine(model, TOK, decode_attention="triton").generate(PROMPTS, params)
    assert RolloutEngine(model, TOK).decode_attention == "triton"  # auto, the default, on CUDA
    assert on.stats.decode_path == "static+compile+compiled-prefill+graph+triton-attention+fused-qkv/device"
    assert on.response_ids == off.response_ids and on.finish_reasons == off.finish_reasons
    assert torch.equal(on.logprobs, off.logprobs) and torch.equal(on.routing, off.routing)
    res = score_rollout(model, on)
    assert torch.equal(res.logprobs, on.logprobs) and torch.equal(res.routing, on.routing)
    cache = StaticKVCache(model.config, 8, 64, dtype=model.dtype, device=model.device, attention="triton")
    cache.start_decode(torch.ones(8, 0, dtype=torch.bool, device="cuda"))
    torch._dynamo.reset()
    out = torch._dynamo.explain(model.decode_step)(torch.zeros(8, dtype=torch.long, device="cuda"), cache,
                                                   torch.ones(8, dtype=torch.bool, device="cuda"), device_dispatch=True)
    assert out.graph_break_count == 0 and out.graph_count == 1, [str(b.reason) for b in out.break_reasons]


@pytest.mark.parametrize("recipe", list(SPECS))
def test_compiled_decode_step_is_one_graph(recipe):
    """The compiled step (the engine's CUDA default) is one Dynamo graph for every recipe: a graph break
    in a quantized layer makes Dynamo skip the whole step and run it eagerly (issue 17, run 8)."""
    from quads.rollout.decode import StaticKVCache

    model = model_for(recipe)
    cache = StaticKVCache(model.config, 8, 64, dtype=model.dtype, device=model.device)
    tokens = torch.zeros(8, dtype=torch.long, device="cuda")
    rows = torch.ones(8, dtype=torch.bool, device="cuda")
    cache.start_decode(torch.ones(8, 0, dtype=torch.bool, device="cuda"))  # an empty prompt: decode from column 0
    torch._dynamo.reset()
    out = torch._dynamo.explain(model.decode_step)(tokens, cache, rows, device_dispatch=True)
    assert out.graph_break_count == 0, [str(b.reason) for b in out.break_reasons]
    assert out.graph_count == 1


@pytest.mark.parametrize("recipe", ["w4a4", "w4a4+rac50"])
def test_w4a4_layers_read_only_packed_weights(recipe):
    """W4A4(+RAC) on the experts and the attention projections: every layer holds the packed NVFP4 weight
    and no BF16 copy (before and after decoding), the compiled step is one graph, and its graph replay
    equals the same compiled step without a graph, bit for bit."""
    from quads.quant.layers import _QuantizedBase
    from quads.rollout.decode import StaticKVCache

    torch.manual_seed(0)
    model = MoEForCausalLM(ModelConfig(**CFG)).cuda()
    recipe_ = Recipe("t", rollout=SPECS[recipe], targets=("*.mlp.experts", "*.self_attn.*_proj"))
    quantize_model(model, recipe_, side="rollout", verbose=False)
    stores = [st for m in model.modules() if isinstance(m, _QuantizedBase) for st in m.stores.values()]

    def packed_only():
        return all(st.kernel is not None and st.w_q is None and st.w_q32 is None and st.packed is None
                   for st in stores)

    assert len(stores) == CFG["n_layers"] * 6 and packed_only()
    cache = StaticKVCache(model.config, 8, 64, dtype=model.dtype, device=model.device)
    cache.start_decode(torch.ones(8, 0, dtype=torch.bool, device="cuda"))
    torch._dynamo.reset()
    out = torch._dynamo.explain(model.decode_step)(torch.zeros(8, dtype=torch.long, device="cuda"), cache,
                                                   torch.ones(8, dtype=torch.bool, device="cuda"), device_dispatch=True)
    assert out.graph_break_count == 0 and out.graph_count == 1, [str(b.reason) for b in out.break_reasons]
    params = stopping_params(model, 1.0)
    off = RolloutEngine(model, TOK, cuda_graphs=False, compile=True).generate(PROMPTS, params)
    on = RolloutEngine(model, TOK, cuda_graphs=True, done_check_interval=4, compile=True).generate(PROMPTS, params)
    assert on.stats.decode_path == "static+compile+compiled-prefill+graph+triton-attention+fused-qkv/device"
    assert on.stats.graph_captures == 1
    assert on.response_ids == off.response_ids and on.finish_reasons == off.finish_reasons
    assert torch.equal(on.logprobs, off.logprobs) and torch.equal(on.routing, off.routing)
    assert packed_only()


def test_policy_engine_generates_from_a_trainer_side_model():
    """eval_trainer's engine: an fp32 trainer-side (W4A16-QAT) model under BF16 autocast, as the trainer
    scores it: the static path with host dispatch (its experts have no capturable path), no graphs."""
    torch.manual_seed(0)
    model = MoEForCausalLM(ModelConfig(**{**CFG, "dtype": "float32"})).cuda()
    quantize_model(model, Recipe("t", trainer=LinearSpec.of(weight="nvfp4")), side="trainer", verbose=False)
    eng = policy_engine(model, TOK, "cuda")
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12, ignore_eos=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = eng.generate(PROMPTS, params), eng.generate(PROMPTS, params)
    assert a.decode == "static" and a.moe_dispatch == "host" and a.stats.graph_captures == 0
    assert torch.isfinite(a.logprobs).all() and a.response_ids == b.response_ids
    assert model.training  # the engine restores the trainer's mode
