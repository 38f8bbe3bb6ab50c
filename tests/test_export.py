"""quads export: the exported NVFP4 bits decode, in compressed-tensors' and ModelOpt's own code, to exactly
the rollout's QDQ weights; exports re-import to the same model; bad input leaves no output folder.

Tiny random Qwen3-MoE (hidden 64, 2 layers, 4 experts) built with transformers, no download.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quads.export import ExportConfig, export, load_exported
from quads.export.plan import QuantSpec, quantize_weight, split_name
from quads.export.source import fuse_experts, load_state_dict

H, LAYERS, E, INTER, V = 64, 2, 4, 32, 128


def _hf_model(seed: int = 0, head_dim: int = 16):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * INTER, moe_intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         num_experts=E, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # wider weights than the 0.02 init, so block scales spread over the E4M3 range
        for n, p in m.named_parameters():
            if "experts" in n:
                p.mul_(torch.logspace(-1, 1, p.shape[-2]).reshape(-1, 1))
    return m


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "ckpt"
    _hf_model().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def exports(ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for fmt, act in (("compressed-tensors", "bf16"), ("compressed-tensors", "nvfp4"), ("modelopt", "bf16"),
                     ("modelopt", "nvfp4"), ("bf16", "bf16")):
        out[f"{fmt}-{act}"] = export(ExportConfig(checkpoint=str(ckpt), out=str(root / f"{fmt}-{act}"), format=fmt,
                                                  activations=act, recipe="w4a16-qat", engines_only=True)).out
    return out


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in BF16 ulps (-0.0 counted as +0.0: modelopt decodes code 0x8 as +0.0)."""
    a, b = (a + 0.0).view(torch.int16).int(), (b + 0.0).view(torch.int16).int()
    return int((a - b).abs().max())


