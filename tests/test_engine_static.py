"""The engine's static decode path (fixed slots, device-side cache state, capturable expert dispatch)
against the eager reference on a tiny model: same tokens, routing and finish reasons, log-probs to
the forwards' rounding, with rows finishing at different steps; greedy and sampled; quantized too.
The CUDA-graph side of the same path is tests/test_engine_gpu.py."""

import pytest
import torch

from quads.model import ModelConfig, MoEForCausalLM
from quads.model.attention import StaticKVCache
from quads.model.moe import static_routes
from quads.model.tokenizer import CharTokenizer
from quads.quant import quantize_model
from quads.quant.layers import QuantizedExperts
from quads.quant.recipe import LinearSpec, Recipe
from quads.quant.sync import sync_weights
from quads.rollout import RolloutEngine, SamplingParams, sample_tokens
from quads.rollout.decode import weights_key
from quads.rollout.score import score_rollout
from quads.rollout.types import prompt_block, prompt_groups

TOK = CharTokenizer()
SMALL = dict(vocab_size=128, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
             top_k=2, moe_intermediate_size=32, max_seq_len=64)
PROMPTS = ["1+2=", "a longer prompt:", "x"]
SPECS = {"bf16": None, "w4a16": LinearSpec.of(weight="nvfp4"), "w4a4+rac50": LinearSpec.of(weight="nvfp4", act="nvfp4",
                                                                                    rac_ratio=0.5)}


def tiny(spec=None, dtype="float64", seed=0):
    torch.manual_seed(seed)
    model = MoEForCausalLM(ModelConfig(**{**SMALL, "dtype": dtype}))
    if spec is not None:
        quantize_model(model, Recipe("t", rollout=spec), side="rollout", verbose=False)
    return model


def finishing_params(model, temperature):
    """Sampling params under which rows stop at different steps: a stop id taken from a first run."""
    base = RolloutEngine(model, TOK, decode="eager").generate(
        PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=14, ignore_eos=True, seed=5))
    stop_id = base.response_ids[1][4]
    return SamplingParams(n=2, temperature=temperature, max_new_tokens=14, seed=5, stop_token_ids=(stop_id,))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("recipe", list(SPECS))
def test_static_matches_eager(recipe, temperature):
    model = tiny(SPECS[recipe])
    params = finishing_params(model, temperature)
    ref = RolloutEngine(model, TOK, decode="eager").generate(PROMPTS, params)
    lengths = [len(r) for r in ref.response_ids]
    assert len(set(lengths)) > 1 and set(ref.finish_reasons) == {"stop", "length"}, lengths
    for dispatch in ("host", "device"):
        got = RolloutEngine(model, TOK, decode="static", moe_dispatch=dispatch, done_check_interval=3
                            ).generate(PROMPTS, params)
        assert got.response_ids == ref.response_ids and got.finish_reasons == ref.finish_reasons
        assert torch.equal(got.input_ids, ref.input_ids) and torch.equal(got.attention_mask, ref.attention_mask)
        assert torch.equal(got.routing, ref.routing)
        # fp64 forwards that differ only in summation order (cache length, GEMM batch); the device
        # dispatch of a quantized spec runs its GEMM in fp32 (quads.quant.grouped), hence the wider bound
        tol = 1e-7 if dispatch == "device" and recipe != "bf16" else 1e-12
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=tol, rtol=0)
        assert got.decode == "static" and got.moe_dispatch == dispatch and ref.decode == "eager"
        assert got.stats.decode_path == f"static+fused-qkv/{dispatch}"  # fuse_qkv: the default


@pytest.mark.parametrize("dispatch", ["host", "device"])
def test_score_reproduces_static_batch_bit_for_bit(dispatch):
    model = tiny(SPECS["w4a4+rac50"], dtype="float32")
    params = finishing_params(model, 1.0)
    batch = RolloutEngine(model, TOK, decode="static", moe_dispatch=dispatch).generate(PROMPTS, params)
    res = score_rollout(model, batch)
    assert torch.equal(res.logprobs, batch.logprobs) and torch.equal(res.routing, batch.routing)


def test_prompt_groups():
    assert prompt_groups([[1, 2], [1, 2], [3], [3]]) == ([0, 2], [0, 0, 1, 1])
    assert prompt_groups([[3], [1, 2], [3]]) == ([0, 1], [0, 1, 0])  # the same prompt given twice, apart
    assert prompt_groups([[1], [2]]) is None and prompt_groups([[1, 2], [2, 1]]) is None


