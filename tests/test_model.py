"""The built-in MoE model: config validation, parameter counts, KV cache, padding, routing replay,
checkpoints. Exactness checks run in float64 on CPU."""

import pytest
import torch

from quads.model import KVCache, ModelConfig, MoEExperts, MoEForCausalLM
from quads.model.checkpoint import load_checkpoint, save_checkpoint
from quads.model.config import PRESETS
from quads.model.tokenizer import CharTokenizer, load_tokenizer

SMALL = dict(vocab_size=128, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
             top_k=2, moe_intermediate_size=32, max_seq_len=64)


def make(dtype="float64", seed=0, **over):
    torch.manual_seed(seed)
    return MoEForCausalLM(ModelConfig(**{**SMALL, "dtype": dtype, **over}))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_param_counts(name):
    counts = ModelConfig.preset(name).num_params()
    print(f"preset {name}: {counts['total'] / 1e6:.1f}M params, {counts['active'] / 1e6:.1f}M active")
    expected = {"tiny": (0.5e6, 3e6), "small": (15e6, 25e6), "100m": (80e6, 130e6), "500m": (400e6, 600e6),
                "1b": (0.8e9, 1.3e9)}[name]
    assert expected[0] < counts["total"] < expected[1], counts


@pytest.mark.parametrize("over", [{}, {"qk_norm": "full"}, {"qk_norm": "none"}, {"tie_word_embeddings": True},
                                  {"shared_expert_intermediate_size": 48, "shared_expert_gate": True}],
                         ids=lambda o: ",".join(o) or "default")
def test_analytic_count_matches_model(over):
    model = make("float32", **over)
    assert model.num_parameters() == model.config.num_params()["total"]


@pytest.mark.parametrize("bad,msg", [({"hidden_size": 72}, "multiple of 16"), ({"n_kv_heads": 3}, "divisible"),
                                     ({"top_k": 5}, "top_k"), ({"qk_norm": "x"}, "qk_norm"),
                                     ({"moe_intermediate_size": 40}, "multiple of 16"),
                                     ({"dtype": "int8"}, "dtype")])
def test_config_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(**{**SMALL, **bad})
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("huge")


def test_forward_shapes_and_dtypes():
    for dtype, tdt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = make(dtype)
        out = model(torch.randint(0, 128, (3, 7)), return_routing=True)
        assert out.logits.shape == (3, 7, 128) and out.logits.dtype == tdt
        assert out.routing.shape == (2, 3, 7, 2) and out.routing.dtype == torch.long
        assert out.routing.min() >= 0 and out.routing.max() < 4
        assert (out.routing[..., 0] != out.routing[..., 1]).all()


def test_experts_match_transformers_qwen3moe():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    hf = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6)).double()
    torch.nn.init.normal_(hf.gate_up_proj)
    torch.nn.init.normal_(hf.down_proj)
    ours = MoEExperts(6, 32, 16).double()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(11, 32, dtype=torch.float64)
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(11)])
    w = torch.rand(11, 2, dtype=torch.float64)
    torch.testing.assert_close(ours(x, idx, w), hf(x, idx, w), atol=1e-12, rtol=0)


def test_kv_cache_decode_matches_full_forward():
    model = make()
    ids = torch.randint(0, 128, (2, 9))
    full = model(ids, return_routing=True)
    cache = KVCache(model.config, 2, 16)
    pre = model(ids[:, :5], cache=cache, return_routing=True)
    steps = [pre]
    for t in range(5, 9):
        steps.append(model(ids[:, t:t + 1], cache=cache, return_routing=True))
    logits = torch.cat([o.logits for o in steps], 1)
    routing = torch.cat([o.routing for o in steps], 2)
    torch.testing.assert_close(logits, full.logits, atol=1e-10, rtol=0)
    assert torch.equal(routing, full.routing)
    assert cache.length == 9


def test_left_padding_does_not_change_results():
    model = make()
    ids = torch.randint(4, 128, (1, 6))
    ref = model(ids).logits
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.tensor([[0, 0, 0] + [1] * 6])
    out = model(padded, attention_mask=mask).logits[:, 3:]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    # a different pad token value must not matter either
    out2 = model(padded.masked_fill(mask == 0, 77), attention_mask=mask).logits[:, 3:]
    torch.testing.assert_close(out2, out, atol=1e-12, rtol=0)