def _rollout_qdq(ckpt: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Per exported expert linear, from the rollout's quantizer (quads.quant): ``qdq`` its dequantized BF16
    weight, ``unit`` e2m1 * s (its decode without the global scale, exact in BF16), ``s_dec``."""
    from quads.formats import nvfp4

    sd = fuse_experts(load_state_dict(ckpt))
    out = {}
    for key, w in sd.items():
        if ".mlp.experts." not in key:
            continue
        q = quantize_weight(w, QuantSpec())
        deq = nvfp4.dequantize(q, torch.bfloat16)
        unit = nvfp4.dequantize(nvfp4.NVFP4Tensor(q.codes, q.scales, torch.tensor(1.0), q.shape, q.dtype),
                                torch.bfloat16)
        gs = q.global_scale.reshape(-1)
        for name, half, e in split_name(key, w.shape[0]):
            rows = slice(None) if half is None else (slice(0, INTER) if half == "lo" else slice(INTER, None))
            out[name] = {"qdq": deq[e][rows], "unit": unit[e][rows], "s_dec": gs[e]}
    return out


def test_compressed_tensors_decompress_equals_rollout_qdq(ckpt, exports):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is the decompression oracle (.[oracles])")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    for key in ("compressed-tensors-bf16", "compressed-tensors-nvfp4"):
        folder = exports[key]
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        parsed = QuantizationConfig.model_validate(qc)
        scheme = parsed.config_groups["group_0"]
        assert (scheme.input_activations is not None) == key.endswith("nvfp4")
        assert "model.layers.0.mlp.gate" in parsed.ignore and "lm_head" in parsed.ignore
        assert "model.layers.1.self_attn.q_proj" in parsed.ignore
        sd = load_file(str(folder / "model.safetensors"))
        ref = _rollout_qdq(ckpt)
        n = 0
        for name, r in ref.items():
            packed = sd[f"{name}.weight_packed"]
            assert packed.dtype == torch.uint8 and packed.shape == (r["qdq"].shape[0], r["qdq"].shape[1] // 2)
            assert sd[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
            g = sd[f"{name}.weight_global_scale"]
            assert g.dtype == torch.float32 and g.shape == (1,)
            state = {"weight_packed": packed, "weight_scale": sd[f"{name}.weight_scale"], "weight_global_scale": g}
            # codes, block scales, nibble order and signs, byte for byte: with G = 1 compressed-tensors
            # decodes e2m1 * s (exact in BF16), which must equal the rollout's weight / S_dec exactly
            unit = NVFP4PackedCompressor.decompress({**state, "weight_global_scale": torch.ones(1)}, scheme)
            assert torch.equal(unit["weight"].view(torch.int16), r["unit"].view(torch.int16)), name
            assert torch.equal(1.0 / g, r["s_dec"].reshape(1)), name  # vLLM's alpha is 1 / G in fp32
            w = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
            assert w.dtype == torch.bfloat16
            # full decode: compressed-tensors computes e2m1 * (s / G) in fp32, quads (e2m1 * s) * S_dec:
            # the two roundings differ by at most one BF16 ulp on some elements (docs/EXPORT.md)
            assert _ulps(w, r["qdq"]) <= 1, name
            if key.endswith("nvfp4"):
                igs = sd[f"{name}.input_global_scale"]
                assert igs.dtype == torch.float32 and igs.shape == (1,) and float(igs) > 0
            else:
                assert f"{name}.input_global_scale" not in sd
            n += 1
        assert n == LAYERS * E * 3


def test_one_global_scale_per_expert(ckpt, exports):
    ref = _rollout_qdq(ckpt)
    gs = [ref[f"model.layers.1.mlp.experts.{e}.down_proj"]["s_dec"] for e in range(E)]
    assert len(set(float(g) for g in gs)) == E  # the rollout quantizes each expert on its own
    sd = load_file(str(exports["modelopt-bf16"] / "model.safetensors"))
    for e in range(E):
        for p in ("gate_proj", "up_proj"):  # gate and up share their expert's scale (vLLM's fused w13)
            assert torch.equal(sd[f"model.layers.1.mlp.experts.{e}.{p}.weight_scale_2"],
                               ref[f"model.layers.1.mlp.experts.{e}.{p}"]["s_dec"])


@pytest.fixture(scope="module")
def modelopt_api():
    sys.modules.setdefault("requests", types.ModuleType("requests"))  # modelopt imports it, never uses it here
    pytest.importorskip("modelopt.torch.quantization.qtensor", reason="nvidia-modelopt is the dequantization oracle "
                        "(.[oracles])")
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    return NVFP4QTensor, convert_hf_quant_config_format


def test_modelopt_dequantize_equals_rollout_qdq(ckpt, exports, modelopt_api):
    NVFP4QTensor, convert = modelopt_api
    for key in ("modelopt-bf16", "modelopt-nvfp4"):
        folder = exports[key]
        hq = json.loads((folder / "hf_quant_config.json").read_text())
        assert hq["quantization"]["quant_algo"] == ("NVFP4" if key.endswith("nvfp4") else "W4A16_NVFP4")
        assert json.loads((folder / "config.json").read_text())["quantization_config"] == convert(hq)
        sd = load_file(str(folder / "model.safetensors"))
        ref = _rollout_qdq(ckpt)
        for name, r in ref.items():
            w = sd[f"{name}.weight"]
            assert w.dtype == torch.uint8 and sd[f"{name}.weight_scale_2"].shape == ()
            assert torch.equal(sd[f"{name}.weight_scale_2"], r["s_dec"])  # decode scale stored as it is
            qt = NVFP4QTensor(r["qdq"].shape, torch.bfloat16, w)
            kw = {"dtype": torch.bfloat16, "scale": sd[f"{name}.weight_scale"], "block_sizes": {-1: 16}}
            unit = qt.dequantize(double_scale=torch.tensor(1.0), **kw)
            assert torch.equal(unit, r["unit"]), name  # value equality: modelopt decodes code 0x8 as +0.0
            # modelopt rounds s * S_dec first, quads e2m1 * s * S_dec once: at most one BF16 ulp apart
            assert _ulps(qt.dequantize(double_scale=sd[f"{name}.weight_scale_2"], **kw), r["qdq"]) <= 1, name
            assert (f"{name}.input_scale" in sd) == key.endswith("nvfp4")


def _logprobs(model, ids):
    with torch.no_grad():
        out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.log_softmax(logits.float(), -1)


def test_reimport_gives_the_qdq_model(ckpt, exports):
    from quads.model.hf import load_hf_model

    ref_model, _ = load_hf_model(ckpt, dtype="bfloat16")
    with torch.no_grad():
        for key, p in ref_model.state_dict().items():
            if key.endswith(("gate_up_proj", "down_proj")) and ".mlp.experts" in key:
                q = quantize_weight(p, QuantSpec())
                from quads.formats import nvfp4

                p.copy_(nvfp4.dequantize(q, torch.bfloat16))
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    want = _logprobs(ref_model, ids)
    for key in ("compressed-tensors-bf16", "compressed-tensors-nvfp4", "modelopt-nvfp4"):
        model, tok, info = load_exported(exports[key])
        assert type(model).__name__ == "MoEForCausalLM"
        assert info.format == key.rsplit("-", 1)[0] and info.scheme == ("W4A4" if key.endswith("nvfp4") else "W4A16")
        assert set(info.quantized) == {f"model.layers.{i}.mlp.experts.{k}" for i in range(LAYERS)
                                       for k in ("gate_up_proj", "down_proj")}
        assert all(info.requantize_exact.values())
        assert torch.equal(_logprobs(model, ids), want), key
    _, _, info_ct = load_exported(exports["compressed-tensors-nvfp4"])
    _, _, info_mo = load_exported(exports["modelopt-nvfp4"])
    for k, v in info_ct.input_amax.items():
        assert v == pytest.approx(info_mo.input_amax[k], rel=1e-6)


def test_transformers_loads_bf16_export(ckpt, exports):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2))
    loaded = AutoModelForCausalLM.from_pretrained(exports["bf16-bf16"], dtype=torch.bfloat16).eval()
    orig = _hf_model().to(torch.bfloat16)
    want = orig.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # same weights; from_pretrained may pick other attention / expert kernels, so compare loosely
    torch.testing.assert_close(_logprobs(loaded, ids), _logprobs(orig, ids), atol=0.02, rtol=0)


def test_third_party_compressed_tensors_checkpoint(tmp_path):
    """A folder whose NVFP4 experts were compressed by compressed-tensors itself loads bit-exactly."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the third-party folder (.[oracles])")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    m = _hf_model(seed=3).to(torch.bfloat16)
    m.save_pretrained(tmp_path / "dense")
    sd = load_file(str(tmp_path / "dense" / "model.safetensors"))
    scheme = QuantizationScheme(targets=["Linear"], format="nvfp4-pack-quantized", **NVFP4A16)
    out, want = {}, {}
    for k, w in sd.items():
        if ".mlp.experts." not in k:
            out[k] = w
            continue
        name = k.removesuffix(".weight")
        blocks = w.float().reshape(w.shape[0], -1, 16)
        g = generate_gparam(w.float().min(), w.float().max())
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=g)
        comp = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": g}, scheme)
        for p, t in comp.items():
            out[f"{name}.{p}"] = t
        want[name] = (NVFP4PackedCompressor.decompress(comp, scheme)["weight"], comp["weight_packed"])
    folder = tmp_path / "ct"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file(out, str(folder / "model.safetensors"))
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    cfg["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"],
        format="nvfp4-pack-quantized", quantization_status="compressed").model_dump(mode="json")
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _, info = load_exported(folder)
    assert info.format == "compressed-tensors" and info.metadata == {}
    state = model.state_dict()
    for i in range(LAYERS):
        key = f"model.layers.{i}.mlp.experts.gate_up_proj"
        gate_up, codes = state[key], info.quantized[key].codes
        assert info.quantized[key].global_scale.shape == (E, 2 * INTER, 1)  # gate and up scaled separately
        for e in range(E):
            parts = [want[f"model.layers.{i}.mlp.experts.{e}.{p}"] for p in ("gate_proj", "up_proj")]
            assert torch.equal(codes[e], torch.cat([p[1] for p in parts]))  # the tool's bits, kept exactly
            assert _ulps(gate_up[e], torch.cat([p[0] for p in parts])) <= 1  # s * (1/G) vs s / G rounding


