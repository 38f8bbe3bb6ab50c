"""Hugging Face adapter: tiny random Qwen3-MoE / OLMoE / Mixtral models built with transformers, saved
locally, loaded into the built-in model; logits must match transformers'. No hub access."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from quads.model import ModelConfig, MoEForCausalLM
from quads.model.hf import load_hf_model, save_hf_model
from quads.model.tokenizer import CharTokenizer, HFTokenizer
from quads.rollout import RolloutEngine, SamplingParams

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=1e-6)
ARCHS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, moe_intermediate_size=32,
                                                     intermediate_size=64, norm_topk_prob=True),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, num_experts=4, intermediate_size=32, norm_topk_prob=False),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, intermediate_size=32),
}


def hf_model(arch, seed=0):
    torch.manual_seed(seed)
    cfg = ARCHS[arch]()
    model = getattr(transformers, {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                                   "mixtral": "MixtralForCausalLM"}[arch])(cfg)
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel on CPU
    with torch.no_grad():  # non-trivial norm weights so a misplaced norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def word_level_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i + 4 for i in range(60)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                              "pad_token": "<pad>"}))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_transformers(arch, tmp_path):
    ref = hf_model(arch)
    ref.save_pretrained(tmp_path, max_shard_size="50KB")  # sharded: exercises the index file
    assert (tmp_path / "model.safetensors.index.json").is_file()
    word_level_tokenizer(tmp_path)
    ids = torch.randint(0, 96, (2, 11))
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 2e-5)):
        model, tok = load_hf_model(tmp_path, dtype=dtype)
        assert model.config.architecture == arch and model.dtype == dtype
        with torch.no_grad():
            want = ref.to(dtype)(ids).logits
            got = model(ids).logits
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
    assert isinstance(tok, HFTokenizer) and (tok.eos_id, tok.bos_id, tok.pad_id) == (2, 1, 0)
    assert tok.decode(tok.encode("w3 w7 w1")) == "w3 w7 w1"


def test_fused_expert_layout_loads(tmp_path):
    ref = hf_model("qwen3_moe", seed=1)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}  # in memory: fused gate_up_proj
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    ref.config.save_pretrained(tmp_path)
    model, tok = load_hf_model(tmp_path, dtype=torch.float32)
    assert tok is None
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch,over", [("qwen3_moe", {}), ("olmoe", {"qk_norm": "full", "norm_topk_prob": False}),
                                       ("mixtral", {"qk_norm": "none", "tie_word_embeddings": True})])
def test_export_loads_in_transformers(arch, over, tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      n_experts=4, top_k=2, moe_intermediate_size=32, max_seq_len=64, **over)
    ours = MoEForCausalLM(cfg).eval()
    tok = CharTokenizer()
    save_hf_model(ours, tok, tmp_path / "out", architecture=arch)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                             experts_implementation="eager").eval()
    assert type(ref).__name__.lower().startswith(arch.split("_")[0][:5])
    ids = torch.tensor([tok.encode("12+34=46")])
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, ours(ids).logits, atol=2e-5, rtol=0)
    back, back_tok = load_hf_model(tmp_path / "out", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))
    assert back_tok.encode("a+b=\n") == tok.encode("a+b=\n") and back_tok.decode(tok.encode("x y")) == "x y"
    assert back_tok.eos_id == tok.eos_id
    out = RolloutEngine(back, back_tok).generate(["1+1="], SamplingParams(max_new_tokens=4, temperature=0))
    assert len(out.response_ids[0]) >= 1


def test_unsupported_configs_raise(tmp_path):
    cfg = ARCHS["qwen3_moe"]()
    cfg.mlp_only_layers = [0]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        load_hf_model(tmp_path)
    ours = MoEForCausalLM(ModelConfig(vocab_size=128, hidden_size=64, n_layers=1, n_heads=4, n_kv_heads=2,
                                      head_dim=16, n_experts=4, top_k=2, moe_intermediate_size=32))
    with pytest.raises(ValueError, match="qk_norm"):
        save_hf_model(ours, None, tmp_path / "x", architecture="olmoe")