@pytest.mark.parametrize("recipe", list(SPECS))
def test_shared_prefill_matches_the_full_prefill_and_rescores(recipe):
    """``share_prefill`` (the default): each prompt's n samples prefilled once (3 rows for 6 samples, prompts of
    three widths: padding), its cache rows copied to the group: the tokens, routing and finish reasons of the
    full prefill, log-probs to fp64 rounding (batches of 3 and 6 rows sum in other orders); rescoring replays the
    shared prefill bit for bit."""
    model = tiny(SPECS[recipe])
    params = finishing_params(model, 1.0)
    for dispatch in ("host", "device"):
        full = RolloutEngine(model, TOK, decode="static", moe_dispatch=dispatch, share_prefill=False
                             ).generate(PROMPTS, params)
        shared = RolloutEngine(model, TOK, decode="static", moe_dispatch=dispatch).generate(PROMPTS, params)
        assert (full.stats.prefill_rows, shared.stats.prefill_rows) == (6, 3)
        assert shared.shared_prefill and not full.shared_prefill
        assert shared.response_ids == full.response_ids and shared.finish_reasons == full.finish_reasons
        assert len({len(r) for r in shared.response_ids}) > 1
        assert torch.equal(shared.routing, full.routing) and torch.equal(shared.input_ids, full.input_ids)
        tol = 1e-7 if dispatch == "device" and recipe != "bf16" else 1e-12
        torch.testing.assert_close(shared.logprobs, full.logprobs, atol=tol, rtol=0)
        res = score_rollout(model, shared)
        assert torch.equal(res.logprobs, shared.logprobs) and torch.equal(res.routing, shared.routing)
    eager = RolloutEngine(model, TOK, decode="eager").generate(PROMPTS, params)
    assert not eager.shared_prefill and eager.stats.prefill_rows == 6  # the reference path prefills every row


@pytest.mark.parametrize("recipe", list(SPECS))
def test_fused_qkv_matches_the_three_products_and_rescores(recipe):
    """``fuse_qkv``: one product by the stacked q/k/v weights, split into column slices, in the prefill and every
    decode step: the tokens, routing and finish reasons of the three products, log-probs to fp64 rounding; the
    batch and its decode path record it and rescoring replays it bit for bit."""
    model = tiny(SPECS[recipe])
    params = finishing_params(model, 1.0)
    for dispatch in ("host", "device"):
        three = RolloutEngine(model, TOK, decode="static", moe_dispatch=dispatch, fuse_qkv=False).generate(PROMPTS, params)
        one = RolloutEngine(model, TOK, decode="static", moe_dispatch=dispatch, fuse_qkv=True).generate(PROMPTS, params)
        assert one.fused_qkv and not three.fused_qkv
        assert one.stats.decode_path == f"static+fused-qkv/{dispatch}" and three.stats.decode_path == f"static/{dispatch}"
        assert one.response_ids == three.response_ids and one.finish_reasons == three.finish_reasons
        assert len({len(r) for r in one.response_ids}) > 1
        assert torch.equal(one.routing, three.routing)
        torch.testing.assert_close(one.logprobs, three.logprobs, atol=1e-12, rtol=0)
        res = score_rollout(model, one)
        assert torch.equal(res.logprobs, one.logprobs) and torch.equal(res.routing, one.routing)


def test_fused_qkv_reads_updated_weights_and_skips_quantized_projections():
    """The stacked weights are copied from the parameters at each generation's start (an in-place update, as
    weight sync makes, is seen without a new decoder); a layer whose q projection is quantized keeps its three
    products."""
    from quads.rollout.decode import FusedQKV

    model = tiny()
    params = finishing_params(model, 0.0)
    eng = RolloutEngine(model, TOK, decode="static", fuse_qkv=True)
    eng.generate(PROMPTS, params)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)
    after = eng.generate(PROMPTS, params)
    want = RolloutEngine(model, TOK, decode="static", fuse_qkv=False).generate(PROMPTS, params)
    assert after.response_ids == want.response_ids
    torch.testing.assert_close(after.logprobs, want.logprobs, atol=1e-12, rtol=0)
    (dec,) = eng._decoders.values()
    a = model.model.layers[0].self_attn
    assert torch.equal(dec.fused_qkv.weights[0], torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    last = model.model.layers[-1].self_attn  # a Parameter assigned in place of another: its values are copied too
    last.v_proj.weight = torch.nn.Parameter(last.v_proj.weight.detach() * -2.0)
    eng.generate(PROMPTS, params)
    assert dec.fused_qkv.weights[-1] is dec.cache.qkv[-1]
    assert torch.equal(dec.fused_qkv.weights[-1], torch.cat([last.q_proj.weight, last.k_proj.weight, last.v_proj.weight]))

    q = tiny()
    eng = RolloutEngine(q, TOK, decode="static", fuse_qkv=True)
    eng.generate(PROMPTS, params)
    before = FusedQKV.of(q)
    assert FusedQKV.of(q) is before and all(w is not None for w in before.weights)  # one copy per model
    quantize_model(q, Recipe("t", rollout=LinearSpec.of(weight="nvfp4"), targets=("model.layers.0.self_attn.q_proj",)),
                   side="rollout", verbose=False)
    fused = FusedQKV.of(q)  # the layout changed: made again
    assert fused is not before and fused.weights[0] is None and fused.weights[1] is not None
    got = eng.generate(PROMPTS, params)  # the same decoder takes the new one
    (dec,) = eng._decoders.values()
    assert dec.fused_qkv is fused and dec.cache.qkv is fused.weights
    ref = RolloutEngine(q, TOK, decode="static", fuse_qkv=False).generate(PROMPTS, params)
    assert got.response_ids == ref.response_ids
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-12, rtol=0)


