"""The rollout side's batched expert path (quads.quant.grouped) against the experts loop."""

from __future__ import annotations

import pytest
import torch

from quads.kernels import dispatch
from quads.kernels._common import HAS_TRITON
from quads.model.moe import MoEExperts
from quads.quant import grouped, layers, ops
from quads.quant.layers import QuantizedExperts
from quads.quant.recipe import LinearSpec

E, H, INTER, T, K_TOP = 8, 64, 32, 40, 2

SPECS = {
    "bf16": LinearSpec(),
    "w4a16": LinearSpec.of(weight="nvfp4"),
    "w4a4": LinearSpec.of(weight="nvfp4", act="nvfp4"),
    "rac50": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5),
    "rac25-token": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.25, act_scale="token"),
    "rac50-static": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, rac_selection="static"),
    "fp8-row": LinearSpec.of(weight="fp8", act="fp8"),
}


def _experts(spec: LinearSpec, dtype: torch.dtype, seed: int = 0) -> QuantizedExperts:
    torch.manual_seed(seed)
    ex = MoEExperts(E, H, INTER)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.1)
    torch.nn.init.normal_(ex.down_proj, std=0.1)
    ex = ex.to(dtype).requires_grad_(False)
    return QuantizedExperts(ex, spec, side="rollout", weight_dtype=torch.bfloat16)


def _inputs(dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    x[:, 3] *= 20  # an outlier channel: RAC selects it
    w, idx = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K_TOP)
    idx[5, 1] = E  # a masked slot contributes nothing
    return x, idx, w.to(dtype)


def _run(q: QuantizedExperts, x, idx, w, use_grouped: bool):
    q.grouped = use_grouped
    for s in q.selectors.values():
        s.sq_sum.zero_()
        s.count.zero_()
    with torch.no_grad():
        y = q(x, idx, w)
    return y, [(s.sq_sum.clone(), s.count.clone()) for s in q.selectors.values()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_grouped_matches_loop(name, dtype):
    q = _experts(SPECS[name], dtype)
    x, idx, w = _inputs(dtype)
    y_loop, st_loop = _run(q, x, idx, w, False)
    y_grp, st_grp = _run(q, x, idx, w, True)
    names = list(q.selectors)
    assert names in ([], ["gate_up_proj", "down_proj"])
    assert y_grp.dtype == y_loop.dtype and y_grp.shape == y_loop.shape
    # same quantized operands; only the GEMM's fp32 accumulation order may differ (bmm vs mm)
    scale = y_loop.float().abs().max().item()
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one output ulp
    err = (y_grp.float() - y_loop.float()).abs().max().item()
    assert err <= tol * scale, f"{name}: grouped differs from the loop by {err} (scale {scale})"
    assert y_loop.abs().sum() > 0
    for proj, (sq0, c0), (sq1, c1) in zip(names, st_loop, st_grp, strict=True):  # static RAC statistics
        assert torch.equal(c0, c1)
        # gate_up sees the same input on both paths: its fp64 residual sums agree to summation order.
        # down_proj's input is the gate_up GEMM's output, whose fp32 accumulation order differs (bmm vs
        # mm, and with the CPU's kernel and thread count), so its residuals move by a few fp32 ulps
        # (up to 9e-6 relative seen with 2 threads on AVX-512).
        rtol = 1e-12 if proj == "gate_up_proj" else 1e-4
        torch.testing.assert_close(sq0, sq1, rtol=rtol, atol=0, msg=lambda m, p=proj: f"{name} {p}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["w4a4", "rac50", "rac25-token"])
def test_loop_with_shared_operands_is_the_per_expert_loop_bit_for_bit(name, dtype, monkeypatch):
    """The CPU loop's W4A4 (+RAC) operands built once per layer call (``share_operands``, the default) give
    each expert the outputs of the per-expert loop bit for bit: one token, a masked slot, experts without rows,
    an outlier channel, and batches where experts get 1-20 rows."""
    q = _experts(SPECS[name], dtype)
    calls = []
    shared = layers.shared_operand_experts
    monkeypatch.setattr(layers, "shared_operand_experts", lambda *a, **k: calls.append(1) or shared(*a, **k))
    for seed, t in [(1, T), (2, 1), (3, 7), (4, 97)]:
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(t, H, generator=g) * (1 + 8 * torch.rand(t, 1, generator=g))).to(dtype)
        x[:, 3] *= 20
        idx = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(t)])
        idx[0, -1] = E  # a masked slot
        w = torch.rand(t, K_TOP, generator=g).to(dtype)
        q.grouped, q.share_operands = False, False
        with torch.no_grad():
            want = q(x, idx, w)
        q.share_operands = True
        n = len(calls)
        with torch.no_grad():
            got = q(x, idx, w)
        assert len(calls) == n + 1, "the shared-operand loop did not run"
        assert torch.equal(got, want), f"{name} {dtype} T={t}: {(got.float() - want.float()).abs().max()}"


