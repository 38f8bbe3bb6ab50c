"""The verl plugin (``quads.integrations.verl``) against the released verl package, on the CPU.

Needs verl installed beside quads (``make test-verl`` builds ``.venv-verl``: scripts/setup_verl_env.sh);
skipped elsewhere. What verl cannot do on a CPU (its FSDP engine registers for cuda / npu only, its
vLLM server needs a GPU build of vLLM) is not run here: docs/VERL.md says what was and was not tested.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

verl = pytest.importorskip("verl", reason="needs verl (make test-verl: .venv-verl, scripts/setup_verl_env.sh)")
transformers = pytest.importorskip("transformers")

from quads.formats import nvfp4  # noqa: E402
from quads.integrations.verl import config as vconfig  # noqa: E402
from quads.integrations.verl.engine import (  # noqa: E402
    STRATEGY,
    QuadsFSDPEngine,
    QuadsFSDPEngineConfig,
    apply_trainer_qat,
)
from quads.metrics.mismatch import framework_aliases, mismatch_metrics  # noqa: E402
from quads.quant.apply import quantized_modules  # noqa: E402
from quads.quant.layers import QuantizedExperts  # noqa: E402
from quads.quant.recipe import PRESETS, Recipe, get_recipe  # noqa: E402

E, H, INTER, LAYERS = 4, 64, 32, 2


def qwen3_moe(seed=0, dtype=torch.float32):
    """A config-built tiny transformers 5 Qwen3-MoE (random weights, no hub), packed 3-D experts."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=H, intermediate_size=64, moe_intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(cfg).to(dtype)
    model.set_experts_implementation("eager")
    return model.eval()


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env})


# ------------------------------------------------------------------------------------------ discovery


DISCOVER = """
import json, verl
from importlib.metadata import entry_points
from verl.workers.engine.base import EngineRegistry
from verl.utils.debug import metrics
eps = {e.name: e.value for e in entry_points(group="verl.plugins")}
print(json.dumps({"eps": eps, "strategies": sorted(EngineRegistry._engines["language_model"]),
                  "metrics_wrapped": hasattr(metrics.calculate_debug_metrics, "quads_wrapped")}))
"""


@pytest.mark.slow
def test_plugin_discovered_through_the_entry_point():
    res = run_python(DISCOVER)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["eps"].get("quads") == "quads.integrations.verl.plugin"
    assert STRATEGY in got["strategies"] and "fsdp2" in got["strategies"]
    assert got["metrics_wrapped"]
    # verl's own switch turns entry-point discovery off: then nothing of quads is there
    off = run_python(DISCOVER, VERL_USE_EXTERNAL_PLUGINS="none")
    assert off.returncode == 0, off.stderr
    got = json.loads(off.stdout.strip().splitlines()[-1])
    assert STRATEGY not in got["strategies"] and not got["metrics_wrapped"]


def test_registry_returns_the_quads_engine(monkeypatch):
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # verl's FSDP engines register for cuda / npu only
    cls = EngineRegistry.get_engine_cls("language_model", STRATEGY)
    assert cls is QuadsFSDPEngine and issubclass(cls, FSDPEngineWithLMHead)


# ------------------------------------------------------------------------------------------ config


BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",  # what every verl run sets
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"]


def compose_ppo(overrides):
    """verl's own PPO trainer config (its YAML files, Hydra) with ``BASE + overrides`` applied."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=BASE + overrides)


def ref_config(cfg):
    """The reference policy's ``ActorConfig``, built as verl's ``ActorRolloutRefWorker`` builds it."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass

    ref = cfg.actor_rollout_ref.ref
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return omega_conf_to_dataclass(ref)


@pytest.mark.parametrize("recipe", [get_recipe("quads"), get_recipe("quads", rac_ratio=0.25),
                                    get_recipe("w4a16-qat"), get_recipe("w4a16"), get_recipe("nvfp4"), get_recipe("bf16")],
                         ids=lambda r: f"{r.name}-rac{r.rollout.rac_ratio:g}")
