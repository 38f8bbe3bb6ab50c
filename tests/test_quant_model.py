"""quantize_model on real model classes: transformers 5 Qwen3-MoE / OLMoE / Mixtral and the built-in MoE.

Every recipe on both sides runs forward and backward; only the targeted modules are swapped and
everything before the first quantized layer computes exactly what the unquantized model does.
"""

import copy
import functools

import pytest
import torch
from torch import nn

from quads.model import ModelConfig, MoEForCausalLM, gemm
from quads.quant import (
    PRESETS,
    QuantizedExperts,
    QuantizedLinear,
    dequantize_model,
    get_recipe,
    quantize_model,
)

transformers = pytest.importorskip("transformers")

V = 128


def hf_qwen3(**kw):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, **kw,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg)


def hf_olmoe():
    cfg = transformers.OlmoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.OlmoeForCausalLM(cfg)


def hf_mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def builtin():
    cfg = ModelConfig(
        vocab_size=V, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    return MoEForCausalLM(cfg)


MODELS = {"qwen3_moe": hf_qwen3, "olmoe": hf_olmoe, "mixtral": hf_mixtral, "builtin": builtin}


@functools.cache
def _built(kind):
    torch.manual_seed(0)
    m = MODELS[kind]()
    with torch.no_grad():  # HF init of experts is tiny; make the weights matter
        for n, p in m.named_parameters():
            if "experts" in n:
                p.normal_(0, 0.1)
    return m


def _model(kind):
    return copy.deepcopy(_built(kind))  # building HF models is slow; copies are cheap


def _ids():
    return torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))


def _logits(m, ids):
    out = m(ids)
    return out.logits


# every recipe and side on Qwen3-MoE and the built-in model; OLMoE / Mixtral share the experts layout,
# so a few recipes suffice there
CASES = [(k, r, s) for k in ("qwen3_moe", "builtin") for r in PRESETS for s in ("trainer", "rollout")]
CASES += [
    (k, r, s)
    for k in ("olmoe", "mixtral")
    for r, s in (("quads", "trainer"), ("quads", "rollout"), ("fp8", "rollout"))
]


