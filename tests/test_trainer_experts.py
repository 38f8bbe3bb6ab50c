"""The trainer's experts without the loop (``moe.sorted_expert_mlp``: grouped GEMMs over the slots
sorted by expert) against the per-expert loop, the reference: outputs and gradients of the inputs, the
router weights and the master weights, BF16 and W4A16-QAT, with routes replayed. On this CPU both run
the same GEMM kernels and agree bit for bit; the bounds allow for the GEMMs' accumulation order
(CUTLASS grouped vs cuBLAS on a GPU): fp32 1e-5 relative to each tensor's largest entry, BF16 outputs
a few BF16 ulps (2^-7 relative)."""

import copy

import pytest
import torch

from quads.model import ModelConfig, MoEForCausalLM, moe
from quads.model.moe import MoEExperts
from quads.quant import Recipe, quantize_model
from quads.quant.layers import QuantizedExperts
from quads.quant.recipe import LinearSpec
from quads.rl.logprobs import SequenceBatch, forward_logprobs

E, H, INTER, T, K = 8, 32, 16, 13, 2
SPECS = {"bf16": LinearSpec(), "w4a16-qat": LinearSpec.of(weight="nvfp4")}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    scale = want.abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert torch.isfinite(got).all(), f"{what}: non-finite entries"
    assert err <= rel * scale, f"{what}: max |grouped - loop| = {err:.3g} > {rel:g} x max |loop| = {scale:.3g}"


def _experts(spec: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    ex = MoEExperts(E, H, INTER)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.1)
    torch.nn.init.normal_(ex.down_proj, std=0.1)
    return ex if spec is None else QuantizedExperts(ex, SPECS[spec], side="trainer", weight_dtype=torch.bfloat16)


def _run(m: torch.nn.Module, x0, idx, w0, autocast: bool):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = m(x, idx, w)
    (y.float() * torch.linspace(-1, 1, H, device=x.device)).sum().backward()
    return {"out": y.detach(), "x.grad": x.grad, "router_w.grad": w.grad,
            "gate_up.grad": m.gate_up_proj.grad, "down.grad": m.down_proj.grad}


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=CUDA)]  # CUDA: BF16 only


@pytest.mark.parametrize(("device", "autocast"), CASES, ids=["cpu-fp32", "cpu-bf16-autocast", "cuda-bf16-autocast"])
@pytest.mark.parametrize("spec", [None, "bf16", "w4a16-qat"], ids=lambda s: f"spec-{s}")
def test_sorted_experts_match_loop(spec, device, autocast):
    """Forward and backward of ``MoEExperts`` (spec None) and the trainer's ``QuantizedExperts``; a
    masked slot (id E) and an expert no token visits included. On CUDA the loop is cuBLAS and the
    grouped path CUTLASS, whose BF16 roundings differ and compound through the backward: there both
    are measured against the fp32 loop, and the grouped path's error may be at most twice the loop's
    (plus 2^-10 of the tensor's scale)."""
    torch.manual_seed(1)
    n = T if device == "cpu" else 301
    x0, w0 = torch.randn(n, H, device=device), torch.rand(n, K, device=device)
    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(n)]).to(device)  # expert E-1: no token
    idx[4, 1] = E  # a masked slot
    res = {}
    for grouped in (False, True):
        m = copy.deepcopy(_experts(spec)).to(device)
        m.grouped = grouped
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):  # the compute dtype decides
            assert moe.use_sorted(grouped, x0, m.gate_up_proj, m.down_proj) == grouped
        if device == "cuda" and not grouped:
            res["fp32"] = _run(m, x0, idx, w0, False)  # the reference of the CUDA bounds
            m.zero_grad(set_to_none=True)
        res[grouped] = _run(m, x0, idx, w0, autocast)
    for name, want in res[False].items():
        what = f"{name} (spec {spec}, {device}, autocast {autocast})"
        if device == "cuda":
            ref = res["fp32"][name].float()
            err_loop = (want.float() - ref).abs().max().item()
            err = (res[True][name].float() - ref).abs().max().item()
            bound = 2 * err_loop + 2**-10 * ref.abs().max().item()
            assert err <= bound, f"{what}: grouped error vs fp32 {err:.3g} > 2 x loop's {err_loop:.3g} + floor"
        else:
            _close(res[True][name], want, TOL[torch.bfloat16 if autocast else torch.float32], what)
    for p in ("gate_up.grad", "down.grad"):
        assert torch.equal(res[True][p][E - 1], torch.zeros_like(res[True][p][E - 1])), f"{p}: unvisited expert"