def test_shared_prefill_writes_the_full_prefills_cache():
    """``StaticDecoder.prefill(groups=...)``: the distinct prompts' forward into the cache's leading rows, then
    every row copies its prompt's keys and values (columns 0..P-1; the rest stays empty), logits and expert ids:
    the full prefill's to fp64 rounding, the key mask and positions exactly."""
    from quads.rollout.decode import StaticDecoder, device_groups

    model = tiny().eval()
    samples = [[5, 6, 7], [9], [5, 6, 7], [9], [5, 6, 7], [11, 12]]
    groups = prompt_groups(samples)
    assert groups == ([0, 1, 5], [0, 1, 0, 1, 0, 2])
    ids, mask = prompt_block(samples, 3, TOK.pad_id)
    outs = []
    for g in (None, device_groups(groups, torch.device("cpu"))):
        dec = StaticDecoder(model, 6, 16, device_dispatch=True, cuda_graphs=False)
        dec.begin()
        with torch.no_grad():
            logits, routing = dec.prefill(ids, mask, return_routing=True, groups=g)
        c = dec.cache
        outs.append((logits, routing, c.k[1], c.v[0], c.key_mask, c.row_pos, c.length))
    (l0, r0, k0, v0, m0, p0, n0), (l1, r1, k1, v1, m1, p1, n1) = outs
    assert torch.equal(r0, r1) and torch.equal(m0, m1) and torch.equal(p0, p1) and n0 == n1 == 3
    for a, b in ((l0, l1), (k0, k1), (v0, v1)):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
    assert torch.equal(k1[2], k1[0]) and torch.equal(k1[4], k1[0]) and not k1[:, :, 3:].any()


def test_triton_decode_attention_matches_sdpa_and_rescores_bit_for_bit(monkeypatch):
    """decode_attention="triton" (reads only the written cache columns; Triton's interpreter here), with its
    prologue in one kernel (q/k norm, RoPE, cache write: ``decode_qkv``), samples what SDPA over the whole
    masked cache samples, to fp32 summation order, and rescoring replays it."""
    from quads.kernels import decode_qkv

    calls = []
    kernel = decode_qkv.decode_qkv
    monkeypatch.setattr(decode_qkv, "decode_qkv", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    model = tiny(SPECS["w4a16"], dtype="float32")
    params = finishing_params(model, 1.0)
    ref = RolloutEngine(model, TOK, decode="static", moe_dispatch="device").generate(PROMPTS, params)
    assert not calls  # SDPA: the prologue's operations one by one
    eng = RolloutEngine(model, TOK, decode="static", moe_dispatch="device", decode_attention="triton", fuse_qkv=False)
    got = eng.generate(PROMPTS, params)
    assert len(calls) == model.config.n_layers * got.stats.decode_steps > 0  # every layer of every step
    assert (got.decode_attention, ref.decode_attention) == ("triton", "sdpa")
    assert got.stats.decode_path == "static+triton-attention/device"
    assert got.response_ids == ref.response_ids and got.finish_reasons == ref.finish_reasons
    assert torch.equal(got.routing, ref.routing)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert not torch.equal(got.logprobs, ref.logprobs)  # another kernel ran, not SDPA again
    res = score_rollout(model, got)
    assert torch.equal(res.logprobs, got.logprobs) and torch.equal(res.routing, got.routing)
    calls.clear()  # the fused q/k/v product's column slices go into the same kernel (its row strides)
    fused = RolloutEngine(model, TOK, decode="static", moe_dispatch="device", decode_attention="triton",
                          fuse_qkv=True).generate(PROMPTS, params)
    assert len(calls) == model.config.n_layers * fused.stats.decode_steps
    assert fused.stats.decode_path == "static+triton-attention+fused-qkv/device"
    assert fused.response_ids == got.response_ids and torch.equal(fused.routing, got.routing)
    torch.testing.assert_close(fused.logprobs, got.logprobs, atol=1e-5, rtol=0)
    res = score_rollout(model, fused)
    assert torch.equal(res.logprobs, fused.logprobs)
    with pytest.raises(ValueError, match="decode_attention must be auto or one of"):
        RolloutEngine(model, TOK, decode_attention="flash")
    assert RolloutEngine(model, TOK).decode_attention == "sdpa"  # auto: Triton attention on CUDA only
    with pytest.raises(ValueError, match="decode attention must be one of"):
        StaticKVCache(model.config, 2, 8, attention="flash")
    with pytest.raises(ValueError, match="float64"):
        RolloutEngine(tiny(), TOK, decode_attention="triton")  # fp64 activations: SDPA only


def test_done_check_interval_and_chunks_do_not_change_results():
    model = tiny()
    params = finishing_params(model, 0.0)
    a = RolloutEngine(model, TOK, decode="static", done_check_interval=1).generate(PROMPTS, params)
    b = RolloutEngine(model, TOK, decode="static", done_check_interval=50).generate(PROMPTS, params)
    c = RolloutEngine(model, TOK, decode="static", max_batch_tokens=60).generate(PROMPTS, params)
    assert a.response_ids == b.response_ids == c.response_ids and a.finish_reasons == c.finish_reasons
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.routing, b.routing)
    torch.testing.assert_close(c.logprobs, a.logprobs, atol=1e-12, rtol=0)
    assert b.stats.decode_steps >= a.stats.decode_steps