def test_overrides_build_verl_configs(recipe):
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPEngineConfig

    cfg = compose_ppo(vconfig.hydra_overrides(recipe))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref = ref_config(cfg)
    if recipe.trainer.is_identity:
        assert actor.strategy == "fsdp2" and type(actor.engine) is FSDPEngineConfig
    else:
        assert isinstance(actor.engine, QuadsFSDPEngineConfig)
        assert actor.engine.strategy == STRATEGY == ref.engine.strategy  # the registry key of both engines
        assert actor.engine.recipe() == recipe
        assert ref.engine.forward_only and type(ref.engine) is FSDPEngineConfig
    vllm_kwargs = OmegaConf.to_container(cfg.actor_rollout_ref.rollout.engine_kwargs.vllm, resolve=True)
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert cfg.actor_rollout_ref.rollout.quantization is None  # verl accepts only fp8 / torchao / ascend there
    if recipe.rollout.is_identity:
        assert vllm_kwargs == {}
        return
    assert vllm_kwargs["quantization"] == "quads"
    qc = vllm_kwargs["hf_overrides"]["quantization_config"]
    assert qc["quant_method"] == "quads"
    # what quads' vLLM method (QuadsQuantConfig.from_config) builds from it
    got = get_recipe(qc["recipe"]) if isinstance(qc["recipe"], str) else Recipe.from_dict(qc["recipe"])
    assert got == recipe
    assert isinstance(qc["recipe"], str) == (PRESETS[recipe.name] == recipe)


def test_bad_recipe_fails_when_verl_builds_the_config():
    from hydra.errors import InstantiationException
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose_ppo(vconfig.hydra_overrides(get_recipe("quads")) +
                      ["actor_rollout_ref.actor.fsdp_config.quads_recipe='nvfp5'"])
    with pytest.raises(InstantiationException, match="unknown recipe 'nvfp5'"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_training_engine_refuses_verls_plain_config():
    from verl.workers.config import FSDPEngineConfig

    with pytest.raises(ValueError, match="fsdp_config._target_=quads.integrations.verl.engine.QuadsFSDPEngineConfig"):
        QuadsFSDPEngine(None, FSDPEngineConfig(strategy="fsdp2"), None, None)


# ------------------------------------------------------------------------------------------ trainer QAT


EXPERTS = {f"model.layers.{i}.mlp.experts.{p}" for i in range(LAYERS) for p in ("gate_up_proj", "down_proj")}


def test_quads_qat_covers_the_packed_3d_experts_that_verls_qat_selection_skips():
    """verl's ``apply_qat`` swaps the modules its ``_should_quantize`` selects (``nn.Linear`` only; its
    ``QATLinear`` module imports triton, so the swap itself is the next test). quads swaps the experts."""
    from verl.utils.qat.core import QATConfig, _should_quantize

    model = qwen3_moe()
    verl_selected = {f"{n}.weight" for n, m in model.named_modules()
                     if _should_quantize(n, m, QATConfig(enable=True, mode="w4a16"))}
    assert verl_selected and all(".self_attn." in n for n in verl_selected)  # attention projections only
    weights3d = {n for n, p in model.named_parameters() if p.dim() == 3}
    assert weights3d == EXPERTS and not verl_selected & weights3d

    summary = apply_trainer_qat(model, get_recipe("quads"))
    covered = {f"{n}.{p}" for n, m in quantized_modules(model).items() for p in m.weight_names}
    assert covered == EXPERTS and all(m.kind == "experts" for m in summary.modules)
    assert all(isinstance(model.model.layers[i].mlp.experts, QuantizedExperts) for i in range(LAYERS))
    assert summary.n_quantized_params == sum(model.get_parameter(n).numel() for n in EXPERTS)


def test_verls_apply_qat_leaves_the_experts_in_bf16():
    pytest.importorskip("triton", reason="verl.utils.qat.linear imports triton (not in .venv-verl: 1 GB)")
    from verl.utils.qat import QATConfig, apply_qat
    from verl.utils.qat.linear import QATLinear

    model = apply_qat(qwen3_moe(), QATConfig(enable=True, mode="w4a16"))
    swapped = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, QATLinear)}
    assert swapped and all(".self_attn." in n for n in swapped)
    assert {type(model.model.layers[i].mlp.experts).__name__ for i in range(LAYERS)} == {"Qwen3MoeExperts"}