def test_shared_operands_only_where_the_loop_is_exact(monkeypatch):
    """The shared-operand loop runs only for the rollout side's canonical NVFP4 activations with dynamic RAC
    or none, without gradients: static RAC (per-expert statistics), FP8 and the trainer side keep the loop."""
    monkeypatch.setattr(layers, "shared_operand_experts",
                        lambda *a, spec, **k: pytest.fail(f"shared operands for {spec.describe()}"))
    x, idx, w = _inputs(torch.float32)
    for name in ("rac50-static", "fp8-row", "w4a16", "bf16"):
        q = _experts(SPECS[name], torch.float32)
        q.grouped = False
        with torch.no_grad():
            q(x, idx, w)
    q = _experts(SPECS["rac50"], torch.float32)
    q.grouped = False
    q(x, idx, w)  # grad mode on: the loop (the trainer's path has gradients)
    q.share_operands = False
    with torch.no_grad():
        q(x, idx, w)


def test_grouped_masked_token_gets_only_its_valid_experts():
    q = _experts(SPECS["w4a4"], torch.float32)
    x, idx, w = _inputs(torch.float32)
    idx[7] = E  # every slot of token 7 masked
    y, _ = _run(q, x, idx, w, True)
    assert torch.equal(y[7], torch.zeros_like(y[7]))


@pytest.mark.parametrize("per_token", [False, True])
def test_padded_quantizer_is_bit_exact_per_expert(per_token):
    """The padded block's QDQ equals each expert's own [c_e, K] QDQ bit for bit (zero rows change no amax)."""
    x, idx, w = _inputs(torch.float32)
    layout = grouped.expert_layout(idx, w, E)
    xp = grouped.pad_rows(x, layout, E)
    got = grouped._nvfp4_qdq(xp, per_token)
    for e in range(E):
        c = int(layout.counts[e])
        if c:
            want = ops.nvfp4_qdq(x[layout.tok[layout.expert == e]], per_token=per_token)
            assert torch.equal(got[e, :c], want), f"expert {e}"
        assert torch.equal(got[e, c:], torch.zeros_like(got[e, c:]))


def test_layout_and_padding_policy():
    idx = torch.tensor([[0, 2], [2, 0], [1, 3], [3, 3]])  # token 3 hits expert 3 twice (slot-level view)
    w = torch.full(idx.shape, 0.5)
    lay = grouped.expert_layout(idx, w, 4)
    assert lay.counts.tolist() == [2, 1, 2, 3] and lay.capacity == 3
    assert lay.tok.tolist() == [0, 1, 2, 0, 1, 2, 3, 3]
    assert lay.pos.tolist() == [0, 1, 0, 0, 1, 0, 1, 2]
    # imbalanced routing (every token on one expert) is not worth padding with many experts
    many = grouped.expert_layout(torch.zeros(64, 1, dtype=torch.long), torch.ones(64, 1), 32)
    assert not grouped.worth_padding(many, 32, pad_limit=8.0)
    assert grouped.worth_padding(lay, 4, pad_limit=8.0)