def test_joined_batches_sum_their_stats():
    """Chunks joined by the engine and per-prompt batches joined by ``concat_rollouts`` (the distributed
    equivalence path) keep every count: the prefill's rows, steps, tokens, captures; the first's decode path."""
    from quads.rl.distributed import concat_rollouts

    model = tiny()
    params = SamplingParams(n=2, max_new_tokens=5, seed=0, ignore_eos=True)
    whole = RolloutEngine(model, TOK, decode="static").generate(PROMPTS, params)
    chunked = RolloutEngine(model, TOK, decode="static", max_batch_tokens=60).generate(PROMPTS, params)
    parts = [RolloutEngine(model, TOK, decode="static").generate([p], params) for p in PROMPTS]
    joined = concat_rollouts(parts, TOK.pad_id)
    assert whole.stats.prefill_rows == joined.stats.prefill_rows == chunked.stats.prefill_rows == 3
    assert joined.stats.decode_steps == sum(p.stats.decode_steps for p in parts) == 3 * whole.stats.decode_steps
    assert joined.stats.n_response_tokens == whole.stats.n_response_tokens == chunked.stats.n_response_tokens == 30
    assert joined.stats.n_prompt_tokens == whole.stats.n_prompt_tokens
    assert joined.stats.decode_path == chunked.stats.decode_path == whole.stats.decode_path
    assert joined.stats.prefill_s == pytest.approx(sum(p.stats.prefill_s for p in parts))


def test_stop_strings_on_static_path():
    model = tiny()
    base = RolloutEngine(model, TOK, decode="eager").generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    stop = base.texts[1][1:3]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, stop=(stop,))
    ref = RolloutEngine(model, TOK, decode="eager").generate(PROMPTS, params)
    got = RolloutEngine(model, TOK, decode="static", moe_dispatch="device").generate(PROMPTS, params)
    assert got.finish_reasons[1] == "stop" and got.texts[1].endswith(stop)
    assert got.response_ids == ref.response_ids and got.finish_reasons == ref.finish_reasons


def test_sampling_is_multinomials_algorithm():
    logits = torch.randn(6, 40, dtype=torch.float64)
    p = SamplingParams(temperature=0.8)
    tok, _ = sample_tokens(logits, p, torch.Generator().manual_seed(4))
    ref = torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=torch.Generator().manual_seed(4))
    assert torch.equal(tok, ref.squeeze(1))