@pytest.mark.parametrize("kind, recipe, side", CASES, ids=lambda v: str(v))
def test_every_recipe_forward_backward(kind, recipe, side):
    m = _model(kind)
    ids = _ids()
    ref = _logits(m, ids).detach()
    before = {n: p for n, p in m.named_parameters()}
    s = quantize_model(m, recipe, side, verbose=False)
    assert [x.name for x in s.modules] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for i in range(2):
        layer = m.model.layers[i]
        assert isinstance(layer.mlp.experts, QuantizedExperts)
        assert layer.mlp.experts.gate_up_proj is before[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        plain = (nn.Linear, gemm.Linear)  # transformers' layers, quads' own
        assert type(layer.self_attn.q_proj) in plain and type(layer.self_attn.o_proj) in plain
        assert not isinstance(layer.mlp.gate, QuantizedLinear | QuantizedExperts)
    assert type(m.lm_head) in (nn.Linear, gemm.Linear) and type(m.model.embed_tokens) is nn.Embedding
    assert {n: p for n, p in m.named_parameters()} == before  # same names, same Parameter objects
    logits = _logits(m, ids)
    assert torch.isfinite(logits).all()
    quantized = get_recipe(recipe).spec(side).is_identity is False
    diff = (logits - ref).abs().max().item()
    if quantized:
        assert 0 < diff < 0.5, f"{recipe}/{side}: max logit change {diff}"
    else:
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    logits.square().mean().backward()
    for n, p in m.named_parameters():
        if "experts" in n or "lm_head" in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("kind", ["qwen3_moe", "builtin"])
def test_layers_before_first_quantized_module_are_bit_identical(kind):
    m = _model(kind)
    ids = _ids()
    got = []
    m.model.layers[0].self_attn.register_forward_hook(
        lambda mod, a, o: got.append(o[0] if isinstance(o, tuple) else o)
    )
    router_out = []
    m.model.layers[0].mlp.gate.register_forward_hook(
        lambda mod, a, o: router_out.append(o[0] if isinstance(o, tuple) else o)
    )
    _logits(m, ids)
    quantize_model(m, "quads", "rollout", verbose=False)
    _logits(m, ids)
    assert torch.equal(got[0], got[1]) and torch.equal(router_out[0], router_out[1])


def test_builtin_shared_expert_only_when_targeted():
    m = _model("builtin")
    s = quantize_model(
        m, get_recipe("quads", targets=["*.mlp.experts", "*.shared_expert"]), "trainer", verbose=False
    )
    names = [x.name for x in s.modules]
    assert "model.layers.0.mlp.shared_expert.gate_proj" in names
    assert isinstance(m.model.layers[0].mlp.shared_expert.down_proj, QuantizedLinear)
    assert type(m.model.layers[0].mlp.gate) is gemm.Linear


def test_wildcard_keeps_router_embeddings_lm_head():
    m = _model("builtin")
    s = quantize_model(m, get_recipe("w4a16-qat", targets=["*"]), "trainer", verbose=False)
    assert isinstance(m.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert isinstance(m.model.layers[1].mlp.experts, QuantizedExperts)
    assert type(m.model.layers[0].mlp.gate) is gemm.Linear and type(m.lm_head) is gemm.Linear
    assert "lm_head" in s.protected
    _logits(m, _ids()).sum().backward()


class _ExpertMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = (
            nn.Linear(32, 16, bias=False),
            nn.Linear(16, 32, bias=False),
            nn.Linear(32, 16, bias=False),
        )

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _OldMoE(nn.Module):  # per-expert nn.Linear modules (older Mixtral layout)
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 3, bias=False)
        self.experts = nn.ModuleList(_ExpertMLP() for _ in range(3))

    def forward(self, x):
        p = self.gate(x).softmax(-1)
        return sum(p[:, e : e + 1] * ex(x) for e, ex in enumerate(self.experts))


class _OldModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = _OldMoE()

    def forward(self, x):
        return self.layers[0].mlp(x)


def test_per_expert_linear_layout():
    torch.manual_seed(0)
    m = _OldModel()
    x = torch.randn(5, 32)
    ref = m(x)
    s = quantize_model(m, "w4a4-qat", "trainer", verbose=False)
    assert len(s.modules) == 9 and all(mi.kind == "linear" for mi in s.modules)
    assert (
        isinstance(m.layers[0].mlp.experts[2].w2, QuantizedLinear) and type(m.layers[0].mlp.gate) is nn.Linear
    )
    y = m(x)
    assert 0 < (y - ref).abs().max() < 0.2
    y.sum().backward()
    assert m.layers[0].mlp.experts[0].w1.weight.grad is not None


def test_requantize_and_dequantize_restore():
    m = _model("qwen3_moe")
    ids = _ids()
    ref = _logits(m, ids).detach()
    params = dict(m.named_parameters())
    quantize_model(m, "quads", "rollout", verbose=False)
    s = quantize_model(m, "w4a16-qat", "trainer", verbose=False)  # re-applies cleanly
    assert s.side == "trainer" and m.model.layers[0].mlp.experts.side == "trainer"
    assert not isinstance(m.model.layers[0].mlp.experts.original, QuantizedExperts)
    assert dequantize_model(m) == 2
    assert type(m.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert dict(m.named_parameters()) == params
    assert torch.equal(_logits(m, ids), ref)
    assert not hasattr(m, "quads_recipe")


def test_trainer_cache_quantizes_once_per_step():
    m = _model("builtin")
    quantize_model(m, "w4a16-qat", "trainer", verbose=False)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    store = m.model.layers[0].mlp.experts.stores["gate_up_proj"]
    ids = _ids()
    for step in range(3):
        _logits(m, ids).square().mean().backward()
        _logits(m, ids)  # a second forward in the same step
        assert store.n_quantize == step + 1
        opt.step()
        opt.zero_grad()
    w_q = store.get()  # after the step the cache follows the new weights
    assert store.n_quantize == 4
    ref = copy.deepcopy(store.param.detach())
    from quads.quant.ops import quantize_weight

    assert torch.equal(w_q, quantize_weight(ref, store.spec, store.dtype)[0])


def test_trainer_cache_refreshes_changed_weights_at_once(monkeypatch):
    """After an optimizer step, the first quantized layer's ``get`` refreshes every changed weight of the
    model in one ``ops.qat_weights`` call (expert stacks and 2-D linears of every layer; Triton groups
    them by shape), each with the bits of its own ``quantize_weight`` and no codes kept; a weight the step
    left alone keeps its cache; ``refresh_stale`` (before a compiled forward) does the same at once."""
    from quads.quant import ops
    from quads.quant.layers import refresh_stale

    m = _model("builtin")
    quantize_model(m, get_recipe("w4a16-qat", targets=["*.mlp.experts", "*.self_attn.*_proj"]), "trainer",
                   verbose=False)
    calls = []
    real = ops.qat_weights
    monkeypatch.setattr(ops, "qat_weights", lambda ws, *a: calls.append(len(ws)) or real(ws, *a))
    stores = {f"{n}.{k}": s for n, mod in m.named_modules() if isinstance(mod, (QuantizedExperts, QuantizedLinear))
              for k, s in mod.stores.items()}
    assert len(stores) == 12  # 2 layers x (gate_up, down, q, k, v, o)
    frozen = m.model.layers[1].mlp.experts.down_proj
    opt = torch.optim.SGD([p for p in m.parameters() if p is not frozen], lr=1e-2)
    ids = _ids()
    for step in range(2):
        _logits(m, ids).square().mean().backward()
        assert calls == ([12] if step == 0 else [11]), calls  # then all but the frozen one
        assert all(s.n_quantize == step + 1 for n, s in stores.items() if "layers.1.mlp.experts.down" not in n)
        assert stores["model.layers.1.mlp.experts.down_proj"].n_quantize == 1
        for name, s in stores.items():
            assert s.packed is None and torch.equal(s.w_q, ops.quantize_weight(s.param, s.spec, s.dtype)[0]), name
        opt.step()
        opt.zero_grad()
        calls.clear()
    refresh_stale(m)
    assert calls == [11] and all(not s.stale() for s in stores.values())
    refresh_stale(m)
    assert calls == [11]  # nothing stale: no call


def test_rollout_store_is_fixed_between_syncs():
    m = _model("builtin")
    quantize_model(m, "quads", "rollout", verbose=False)
    e = m.model.layers[0].mlp.experts
    store = e.stores["down_proj"]
    assert store.n_quantize == 1 and store.packed is not None and store.w_q.dtype == torch.bfloat16
    ids = _ids()
    with torch.no_grad():
        y1 = _logits(m, ids)
        e.down_proj.mul_(2.0)  # a change without a sync is not seen
        y2 = _logits(m, ids)
    assert torch.equal(y1, y2) and store.n_quantize == 1
    e.refresh()
    assert store.n_quantize == 2


def test_bad_inputs():
    m = _model("qwen3_moe")
    with pytest.raises(ValueError, match="no module matched"):
        quantize_model(m, get_recipe("quads", targets=["*.nothing"]), verbose=False)
    with pytest.raises(ValueError, match="unknown recipe"):
        quantize_model(m, "int4", verbose=False)
    with pytest.raises(ValueError, match="valid: trainer, rollout"):
        quantize_model(m, "quads", "serving", verbose=False)
    bad = hf_qwen3()
    bad.model.layers[0].mlp.experts.down_proj = nn.Parameter(torch.randn(4, 64, 24))  # K = I = 24
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_model(bad, "quads", "rollout", verbose=False)
    assert type(bad.model.layers[1].mlp.experts).__name__ == "Qwen3MoeExperts"  # nothing swapped on error