def test_qat_straight_through_gradient():
    """QAT on the grouped path: the forward multiplies QDQ(W); the master weight's gradient is the
    unquantized product's gradient evaluated at QDQ(W) (for y = x @ Wop.T: dL/dWop = g.T @ x)."""
    m = _experts("w4a16-qat")
    m.grouped = True
    x = torch.randn(T, H)
    idx = torch.arange(T)[:, None] % E  # one expert per token
    w = torch.ones(T, 1)
    m(x, idx, w).sum().backward()
    wq = m.stores["gate_up_proj"].get().float()
    assert not torch.equal(wq, m.gate_up_proj.detach())
    e, rows = 3, idx[:, 0] == 3
    h = x[rows] @ wq[e].T
    gate, up = h.chunk(2, -1)
    g_act = m.stores["down_proj"].get().float()[e].sum(0)  # dL/d(silu(gate) * up) for a sum loss
    s = torch.sigmoid(gate)
    g_h = torch.cat([g_act * up * s * (1 + gate * (1 - s)), g_act * torch.nn.functional.silu(gate)], -1)
    _close(m.gate_up_proj.grad[e], g_h.T @ x[rows], 1e-5, "gate_up master grad")


def _tiny(spec: LinearSpec, grouped: bool) -> MoEForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", n_layers=2, vocab_size=100, dtype="float32")
    model = MoEForCausalLM(cfg)
    quantize_model(model, Recipe("t", trainer=spec, expert_path="grouped" if grouped else "loop"), side="trainer",
                   verbose=False)
    return model


@pytest.mark.parametrize("recipe", sorted(SPECS))
def test_trainer_step_grouped_matches_loop(recipe):
    """A GRPO-shaped step on the tiny model (BF16 autocast over fp32 masters, routes replayed): the
    per-token log-probs and every parameter's gradient (router, experts, attention, embeddings)."""
    B, S, P = 3, 12, 4
    ids = torch.randint(4, 100, (B, S), generator=torch.Generator().manual_seed(2))
    batch = SequenceBatch(ids, torch.ones(B, S, dtype=torch.bool), P, torch.ones(B, S - P, dtype=torch.bool))
    adv = torch.tensor([[1.0], [-0.5], [0.25]])
    with torch.no_grad():
        routing = _tiny(SPECS[recipe], False)(ids, return_routing=True).routing
    res = {}
    for grouped in (False, True):
        model = _tiny(SPECS[recipe], grouped)
        experts = model.model.layers[0].mlp.experts
        assert isinstance(experts, QuantizedExperts) and experts._use_sorted(torch.zeros(1, 128)) == grouped
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward_logprobs(model, batch, routing, 1.0, return_routing=True)
        assert torch.equal(out.routing, routing)
        (-(out.logprobs * adv).sum() + out.aux_loss).backward()
        res[grouped] = {"logprobs": out.logprobs.detach(), **{n: p.grad for n, p in model.named_parameters()}}
    assert res[True].keys() == res[False].keys()
    assert res[False]["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    for name, want in res[False].items():
        _close(res[True][name], want, 2**-6, f"{recipe}: {name}")


@CUDA
@pytest.mark.parametrize("recipe", sorted(SPECS))
def test_sorted_experts_no_host_sync_cuda(recipe):
    """Forward and backward of the trainer's experts on CUDA under BF16 autocast without a host sync."""
    m = _experts(recipe).cuda()
    x = torch.randn(256, H, device="cuda", requires_grad=True)
    idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(256)])
    w = torch.rand(256, K, device="cuda", requires_grad=True)
    m.stores["gate_up_proj"].get(), m.stores["down_proj"].get()  # the per-step QDQ cache, filled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            used = m._use_sorted(x)  # under autocast, as the trainer's forward runs
            y = m(x, idx, w)
        y.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert used and torch.isfinite(x.grad).all() and torch.isfinite(m.gate_up_proj.grad).all()


@CUDA
@pytest.mark.parametrize("fresh_tables", [False, True], ids=["cached-tables", "fresh-tables"])
def test_grouped_qat_refresh_cuda_no_host_sync_same_bits(fresh_tables):
    """The trainer's per-step QAT cache refresh on CUDA (Triton): every changed expert stack of every layer
    in one grouped launch pair per weight shape (``refresh_stale``), no host sync (a new address table
    included: pinned, copied without a sync), each cached ``QDQ(W)`` bit for bit ``quantize_weight``'s
    operand (the per-weight refresh and the rollout's quantize-dequantize), no codes kept."""
    from quads.kernels import weight_qdq
    from quads.quant import ops
    from quads.quant.layers import refresh_stale

    model = _tiny(SPECS["w4a16-qat"], True).cuda()
    stores = [s for m in model.modules() if isinstance(m, QuantizedExperts) for s in m.stores.values()]
    refresh_stale(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)  # an optimizer step's in-place update
    if fresh_tables:
        weight_qdq._TABLES.clear()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        refresh_stale(model)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(stores) == 4 and all(s.n_quantize == 2 and s.packed is None for s in stores)
    for s in stores:
        assert torch.equal(s.w_q, ops.quantize_weight(s.param, s.spec, s.dtype)[0]), s.name