def test_masked_slots_and_static_expert_paths():
    """Slots with the masked id E contribute nothing, on every expert path; the capturable paths agree
    with the loops (unquantized: to rounding; quantized: same operands, fp32 GEMM order)."""
    torch.manual_seed(1)
    T, E = 7, SMALL["n_experts"]
    x = torch.randn(T, SMALL["hidden_size"])
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    w = torch.rand(T, 2)
    idx[2] = E  # token 2 routed nowhere
    idx[5, 1] = E  # token 5 keeps one expert
    for recipe in ("bf16", "w4a4+rac50"):
        experts = tiny(SPECS[recipe], dtype="float32").model.layers[0].mlp.experts
        ref, got = experts(x, idx, w), experts.forward_static(x, idx, w)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert (ref[2] == 0).all() and (got[2] == 0).all()
    r = static_routes(idx, E)
    assert r.offsets[-1].item() == T * 2 - 3 and r.valid.sum().item() == T * 2 - 3
    big = torch.randint(0, 33, (128, 4))  # the counting sort is the stable sort, exactly
    rb = static_routes(big, 32)
    assert torch.equal(rb.order, torch.argsort(big.reshape(-1), stable=True))
    assert torch.equal(rb.expert, big.reshape(-1)[rb.order])
    assert torch.equal(rb.slot_pos[rb.order], torch.arange(128 * 4))  # the inverse permutation


def test_sorted_rows_back_to_expert_order_by_gather_equal_the_scatter():
    """The capturable expert paths bring each token's sorted rows back by a gather (``slot_pos``, the inverse of
    the sort; ``_expert_slots``, the inverse of ``_expert_rank``): the same rows in the same order as the
    scatter to ``order - order % k + rank`` they replace, so the same sums bit for bit."""
    from quads.kernels.expert_routes import expert_rank as _expert_rank
    from quads.kernels.expert_routes import expert_slots as _expert_slots
    from quads.quant.layers import _sum_parts

    torch.manual_seed(5)
    T, k, E = 96, 8, 16
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[::5, 3:] = E  # masked slots: equal ids, sorted last
    routes = static_routes(ids, E)
    contrib = torch.randn(T * k, 24).bfloat16()  # one row per sorted position
    dest = routes.order - routes.order % k + _expert_rank(ids).reshape(-1)[routes.order]
    scattered = _sum_parts(torch.empty_like(contrib).index_copy_(0, dest, contrib).view(T, k, -1))
    src = routes.slot_pos.view(T, k).gather(1, _expert_slots(ids))
    gathered = _sum_parts(contrib[src.reshape(-1)].view(T, k, -1))
    assert torch.equal(routes.token_slots, src)
    assert torch.equal(gathered.view(torch.int16), scattered.view(torch.int16))
    y = torch.empty_like(contrib).index_copy_(0, routes.order, contrib)  # moe.MoEExperts.forward_static's
    assert torch.equal(contrib.index_select(0, routes.slot_pos), y)


def test_static_cache_keeps_rows_and_refresh_keeps_storage():
    model = tiny(SPECS["w4a16"], dtype="float32")
    cache = StaticKVCache(model.config, 2, 16)
    with pytest.raises(RuntimeError, match="masked, not dropped"):
        cache.select(torch.tensor([0]))
    # weight sync writes into the tensors a captured graph reads: same storages, new values
    trainer = tiny(seed=3, dtype="float32")
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    store = experts.stores["gate_up_proj"]
    old = store.w_q.clone()
    w32 = store.get_f32()  # the fp32 operand copy of the emulated GEMMs: refreshed in place as well
    before = weights_key(model)
    sync_weights(trainer, model)
    assert weights_key(model) == before and store.get_f32() is w32
    assert not torch.equal(store.w_q, old) and torch.equal(w32, store.w_q.float())


def test_decode_plan_and_errors():
    model = tiny()
    assert RolloutEngine(model, TOK).decode_plan() == ("eager", "host", False)  # CPU default: unchanged path
    assert RolloutEngine(model, TOK, decode="static").decode_plan() == ("static", "host", False)
    assert RolloutEngine(model, TOK, decode="static", moe_dispatch="device").decode_plan() == (
        "static", "device", False)
    with pytest.raises(ValueError, match="decode must be"):
        RolloutEngine(model, TOK, decode="fast")
    with pytest.raises(ValueError, match="done_check_interval"):
        RolloutEngine(model, TOK, done_check_interval=0)


def _packed_w4a4_model(kernels: str, spec: LinearSpec):
    """A BF16 one-layer model with the W4A4+RAC rollout spec on the experts and the attention projections,
    quantized under the kernel backend ``kernels``."""
    from quads.kernels import dispatch

    torch.manual_seed(0)
    model = MoEForCausalLM(ModelConfig(**{**SMALL, "n_layers": 1, "dtype": "bfloat16"}))
    recipe = Recipe("t", rollout=spec, targets=("*.mlp.experts", "*.self_attn.*_proj"))
    with dispatch.kernels(kernels):
        quantize_model(model, recipe, side="rollout", verbose=False)
    return model