def test_trainer_experts_compute_with_qdq_weights_and_ste_grads():
    """The swapped experts = transformers' experts run on QDQ(W) (fp32: same GEMMs, so close to fp32
    rounding); gradients reach the packed master weights (straight through)."""
    model, ref = qwen3_moe(), qwen3_moe()
    with torch.no_grad():
        for i in range(LAYERS):
            e = ref.model.layers[i].mlp.experts
            for p in (e.gate_up_proj, e.down_proj):  # one NVFP4 global scale per expert, BF16 wire dtype
                p.copy_(torch.stack([nvfp4.qdq(w.to(torch.bfloat16)) for w in p]))
    apply_trainer_qat(model, get_recipe("quads"))
    ids = torch.randint(0, 96, (3, 11))
    out, want, plain = model(ids).logits, ref(ids).logits, qwen3_moe()(ids).logits
    err, qerr = (out - want).abs().max().item(), (plain - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
    assert qerr > 1e3 * max(err, 1e-7), (qerr, err)  # the quantization is really on
    out.float().square().mean().backward()
    for i in range(LAYERS):
        e = model.model.layers[i].mlp.experts
        assert e.gate_up_proj.grad is not None and e.gate_up_proj.grad.abs().sum() > 0
        assert e.down_proj.grad is not None and e.down_proj.grad.abs().sum() > 0


def test_bf16_trainer_recipes_swap_nothing():
    for name in ("bf16", "fp8", "nvfp4"):
        model = qwen3_moe()
        summary = apply_trainer_qat(model, get_recipe(name))
        assert summary.modules == [] and not quantized_modules(model)


def bare_engine(engine_config, monkeypatch, model):
    """A ``QuadsFSDPEngine`` whose verl parts are stubbed: verl's ``FSDPEngine.__init__`` needs a CUDA
    device mesh and its ``_build_module`` a model folder; ``model`` stands for what verl built."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    def init(self, model_config, engine_config, optimizer_config, checkpoint_config):
        self.engine_config, self._is_lora, self.module = engine_config, False, model

    monkeypatch.setattr(FSDPEngine, "__init__", init)
    monkeypatch.setattr(FSDPEngine, "_build_module", lambda self: model)
    monkeypatch.setattr(FSDPEngine, "optimizer_step", lambda self: 1.5)
    return QuadsFSDPEngine(None, engine_config, None, None)


def test_engine_quantizes_what_verl_builds_and_drops_the_cache_after_a_step(monkeypatch):
    cfg = QuadsFSDPEngineConfig(strategy="fsdp2")
    object.__setattr__(cfg, "strategy", STRATEGY)  # as verl's FSDPActorConfig sets it
    model = qwen3_moe()
    eng = bare_engine(cfg, monkeypatch, model)
    assert cfg.strategy == "fsdp2"  # what verl's FSDP build branches on
    assert eng._build_module() is model and eng.quads_summary.n_quantized_params > 0
    experts = quantized_modules(model)
    assert set(experts) == {f"model.layers.{i}.mlp.experts" for i in range(LAYERS)}
    model(torch.randint(0, 96, (2, 5)))  # fills the QDQ(W) cache
    assert all(s.w_q is not None for m in experts.values() for s in m.stores.values())
    assert eng.optimizer_step() == 1.5
    assert all(s.w_q is None for m in experts.values() for s in m.stores.values())


def test_forward_only_engine_keeps_the_model_plain(monkeypatch):
    from verl.workers.config import FSDPEngineConfig

    model = qwen3_moe()
    eng = bare_engine(FSDPEngineConfig(strategy="fsdp2", forward_only=True), monkeypatch, model)
    assert eng._build_module() is model and not quantized_modules(model)


# ------------------------------------------------------------------------------------------ weight stream


def verl_weight_stream(model):
    """What verl's FSDP engine sends to vLLM (``FSDPEngine.get_per_tensor_param`` without FSDP):
    the state dict, ``convert_weight_keys``, ``unfuse_moe_params``."""
    from verl.utils.model import convert_weight_keys
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    params = convert_weight_keys(model.state_dict(), model)
    return dict(unfuse_moe_params(iter(params.items()), model.config.model_type))


def vllm_qwen3_moe_checkpoint_names(cfg):
    """``{name: shape}`` vLLM's Qwen3-MoE loader maps: per-expert ``gate_proj`` / ``up_proj`` / ``down_proj``
    (onto its fused ``w13`` / ``w2`` experts), ``q/k/v_proj`` (onto ``qkv_proj``), the rest by name."""
    h, d, i_ = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
           "lm_head.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        out |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (nq * d, h), f"{p}.self_attn.k_proj.weight": (nkv * d, h),
                f"{p}.self_attn.v_proj.weight": (nkv * d, h), f"{p}.self_attn.o_proj.weight": (h, nq * d),
                f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,),
                f"{p}.mlp.gate.weight": (cfg.num_experts, h)}
        for e in range(cfg.num_experts):
            out |= {f"{p}.mlp.experts.{e}.gate_proj.weight": (i_, h), f"{p}.mlp.experts.{e}.up_proj.weight": (i_, h),
                    f"{p}.mlp.experts.{e}.down_proj.weight": (h, i_)}
    return out


def test_weight_stream_to_vllm_has_the_checkpoint_names_and_the_master_weights(tmp_path):
    from safetensors import safe_open

    plain = qwen3_moe()
    model = qwen3_moe()
    apply_trainer_qat(model, get_recipe("quads"))
    stream, plain_stream = verl_weight_stream(model), verl_weight_stream(plain)
    got = {n: tuple(t.shape) for n, t in stream.items()}
    assert got == vllm_qwen3_moe_checkpoint_names(model.config)
    # the names of the model's own checkpoint on disk (what vLLM loads at start-up)
    plain.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert got == on_disk
    # BF16/FP32 master weights, bit for bit (quads' vLLM method quantizes them itself, with the
    # trainer's function), not QDQ(W): the swap changed no parameter
    for name, t in stream.items():
        assert torch.equal(t, plain_stream[name]), name
    w = model.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(stream["model.layers.1.mlp.experts.2.up_proj.weight"], w[2, INTER:])
    assert torch.equal(stream["model.layers.1.mlp.experts.2.gate_proj.weight"], w[2, :INTER])


# ------------------------------------------------------------------------------------------ metrics


def logprob_batch(seed=0, b=6, r=13, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    lt = -torch.rand(b, r, generator=g, dtype=torch.float64) * 3
    lr = lt + torch.randn(b, r, generator=g, dtype=torch.float64) * 0.3 - shift
    mask = torch.ones(b, r)
    for i in range(b):
        mask[i, r - 1 - 2 * i:] = 0  # different lengths, none empty
    return lt.float(), lr.float(), mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_verls_rollout_corr_helper(seed):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs

    lt, lr, mask = logprob_batch(seed)
    ours, theirs = framework_aliases(lt, lr, mask), compute_rollout_corr_metrics_from_logprobs(lt, lr, mask)
    shared = sorted(set(theirs) & set(ours))
    assert len(shared) == len(theirs) == 13, sorted(theirs)
    for k in shared:  # same fp32 inputs, summation order differs
        assert ours[k] == pytest.approx(theirs[k], rel=2e-6, abs=1e-7), k
    q = mismatch_metrics(lt, lr, mask)
    assert q["mismatch/k1"] == pytest.approx(theirs["rollout_corr/kl"], rel=2e-6, abs=1e-7)
    assert q["mismatch/k3"] == pytest.approx(theirs["rollout_corr/k3_kl"], rel=2e-6, abs=1e-7)
    assert q["mismatch/chi2"] == pytest.approx(theirs["rollout_corr/chi2_token"], rel=2e-6)  # |log rho| < 20
    assert q["mismatch/ppl_train"] == pytest.approx(theirs["rollout_corr/training_ppl"], rel=2e-6)
    assert q["mismatch/ppl_rollout"] == pytest.approx(theirs["rollout_corr/rollout_ppl"], rel=2e-6)


def test_ppl_ratio_directions_are_opposite():
    """quads' mismatch/ppl_ratio = mean_seq ppl_rollout/ppl_train; verl's rollout_corr/ppl_ratio =
    mean_seq ppl_train/ppl_rollout. A rollout less sure of its own samples: quads' > 1, verl's < 1."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs

    lt, lr, mask = logprob_batch(3, shift=0.2)
    theirs = compute_rollout_corr_metrics_from_logprobs(lt, lr, mask)["rollout_corr/ppl_ratio"]
    ours = mismatch_metrics(lt, lr, mask)["mismatch/ppl_ratio"]
    assert ours > 1 > theirs
    m = mask.bool()
    per_seq = torch.stack([torch.exp(lt[i][m[i]].mean() - lr[i][m[i]].mean()) for i in range(len(lt))])
    assert ours == pytest.approx(per_seq.mean().item(), rel=2e-6)
    assert theirs == pytest.approx((1 / per_seq).mean().item(), rel=2e-6)


def test_step_metrics_carry_quads_beside_rollout_corr():
    """The path of verl's PPO step: ``calculate_debug_metrics`` (wrapped by the plugin) and
    ``compute_rollout_correction_and_add_to_batch`` on one ``DataProto``."""
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.utils.debug import metrics as verl_debug

    lt, lr, mask = logprob_batch(4)
    batch = DataProto.from_dict({"old_log_probs": lt, "rollout_log_probs": lr, "response_mask": mask,
                                 "responses": torch.zeros(lt.shape, dtype=torch.long)})
    step = dict(verl_debug.calculate_debug_metrics(batch))
    assert "training/rollout_probs_diff_mean" in step  # verl's own keys, unchanged
    assert not any(k.startswith("rollout_corr/") for k in step)  # verl writes those, below
    want = mismatch_metrics(lt, lr, mask)
    assert {k: v for k, v in step.items() if k.startswith("mismatch/")} == {
        k: v for k, v in want.items() if k.startswith("mismatch/")}
    _, corr = compute_rollout_correction_and_add_to_batch(batch, RolloutCorrectionConfig())
    step.update(corr)
    assert step["mismatch/k1"] == pytest.approx(step["rollout_corr/kl"], rel=2e-6, abs=1e-7)
    assert step["mismatch/k3"] == pytest.approx(step["rollout_corr/k3_kl"], rel=2e-6, abs=1e-7)