def test_sharded_export_has_an_index(ckpt, tmp_path):
    out = export(ExportConfig(checkpoint=str(ckpt), out=str(tmp_path / "o"), format="compressed-tensors",
                              max_shard_mb=0.02, engines_only=True)).out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    _, _, info = load_exported(out)
    assert len(info.quantized) == LAYERS * 2


def test_compressed_tensors_nvfp4_experts_refused_for_transformers(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"transformers#48371.*--engines-only"):
        export(ExportConfig(checkpoint=str(ckpt), out=str(tmp_path / "o"), format="compressed-tensors"))
    assert not (tmp_path / "o").exists()


def test_transformers_loader_on_compressed_tensors_export(ckpt, exports):
    """transformers' own ``from_pretrained`` of the NVFP4 W4A16 export, CPU, decompressing.

    Its MoE path places every expert's codes and block scales right (gate/up order, rows, nibbles: the loaded
    experts equal ``e2m1 * s`` bit for bit) and drops the per-expert global scale (huggingface/transformers#48371,
    why the export is refused without ``engines_only``). With S_dec applied as quads decodes, the model is the
    rollout's W4A16 model: same weights bit for bit, log-probs within fp32 rounding of quads' own forward.
    When this transformers applies the global scale itself, the first check fails: lift the refusal then.
    """
    pytest.importorskip("compressed_tensors", reason="transformers decompresses the folder with compressed-tensors "
                        "(.[oracles])")
    from transformers import AutoModelForCausalLM

    from quads.model.hf import load_hf_model

    ref = _rollout_qdq(ckpt)
    loaded = AutoModelForCausalLM.from_pretrained(exports["compressed-tensors-bf16"], dtype=torch.float32).eval()
    state = loaded.state_dict()
    quads_model, _ = load_hf_model(ckpt, dtype="bfloat16")  # the rollout's BF16 weights ...
    quads_model = quads_model.float()  # ... W4A16 (QDQ(W) on the experts below), fp32 activations
    qstate = quads_model.state_dict()
    with torch.no_grad():
        for i in range(LAYERS):
            for key, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
                name = f"model.layers.{i}.mlp.experts.{key}"
                w = state[name].float()  # the decompressed experts are BF16 parameters: compute in fp32 as quads does
                for e in range(E):
                    r = [ref[f"model.layers.{i}.mlp.experts.{e}.{p}"] for p in parts]
                    unit = torch.cat([x["unit"] for x in r]).float()
                    assert torch.equal(w[e], unit), (name, e)  # e2m1 * s exactly: no global scale applied
                    w[e] = (w[e] * r[0]["s_dec"]).to(torch.bfloat16).float()  # quads' decode: bf16((e2m1 s) S_dec)
                    assert torch.equal(w[e], torch.cat([x["qdq"] for x in r]).float()), (name, e)
                qstate[name].copy_(w)
                setattr(loaded.get_submodule(name.rpartition(".")[0]), key, torch.nn.Parameter(w, requires_grad=False))
        for k, t in loaded.state_dict().items():  # every other tensor: the BF16 master weights, as in the export
            if ".mlp.experts." not in k:
                assert torch.equal(t, qstate[k]), k
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    got, want = _logprobs(loaded, ids), _logprobs(quads_model, ids)
    gap = float((got - want).abs().max())
    assert gap <= 1e-4, gap  # same weights, fp32 activations: only the two engines' fp32 rounding is left
    master = _logprobs(_hf_model().float(), ids)
    assert float((master - want).abs().max()) > 100 * 1e-4  # NVFP4 moves the log-probs: the check can fail