def _short_triton_backend(monkeypatch) -> None:
    """Skip without Triton (or with kernels imported before its interpreter was switched on); else quantize weights
    on the reference backend (the weight quantizer's Triton twin is checked in test_kernels.py; the same bits),
    which keeps the interpreter's runs short."""
    pytest.importorskip("triton")
    from quads.kernels import dispatch
    from quads.kernels._common import interpreter_on
    from quads.quant import ops

    if not torch.cuda.is_available() and not interpreter_on():
        pytest.skip("the kernels were imported before TRITON_INTERPRET=1 was set")
    quantize = ops.nvfp4_quantize

    def reference_quantize(x, **opts):
        with dispatch.kernels("reference"):
            return quantize(x, **opts)

    monkeypatch.setattr(ops, "nvfp4_quantize", reference_quantize)


def test_w4a4_rollout_reads_packed_weights_on_the_triton_backend(monkeypatch):
    """W4A4+RAC on the Triton backend (the interpreter here): experts and dense projections keep only the
    packed NVFP4 weight, and the static decode matches the reference backend's (BF16 tensor operand,
    fp32 GEMM): same tokens; log-probs within the BF16 rounding of the GEMM outputs (the kernel writes
    BF16, the CPU's tensor path fp32: one BF16 ulp per layer output, tests/test_quant_factored.py). Static
    RAC selection: its calibration priors read the dense QDQ(W), decoded from the packed bytes."""
    from quads.kernels import dispatch
    from quads.quant.layers import QuantizedLinear

    _short_triton_backend(monkeypatch)
    spec = LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, rac_selection="static")
    packed, ref = _packed_w4a4_model("triton", spec), _packed_w4a4_model("reference", spec)
    layers = [m for m in packed.modules() if isinstance(m, QuantizedExperts | QuantizedLinear)]
    assert len(layers) == 5
    for m in layers:
        for st in m.stores.values():
            assert st.kernel is not None and st.w_q is None and st.w_q32 is None and st.packed is None
    ref_store = next(m for m in ref.modules() if isinstance(m, QuantizedExperts)).stores["down_proj"]
    assert ref_store.kernel is None and ref_store.w_q is not None
    # what needs the dense QDQ(W) gets it, decoded from the packed bytes: the reference store's bits
    st = next(m for m in packed.modules() if isinstance(m, QuantizedExperts)).stores["down_proj"]
    assert torch.equal(st.get().view(torch.int16), ref_store.get().view(torch.int16))
    n_sel = 0
    for a, b in zip(packed.modules(), ref.modules()):  # static RAC priors: the same weight column norms
        for name in getattr(a, "selectors", {}):
            assert torch.equal(a.selectors[name].order, b.selectors[name].order)
            n_sel += 1
    assert n_sel == 6
    params = SamplingParams(n=2, temperature=0, max_new_tokens=2, ignore_eos=True)  # prefill + a decode step
    with dispatch.kernels("triton"):
        got = RolloutEngine(packed, TOK, decode="static", moe_dispatch="device").generate(PROMPTS[:2], params)
    with dispatch.kernels("reference"):
        want = RolloutEngine(ref, TOK, decode="static", moe_dispatch="device").generate(PROMPTS[:2], params)
    assert got.response_ids == want.response_ids and torch.equal(got.routing, want.routing)
    diff = (got.logprobs - want.logprobs).abs().max().item()
    assert 0 < diff < 0.05, diff  # differs (the BF16 GEMM outputs), by the forwards' rounding only


@pytest.mark.parametrize("decode", ["static", "eager"])
def test_fp32_model_under_autocast_caches_in_the_autocast_dtype(decode):
    """eval_trainer's case: an fp32 trainer-side model generating under BF16 autocast. The KV cache holds
    what the forward computes (BF16 keys and values), on both paths, and the two paths agree."""
    model = tiny(dtype="float32")
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = RolloutEngine(model, TOK, decode=decode).generate(PROMPTS, params)
        ref = RolloutEngine(model, TOK, decode="eager").generate(PROMPTS, params)
    assert got.response_ids == ref.response_ids and torch.isfinite(got.logprobs).all()
    from quads.model.attention import activation_dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert activation_dtype(model) == torch.bfloat16
    assert activation_dtype(model) == torch.float32


