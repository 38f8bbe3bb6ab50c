"""Hugging Face adapter: local Qwen3-MoE / OLMoE / Mixtral folders <-> the built-in ``MoEForCausalLM``.

Reads ``config.json`` and ``*.safetensors`` (single file or sharded with ``model.safetensors.index.json``)
with ``safetensors`` directly; no hub access. Expert weights come in two layouts and both load:
- per expert (what ``save_pretrained`` of transformers 5.24 writes and what released checkpoints
  hold): ``{moe}.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE, OLMoE) or
  ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (Mixtral: w1 = gate, w3 = up, w2 = down);
- fused (transformers 5 in memory): ``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
  [E, H, I], which is our own layout.

The three architectures differ only in config: q/k RMSNorm per head (Qwen3) / over the full projection
(OLMoE) / none (Mixtral); top-k weight renormalisation from ``norm_topk_prob`` (Mixtral: always).
Unsupported features (attention biases, sliding windows, rope scaling, dense layers, qkv clipping)
raise ValueError rather than load into a model that would compute something else.

``save_hf_model`` writes the per-expert layout plus a transformers config, so the folder loads with
``AutoModelForCausalLM.from_pretrained`` (and in serving engines that read released checkpoints).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quads.io import atomic_dir
from quads.model.checkpoint import check_weights_file, weights_files
from quads.model.config import ModelConfig
from quads.model.tokenizer import TOKENIZER_FILE, CharTokenizer, HFTokenizer
from quads.model.transformer import MoEForCausalLM

ARCHITECTURES = ("qwen3_moe", "olmoe", "mixtral")
_QK_NORM = {"qwen3_moe": "head", "olmoe": "full", "mixtral": "none"}
_HF_CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}


def config_from_hf(hf: dict[str, Any], dtype: str) -> ModelConfig:
    """A ``ModelConfig`` from a transformers ``config.json`` dict (ValueError if not representable)."""
    arch = hf.get("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(f"model_type {arch!r} is not supported; expected one of {list(ARCHITECTURES)}")
    unsupported = {
        "attention_bias": bool(hf.get("attention_bias", False)),
        "sliding_window": bool(hf.get("use_sliding_window", arch == "mixtral")) and hf.get("sliding_window"),
        "mlp_only_layers": bool(hf.get("mlp_only_layers")),
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1) != 1,
        "clip_qkv": hf.get("clip_qkv") is not None,
    }
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported["rope_scaling"] = rope_type != "default"
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{arch} config uses features the built-in model does not implement: {bad}")
    H, nh = hf["hidden_size"], hf["num_attention_heads"]
    n_experts = hf.get("num_experts") or hf.get("num_local_experts")
    inter = hf.get("moe_intermediate_size") if arch == "qwen3_moe" else hf["intermediate_size"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=H, n_layers=hf["num_hidden_layers"], n_heads=nh,
        n_kv_heads=hf.get("num_key_value_heads") or nh, head_dim=hf.get("head_dim") or H // nh,
        n_experts=n_experts, top_k=hf["num_experts_per_tok"], moe_intermediate_size=inter,
        norm_topk_prob=True if arch == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        qk_norm=_QK_NORM[arch], rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), max_seq_len=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), router_aux_loss_coef=0.0,
        dtype=dtype, architecture=arch)


def folder_dtype(hf: dict[str, Any]) -> str:
    """The dtype name a transformers ``config.json`` stores its weights in (default bfloat16)."""
    return _DTYPE_NAMES.get(str(hf.get("dtype", hf.get("torch_dtype", "bfloat16"))), "bfloat16")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in weights_files(folder):
        check_weights_file(path)
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PER_EXPERT = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def map_hf_state(src: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensor names/layouts -> ``MoEForCausalLM`` state dict (experts stacked into the fused layout)."""
    out: dict[str, torch.Tensor] = {}
    per: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for key, t in src.items():
        m = _EXPERT.match(key)
        if m:
            layer, e, kind = int(m[1]), int(m[2]), _PER_EXPERT.get(m[3])
            if kind is None:
                raise ValueError(f"unexpected expert tensor {key!r}")
            per.setdefault((layer, kind), {})[e] = t
            continue
        out[key.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer in range(cfg.n_layers):
        if not per.get((layer, "gate")):
            continue
        stack = {k: [per[(layer, k)][e] for e in range(cfg.n_experts)] for k in ("gate", "up", "down")}
        pre = f"model.layers.{layer}.mlp.experts."
        out[pre + "gate_up_proj"] = torch.cat([torch.stack(stack["gate"]), torch.stack(stack["up"])], dim=1)
        out[pre + "down_proj"] = torch.stack(stack["down"])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def load_hf_model(folder: str | Path, dtype: str | torch.dtype | None = None, *,
                  device: torch.device | str | None = None
                  ) -> tuple[MoEForCausalLM, HFTokenizer | None]:
    """(model, tokenizer) from a local HF folder; tokenizer is None when the folder has no tokenizer.json.

    ``dtype``: parameter/compute dtype ("bfloat16", torch.float32, ...); default: the folder's dtype.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} has no config.json; expected a local Hugging Face model folder")
    hf = json.loads((folder / "config.json").read_text())
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    dtype = dtype or folder_dtype(hf)
    cfg = config_from_hf(hf, dtype)
    state = map_hf_state(_read_tensors(folder), cfg)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    want = model.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{str(folder)!r}: weights do not match a {cfg.architecture} model: missing "
                         f"{missing[:6]}, unexpected {unexpected[:6]}")
    for k, t in state.items():
        if tuple(t.shape) != tuple(want[k].shape):
            raise ValueError(f"{str(folder)!r}: {k} has shape {list(t.shape)}, config implies {list(want[k].shape)}")
    state = {k: v.to(device=device or "cpu", dtype=cfg.torch_dtype) for k, v in state.items()}
    model.load_state_dict(state, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    tokenizer = HFTokenizer(folder) if (folder / TOKENIZER_FILE).is_file() else None
    return model, tokenizer


def _hf_config(cfg: ModelConfig, arch: str, tokenizer: Any | None) -> Any:
    import transformers

    if cfg.qk_norm != _QK_NORM[arch]:
        raise ValueError(f"{arch} needs qk_norm={_QK_NORM[arch]!r}, the model has {cfg.qk_norm!r}; pick the "
                         f"architecture whose q/k norm matches: {_QK_NORM}")
    if cfg.shared_expert_intermediate_size:
        raise ValueError(f"{arch} has no shared expert; this model has one (export is not supported)")
    if arch == "mixtral" and not cfg.norm_topk_prob:
        raise ValueError("mixtral always renormalises the top-k weights; the model has norm_topk_prob=False")
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  num_experts_per_tok=cfg.top_k, rms_norm_eps=cfg.rms_norm_eps,
                  max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_word_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  architectures=[_HF_CLASS[arch]])
    if tokenizer is not None:
        common.update(eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.pad_id)
    if arch == "qwen3_moe":
        c = transformers.Qwen3MoeConfig(**common, head_dim=cfg.head_dim, num_experts=cfg.n_experts,
                                        moe_intermediate_size=cfg.moe_intermediate_size,
                                        norm_topk_prob=cfg.norm_topk_prob)
    elif arch == "olmoe":
        if cfg.head_dim * cfg.n_heads != cfg.hidden_size:
            raise ValueError("olmoe needs head_dim * n_heads == hidden_size")
        c = transformers.OlmoeConfig(**common, num_experts=cfg.n_experts, intermediate_size=cfg.moe_intermediate_size,
                                     norm_topk_prob=cfg.norm_topk_prob)
    else:
        c = transformers.MixtralConfig(**common, head_dim=cfg.head_dim, num_local_experts=cfg.n_experts,
                                       intermediate_size=cfg.moe_intermediate_size)
    c.dtype = str(cfg.torch_dtype).removeprefix("torch.")
    return c


def hf_state(model: MoEForCausalLM, arch: str) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names with per-expert tensors (the released-checkpoint layout)."""
    cfg, out = model.config, {}
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    inter = cfg.moe_intermediate_size
    for key, t in model.state_dict().items():
        t = t.detach().contiguous().cpu()
        if cfg.tie_word_embeddings and key == "lm_head.weight":
            continue
        if ".mlp.experts." in key:
            pre = key.split(".mlp.experts.")[0] + f".{moe}.experts."
            if key.endswith("gate_up_proj"):
                for e in range(cfg.n_experts):
                    out[f"{pre}{e}.{names[0]}.weight"] = t[e, :inter].clone()
                    out[f"{pre}{e}.{names[1]}.weight"] = t[e, inter:].clone()
            else:
                for e in range(cfg.n_experts):
                    out[f"{pre}{e}.{names[2]}.weight"] = t[e].clone()
            continue
        out[key.replace(".mlp.", f".{moe}.")] = t
    return out


def save_hf_model(model: MoEForCausalLM, tokenizer: Any | None, folder: str | Path,
                  architecture: str = "qwen3_moe") -> Path:
    """Write a transformers-loadable folder (config.json, model.safetensors, tokenizer), atomically."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {list(ARCHITECTURES)}, got {architecture!r}")
    folder = Path(folder)
    hf_cfg = _hf_config(model.config, architecture, tokenizer)
    with atomic_dir(folder) as tmp:
        hf_cfg.save_pretrained(tmp)
        save_file(hf_state(model, architecture), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if isinstance(tokenizer, CharTokenizer):
            save_char_tokenizer_as_hf(tokenizer, tmp)
        elif tokenizer is not None:
            tokenizer.save(tmp)
    return folder


def save_char_tokenizer_as_hf(tok: CharTokenizer, folder: str | Path) -> None:
    """The char vocabulary as a ``tokenizers`` WordLevel tokenizer (one token per character, same ids)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    vocab = {s: i for i, s in enumerate(tok.SPECIALS)} | {c: i + len(tok.SPECIALS) for i, c in enumerate(tok.alphabet)}
    hf = _Tok(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(list(tok.SPECIALS))
    folder = Path(folder)
    hf.save(str(folder / TOKENIZER_FILE))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
         "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 1 << 30}, indent=2) + "\n")