def test_routing_replay():
    model = make()
    ids = torch.randint(0, 128, (2, 8))
    out = model(ids, return_routing=True)
    replay = model(ids, routing=out.routing, return_routing=True)
    assert torch.equal(replay.routing, out.routing)
    torch.testing.assert_close(replay.logits, out.logits, atol=0, rtol=0)
    forced = (out.routing + 1) % 4  # other experts (still distinct within a token)
    other = model(ids, routing=forced, return_routing=True)
    assert torch.equal(other.routing, forced)
    assert (other.logits - out.logits).abs().max() > 1e-6
    partial = forced.clone()
    partial[:, :, :4] = -1  # rows of -1 fall back to the router's own choice
    mixed = model(ids, routing=partial, return_routing=True)
    assert torch.equal(mixed.routing[:, :, :4], out.routing[:, :, :4])
    assert torch.equal(mixed.routing[:, :, 4:], forced[:, :, 4:])
    other.logits.sum().backward()  # the router still gets gradients from the forced experts' weights
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_aux_loss_and_all_parameters_get_gradients():
    model = make("float32", router_aux_loss_coef=0.01, shared_expert_intermediate_size=32, shared_expert_gate=True)
    out = model(torch.randint(0, 128, (4, 16)))
    assert out.aux_loss.item() >= 0.01 * 0.99  # the balance loss is >= 1 (equality when uniform)
    (out.logits.float().logsumexp(-1).mean() + out.aux_loss).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not no_grad, no_grad
    assert make("float32")(torch.randint(0, 128, (1, 4))).aux_loss.item() == 0.0


def test_checkpoint_roundtrip_bit_identical(tmp_path):
    model = make("bfloat16", tie_word_embeddings=True)
    tok = CharTokenizer()
    save_checkpoint(model, tmp_path / "ckpt", {"step": 7}, tokenizer=tok)
    save_checkpoint(model, tmp_path / "ckpt", {"step": 8}, tokenizer=tok)  # overwrite in place
    loaded, extra = load_checkpoint(tmp_path / "ckpt")
    assert extra == {"step": 8}
    assert loaded.config == model.config
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tok2 = load_tokenizer(tmp_path / "ckpt")
    assert tok2.encode("a+b=3\n") == tok.encode("a+b=3\n") and tok2.vocab_size == tok.vocab_size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_checkpoint_mismatch_names_fields(tmp_path):
    save_checkpoint(make("float32"), tmp_path / "c")
    with pytest.raises(ValueError, match=r"n_experts: checkpoint 4, model 8.*top_k"):
        load_checkpoint(tmp_path / "c", make("float32", n_experts=8, top_k=3))
    (tmp_path / "c" / "config.json").write_text('{"architecture": "qwen3_moe", "format_version": 1}')
    with pytest.raises(ValueError, match="architecture"):
        load_checkpoint(tmp_path / "c")


def test_char_tokenizer():
    tok = CharTokenizer()
    text = "What is 12+7?\nAnswer: 19"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert min(ids) >= 4 and max(ids) < tok.vocab_size <= ModelConfig.preset("tiny").vocab_size
    assert tok.encode("é") == [tok.unk_id] and tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4


@pytest.mark.parametrize("alphabet", [None, "ab\n", "".join(chr(c) for c in range(32, 300))])
def test_char_tokenizer_ascii_fast_path_is_the_per_character_map(alphabet):
    """``encode`` of ASCII text (byte by byte, ``bytes.translate``) gives the per-character map's ids, <unk>
    for what is not in the alphabet; non-ASCII text and alphabets past 252 characters take the map itself."""
    tok = CharTokenizer(alphabet)
    ascii_text = "".join(chr(c) for c in range(128)) * 2
    for text in (ascii_text, ascii_text + "é€", "", "Q: 3+4=\n"):
        assert tok.encode(text) == [tok._to_id.get(c, tok.unk_id) for c in text]


def test_compiled_top_experts_is_topk_without_the_aten_fallback():
    """``moe.top_experts`` under torch.compile (k rounds of max, fused by Inductor) = ``torch.topk`` (values,
    ids, order) on tie-free probabilities, and the compiled graph holds no ``aten.topk``."""
    from torch._inductor.utils import run_and_get_code

    from quads.model.moe import route, top_experts

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 16, generator=g)
    probs = torch.softmax(logits, dim=-1)
    torch._dynamo.reset()
    (v, i), code = run_and_get_code(torch.compile(top_experts, dynamic=False), probs, 4)
    want_v, want_i = torch.topk(probs, 4, dim=-1)
    assert torch.equal(i, want_i) and torch.equal(v, want_v)
    assert "aten.topk" not in "".join(code)
    _, ci, cw = torch.compile(route, dynamic=False)(logits, 4, True)  # the router as the model calls it
    _, ei, ew = route(logits, 4, True)
    assert torch.equal(ci, ei) and torch.allclose(cw, ew, rtol=0, atol=1e-6)
    torch._dynamo.reset()