def test_compiled_step_runs_under_the_raised_recompile_limit(monkeypatch):
    """Every (model, batch, cache length) is a compile of the same code object: the compiled step is called under
    ``COMPILED_SHAPES`` as Dynamo's recompile limit (its default 8 would run the 9th shape eagerly, silently), the
    caller's limit restored after; one compiled function per model."""
    from quads.rollout import decode

    seen = []

    def fake_compile(fn, **kw):
        assert kw == {"dynamic": False, "fullgraph": False}
        return lambda *a, **k: seen.append(torch._dynamo.config.recompile_limit) or fn(*a, **k)

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = tiny()
    before = torch._dynamo.config.recompile_limit
    step = decode._compiled_step(model)
    assert decode._compiled_step(model) is step
    cache = StaticKVCache(model.config, 2, 16)
    cache.start_decode(torch.ones(2, 0, dtype=torch.bool))
    logits, routing = step(torch.tensor([5, 6]), cache, torch.tensor([True, False]))
    assert seen == [decode.COMPILED_SHAPES] and decode.COMPILED_SHAPES > before
    assert torch._dynamo.config.recompile_limit == before and logits.shape == (2, SMALL["vocab_size"])


def test_expert_rank_is_the_stable_argsorts_inverse():
    """The quantized experts sum each token's outputs in ascending expert id (the loop's order) through
    ``_expert_rank`` (k x k compares, no sort kernel): the inverse permutation of a stable argsort, ties (masked
    slots, id E) by slot index; the sum equals the argsort-and-gather one bit for bit."""
    from quads.kernels.expert_routes import expert_rank as _expert_rank
    from quads.kernels.expert_routes import expert_slots as _expert_slots
    from quads.quant.layers import _sum_in_expert_order

    torch.manual_seed(4)
    ids = torch.randint(0, 9, (300, 8))
    ids[::7, 2:5] = 9  # several masked slots of one token: equal ids
    order = torch.argsort(ids, dim=-1, stable=True)
    assert torch.equal(_expert_rank(ids), torch.argsort(order, dim=-1))
    assert torch.equal(_expert_slots(ids), order)  # the gather form's slot of each rank
    per_slot = torch.randn(300, 8, 16).bfloat16()
    parts = per_slot.gather(1, order[..., None].expand(300, 8, 16))
    want = torch.zeros_like(parts[:, 0])
    for j in range(8):
        want = want + parts[:, j]
    assert torch.equal(_sum_in_expert_order(per_slot, ids).view(torch.int16), want.view(torch.int16))


@pytest.fixture
def counted_prefill_compile(monkeypatch):
    """The compiled prefill on Dynamo with a counting backend that runs the captured ATen ops as they are (the
    plain prefill's ops in the same order: equal bits), from a fresh cache of compiled functions."""
    from torch._dynamo.testing import CompileCounter

    from quads.rollout import decode

    counter = CompileCounter()
    monkeypatch.setattr(decode, "PREFILL_COMPILE_BACKEND", counter)
    monkeypatch.setattr(decode, "_COMPILED_PREFILL", {})
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", ["bf16", "w4a16"])
def test_compiled_prefill_is_one_graph_for_every_prompt_width(counted_prefill_compile, recipe):
    """``compile_prefill``: Dynamo traces the prefill (device dispatch) with the prompt width dynamic, so one graph
    per padding case serves widths 4, 7 and 12; logits, expert ids and the cache it writes equal the plain
    prefill's bit for bit; the expert ids are computed in the graph either way and returned when asked for."""
    from quads.rollout.decode import StaticDecoder

    model = tiny(SPECS[recipe], dtype="bfloat16").eval()
    g = torch.Generator().manual_seed(1)
    for P, padded in ((4, False), (7, False), (12, False), (9, True), (5, True)):
        ids = torch.randint(0, SMALL["vocab_size"], (3, P), generator=g)
        mask = torch.ones(3, P, dtype=torch.bool)
        mask[0, :2] = not padded
        outs = []
        for compiled in (False, True):
            dec = StaticDecoder(model, 3, 32, device_dispatch=True, cuda_graphs=False, compile_prefill=compiled)
            dec.begin()
            with torch.no_grad():
                logits, routing = dec.prefill(ids, mask, return_routing=True)
                assert dec.prefill(ids, mask, return_routing=False)[1] is None
            outs.append((logits, routing, dec.cache.k[1].clone(), dec.cache.length, dec.cache.row_pos.clone()))
        for a, b in zip(*outs):
            assert (a == b) if isinstance(a, int) else torch.equal(a, b), (P, padded)
    assert counted_prefill_compile.frame_count == 2  # one graph without padding, one with