def test_grouped_never_on_the_trainer_side_or_with_grad():
    spec = SPECS["w4a4"]
    torch.manual_seed(0)
    ex = MoEExperts(E, H, INTER)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.1)
    tr = QuantizedExperts(ex, spec, side="trainer", weight_dtype=torch.bfloat16)
    tr.grouped = True
    x = torch.randn(T, H, requires_grad=True)
    assert not tr._use_grouped(x)
    ro = _experts(spec, torch.float32)
    ro.grouped = True
    assert ro._use_grouped(x.detach())
    assert not ro._use_grouped(x)  # a grad-requiring input keeps the differentiable loop
    ro.grouped = None
    assert not ro._use_grouped(x.detach())  # auto: CUDA only
    assert not grouped.supports(LinearSpec.of(weight="nvfp4", act="nvfp4", nvfp4_mode="torchao"))
    assert not grouped.supports(LinearSpec.of(weight="fp8", act="fp8", fp8_scheme="tensor"))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_grouped_triton_quantizer_matches_reference():
    """The padded 3-D QDQ with a per-expert amax through the Triton kernel (interpreter on the CPU)."""
    x, idx, w = _inputs(torch.float32)
    xp = grouped.pad_rows(x, grouped.expert_layout(idx, w, E), E)
    if torch.cuda.is_available():
        xp = xp.cuda()
    with dispatch.kernels("reference"):
        want = grouped._nvfp4_qdq(xp, False)
    with dispatch.kernels("triton"):
        got = grouped._nvfp4_qdq(xp, False)
    assert torch.equal(got, want)


def test_expert_path_is_a_recipe_field():
    """The rollout's expert path comes from ``Recipe.expert_path`` (recorded with the recipe in a run's
    config.yaml), not from the environment; auto = grouped on CUDA tensors only."""
    from quads.model.config import ModelConfig
    from quads.model.transformer import MoEForCausalLM
    from quads.quant import get_recipe, quantize_model

    cfg = ModelConfig(vocab_size=32, hidden_size=H, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
                      n_experts=E, top_k=K_TOP, moe_intermediate_size=INTER, max_seq_len=16)
    x = torch.randn(3, H)
    for path, want in (("grouped", True), ("loop", False), ("auto", False)):  # auto on a CPU tensor: the loop
        model = MoEForCausalLM(cfg).requires_grad_(False)
        quantize_model(model, get_recipe("nvfp4", expert_path=path), side="rollout")
        assert bool(model.model.layers[0].mlp.experts._use_grouped(x)) is want, path
    with pytest.raises(ValueError, match="expert_path"):
        get_recipe("nvfp4", expert_path="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs the same checks above)")
@pytest.mark.parametrize("name", ["bf16", "w4a4", "rac50", "rac25-token", "rac50-static", "fp8-row"])
def test_grouped_matches_loop_cuda(name):
    """On CUDA (Triton quantizers, cuBLAS bmm) the default path is the grouped one; it matches the loop."""
    q = _experts(SPECS[name], torch.bfloat16).cuda()
    x, idx, w = (t.cuda() for t in _inputs(torch.bfloat16))
    q.grouped = None
    assert q._use_grouped(x)
    y_grp, st_grp = _run(q, x, idx, w, None)
    y_loop, st_loop = _run(q, x, idx, w, False)
    scale = y_loop.float().abs().max().item()
    assert (y_grp.float() - y_loop.float()).abs().max().item() <= 8e-3 * scale
    for (sq0, c0), (sq1, c1) in zip(st_loop, st_grp, strict=True):
        assert torch.equal(c0, c1)
        torch.testing.assert_close(sq0, sq1, rtol=1e-12, atol=0)