@pytest.mark.parametrize("recipe", ["bf16", "w4a16"])
def test_compiled_prefill_reads_synced_weights_without_recompiling(counted_prefill_compile, recipe):
    """The compiled prefill reads the model's weight tensors as graph inputs, not constants: after a weight sync
    into the same storages (``sync_weights``; BF16: an in-place copy) the same graph gives the plain prefill's
    result on the new weights, with no recompile."""
    from quads.rollout.decode import StaticDecoder

    model = tiny(SPECS[recipe], dtype="bfloat16").eval()
    ids = torch.randint(0, SMALL["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 6, dtype=torch.bool)

    def prefill(compiled):
        dec = StaticDecoder(model, 3, 32, device_dispatch=True, cuda_graphs=False, compile_prefill=compiled)
        dec.begin()
        with torch.no_grad():
            return dec.prefill(ids, mask, return_routing=True)

    before = prefill(True)
    trainer = tiny(seed=3, dtype="bfloat16")
    if recipe == "bf16":
        with torch.no_grad():
            for dst, src in zip(model.parameters(), trainer.parameters(), strict=True):
                dst.copy_(src)
    else:
        sync_weights(trainer, model)
    after, plain = prefill(True), prefill(False)
    assert all(torch.equal(a, b) for a, b in zip(after, plain))
    assert not torch.equal(after[0], before[0])
    assert counted_prefill_compile.frame_count == 1


def test_score_replays_the_compiled_prefill(counted_prefill_compile):
    """A batch recorded with ``compiled_prefill`` is rescored through the compiled prefill (here the counting
    backend, whose bits are the plain prefill's, so the log-probs and routing still equal the batch's); on the CPU
    the engine never compiles, so its batches say ``compiled_prefill=False``."""
    model = tiny(SPECS["w4a16"], dtype="bfloat16")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5, ignore_eos=True, record_routing=True)
    batch = RolloutEngine(model, TOK, decode="static", moe_dispatch="device", compile_prefill=True
                          ).generate(PROMPTS, params)
    assert not batch.compiled_prefill and "compiled-prefill" not in batch.stats.decode_path
    assert counted_prefill_compile.frame_count == 0
    batch.compiled_prefill = True
    res = score_rollout(model, batch)
    assert counted_prefill_compile.frame_count == 1
    assert torch.equal(res.logprobs, batch.logprobs) and torch.equal(res.routing, batch.routing)


def test_compiled_prefill_shares_the_prefill_in_one_graph(counted_prefill_compile):
    """The compiled prefill with ``groups`` (the shared prefill): the distinct prompts' forward is one graph for
    widths 5 and 8, its outputs and the spread cache bit for bit the plain shared prefill's."""
    from quads.rollout.decode import StaticDecoder

    model = tiny(SPECS["w4a16"], dtype="bfloat16").eval()
    g = torch.Generator().manual_seed(4)
    groups = (torch.tensor([0, 2]), torch.tensor([0, 0, 1, 1]))
    for P in (5, 8):
        ids = torch.randint(0, SMALL["vocab_size"], (2, P), generator=g).repeat_interleave(2, 0)
        mask = torch.ones(4, P, dtype=torch.bool)
        outs = []
        for compiled in (False, True):
            dec = StaticDecoder(model, 4, 32, device_dispatch=True, cuda_graphs=False, compile_prefill=compiled)
            dec.begin()
            with torch.no_grad():
                logits, routing = dec.prefill(ids, mask, return_routing=True, groups=groups)
            outs.append((logits, routing, dec.cache.k[1].clone(), dec.cache.v[0].clone()))
        assert all(torch.equal(a, b) for a, b in zip(*outs)), P
    assert counted_prefill_compile.frame_count == 1


def test_compiled_prefill_traces_the_packed_w4a4_rac_path(counted_prefill_compile, monkeypatch):
    """The compiled prefill through the packed W4A4 + RAC 50% rollout path on the Triton backend (its custom ops;
    Triton's interpreter here): one graph for widths 4 and 7 (the custom ops' shapes follow a dynamic width),
    logits and expert ids bit for bit the plain prefill's."""
    from quads.kernels import dispatch
    from quads.rollout.decode import StaticDecoder

    _short_triton_backend(monkeypatch)
    model = _packed_w4a4_model("triton", LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5)).eval()
    g = torch.Generator().manual_seed(1)
    with dispatch.kernels("triton"), torch.no_grad():
        for P in (4, 7):
            ids = torch.randint(0, SMALL["vocab_size"], (3, P), generator=g)
            mask = torch.ones(3, P, dtype=torch.bool)
            outs = []
            for compiled in (False, True):
                dec = StaticDecoder(model, 3, 32, device_dispatch=True, cuda_graphs=False, compile_prefill=compiled)
                dec.begin()
                outs.append(dec.prefill(ids, mask, return_routing=True))
            assert all(torch.equal(a, b) for a, b in zip(*outs)), P
    assert counted_prefill_compile.frame_count == 1
