"""FP8 W8A8 rollout GEMMs on FP8 tensor cores (quads.quant.fp8_scaled): numerics against fp64, the weight store
that keeps only the FP8 codes and scales, and the rollout engine on that path.

On the CPU the tensor-core branch is taken by patching ``fp8_scaled.on_tensor_cores``: ``torch._scaled_mm`` runs
on the CPU too (the dense layers' call convention), and ``torch._scaled_grouped_mm``, CUDA only, is stood in for by
``_grouped_stand_in`` (its documented contract: codes ``[M, K]`` times ``[E, K, N]`` column-major, row scales
``[M]`` and ``[E, N]``, int32 group ends). The GPU tests at the end run the real kernels (skipped without sm90).
"""

import pytest
import torch

from quads.formats import fp8
from quads.model import ModelConfig, MoEForCausalLM
from quads.model.moe import static_routes
from quads.model.tokenizer import CharTokenizer
from quads.quant import fp8_scaled, ops, quantize_model
from quads.quant.fp8_linear import fp8_linear
from quads.quant.layers import QuantizedExperts
from quads.quant.recipe import LinearSpec, Recipe
from quads.rollout import RolloutEngine, SamplingParams
from quads.rollout.score import score_rollout

SPEC = LinearSpec.of(weight="fp8", act="fp8")
U32 = 2.0**-24  # fp32 unit roundoff
U_BF16 = 2.0**-8
HOPPER_FP8_ACC = 2.0**-11  # the GPU tests' allowance for Hopper's FP8 accumulation (test_gpu_kernels_are_the_fp8_product)


def _bound(a: fp8.FP8Tensor, w: fp8.FP8Tensor, sw_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``gamma_{K+2}`` times ``sum_k |q_x q_w| s_x s_w``: fp32 accumulation of K exact products and the two
    scale multiplications (fp64)."""
    k = a.data.shape[-1]
    mag = a.data.double().abs() @ (w.data.double().abs().T if sw_rows is None else w.data.double().abs().mT)
    return (k + 2) * U32 / (1 - (k + 2) * U32) * mag


def _exact(a: fp8.FP8Tensor, w: fp8.FP8Tensor) -> torch.Tensor:
    return fp8.scaled_mm_reference(a, w, out_dtype=torch.float64)


def _grouped_stand_in(a, b, scale_a, scale_b, offs=None, out_dtype=torch.bfloat16):
    """CPU stand-in for ``torch._scaled_grouped_mm`` (2-D codes x 3-D codes): rows ``[offs[e-1], offs[e])`` times
    ``b[e]`` ``[K, N]``, fp32 products, both row scales, ``out_dtype``; rows past the last end left unwritten (NaN)."""
    assert a.dtype == b.dtype == fp8.F8E4M3_DTYPE and a.dim() == 2 and b.dim() == 3 and b.stride(-2) == 1
    assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2]) and offs.dtype == torch.int32
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=out_dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        y = (a[start:end].float() @ b[e].float()) * scale_a[start:end, None] * scale_b[e][None]
        out[start:end] = y.to(out_dtype)
        start = end
    return out


def _dense_stand_in(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, **_):
    """CPU stand-in for ``torch._scaled_mm`` where the CPU build takes per-tensor scales only (torch 2.11): codes
    ``[M, K]`` times ``[K, N]`` column-major, scales ``[]`` / ``[M, 1]`` and ``[]`` / ``[1, N]``."""
    assert a.dtype == b.dtype == fp8.F8E4M3_DTYPE and b.stride(0) == 1
    assert scale_a.numel() in (1, a.shape[0]) and scale_b.numel() in (1, b.shape[1])
    return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)


def _cpu_rowwise_scaled_mm() -> bool:
    a = torch.ones(16, 16).to(fp8.F8E4M3_DTYPE)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.fixture
def tensor_cores(monkeypatch):
    """The tensor-core branch on the CPU (module docstring); ``torch._scaled_mm`` itself where this CPU build takes
    row scales (torch 2.13), its stand-in where it does not."""
    monkeypatch.setattr(fp8_scaled, "on_tensor_cores", lambda t, weight_dims=2: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _grouped_stand_in, raising=False)
    if not _cpu_rowwise_scaled_mm():
        monkeypatch.setattr(torch, "_scaled_mm", _dense_stand_in)


def _routes(T=24, k=2, E=5, masked=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx.view(-1)[torch.randperm(T * k, generator=g)[:masked]] = E  # masked slots
    return idx, static_routes(idx, E)


@pytest.mark.parametrize("scheme", ["row", "tensor"])
def test_linear_is_the_fp8_product_within_fp32_accumulation(scheme, tensor_cores):
    """``linear`` (``torch._scaled_mm`` on the CPU) and its reference = the exact product of the codes and scales,
    within fp32 accumulation plus BF16 output rounding; the codes are ``fp8.quantize``'s."""
    torch.manual_seed(0)
    x = (torch.randn(37, 96) * torch.rand(37, 1) * 4).bfloat16()
    x[3] = 0  # an all-zero row: scale 1, zero output
    spec = LinearSpec.of(weight="fp8", act="fp8", fp8_scheme=scheme)
    w = fp8_scaled.quantize_weight(torch.randn(48, 96), spec, torch.bfloat16)
    a = fp8.quantize(x, granularity=scheme)
    exact = _exact(a, w)
    bound = _bound(a, w) + U_BF16 * exact.abs()
    got = fp8_scaled.linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 48)
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(got[3], torch.zeros(48, dtype=torch.bfloat16))
    ref = fp8.scaled_mm_reference(a, w)
    assert ((ref.double() - exact).abs() <= _bound(a, w)).all()
    assert fp8_scaled.linear(x[:0], w).shape == (0, 48)


def test_weight_codes_dequantize_to_the_rollout_operand():
    """The codes and scales kept for the scaled GEMMs dequantize to ``ops.quantize_weight``'s operand bit for bit
    (what weight-sync fingerprints and diagnostics read), for a linear and an expert stack."""
    torch.manual_seed(1)
    for w in (torch.randn(48, 64), torch.randn(3, 32, 64)):
        q = fp8_scaled.quantize_weight(w, SPEC, torch.bfloat16)
        assert q.data.dtype == fp8.F8E4M3_DTYPE and q.scale.shape == (*w.shape[:-1], 1)
        assert torch.equal(fp8.dequantize(q, torch.bfloat16), ops.quantize_weight(w, SPEC, torch.bfloat16)[0])
    with pytest.raises(ValueError, match="schemes"):
        fp8_scaled.quantize_weight(torch.randn(3, 32, 64), LinearSpec.of(weight="fp8", act="fp8", fp8_scheme="tensor"),
                                   torch.bfloat16)


def test_grouped_is_each_rows_expert_product(tensor_cores):
    """``grouped`` over rows sorted by expert (masked slots last): each row = its token's FP8 product with its
    expert's codes, within fp32 accumulation and BF16 rounding, masked rows zero, for the stand-in kernel and the
    reference; the two agree to BF16 rounding."""
    torch.manual_seed(2)
    T, k, E, K, N = 24, 2, 5, 64, 40
    idx, routes = _routes(T, k, E)
    x = (torch.randn(T, K) * 3).bfloat16()
    xs = x[routes.order // k]
    w = fp8_scaled.quantize_weight(torch.randn(E, N, K), SPEC, torch.bfloat16)
    got = fp8_scaled.grouped(xs, w, routes)
    a = fp8.quantize(xs, granularity="row")
    ref = fp8_scaled.reference_grouped(a, w, routes)
    valid = routes.valid
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid])) and torch.equal(ref[~valid], torch.zeros_like(ref[~valid]))
    for i in torch.nonzero(valid).flatten().tolist():
        e = int(routes.expert[i])
        we = fp8.FP8Tensor(w.data[e], w.scale[e], w.data[e].shape, torch.bfloat16, "row")
        ai = fp8.FP8Tensor(a.data[i:i + 1], a.scale[i:i + 1], a.data[i:i + 1].shape, torch.bfloat16, "row")
        exact = _exact(ai, we)[0]
        bound = _bound(ai, we)[0]
        assert ((ref[i].double() - exact).abs() <= bound).all()
        assert ((got[i].double() - exact).abs() <= bound + U_BF16 * exact.abs()).all()
    with pytest.raises(ValueError, match="row-scaled"):
        fp8_scaled.grouped(xs, fp8_scaled.quantize_weight(torch.randn(N, K), SPEC, torch.bfloat16), routes)


def test_the_emulated_path_is_within_its_rounding_of_the_scaled_product():
    """The emulated rollout (``fp8_linear``: fp32 GEMM of QDQ(x) and the BF16 QDQ(W)) against the scaled GEMM's
    reference: the same codes, so they differ only by the emulation's rounding of each dequantized operand
    (the weight to BF16: 2^-8 relative, the activation's ``q * s``: 2^-24) and the accumulation order."""
    torch.manual_seed(3)
    x = torch.randn(16, 128).bfloat16()
    w = torch.randn(32, 128)
    w_q = ops.quantize_weight(w, SPEC, torch.bfloat16)[0]
    emulated = fp8_linear(x.float(), w.bfloat16().float(), scheme="row", w_q=w_q.float())
    q = fp8_scaled.quantize_weight(w, SPEC, torch.bfloat16)
    a = fp8.quantize(x, granularity="row")
    exact = _exact(a, q)
    slack = (U_BF16 + 2 * U32) * (a.data.double().abs() * a.scale.double()) @ (q.data.double().abs() * q.scale.double()).T
    assert ((emulated.double() - exact).abs() <= _bound(a, q) + slack).all()
    assert not torch.equal(emulated.double(), exact)  # the bound is not vacuous: they do differ


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=128, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
               top_k=2, moe_intermediate_size=32, max_seq_len=64, dtype="bfloat16")
    return MoEForCausalLM(ModelConfig(**cfg))


def test_rollout_stores_keep_only_codes_and_the_engine_rescores(tensor_cores, monkeypatch):
    """With FP8 tensor cores the rollout's FP8 stores keep codes and scales and no BF16 operand, decode the same
    operand as the emulated stores, update in place on re-sync; the experts and the attention projections run
    the scaled GEMMs; the engine's batch rescores bit for bit and stays close to the emulated engine's."""
    recipe = Recipe("t", rollout=SPEC, targets=("*.mlp.experts", "*.self_attn.*_proj"))
    model = _model()
    quantize_model(model, recipe, side="rollout", verbose=False)
    stores = [s for m in model.modules() if hasattr(m, "stores") for s in m.stores.values()]
    assert len(stores) == 2 * 2 + 4 * 2
    for s in stores:
        assert s.fp8 is not None and s.w_q is None and s.kernel is None
        assert torch.equal(s.get(), ops.quantize_weight(s.param, SPEC, torch.bfloat16)[0])
    calls = {"linear": 0, "grouped": 0}
    for name in calls:
        real = getattr(fp8_scaled, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(fp8_scaled, name, counted)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True)
    prompts = ["1+2=", "a longer prompt:", "x"]
    batch = RolloutEngine(model, CharTokenizer(), decode="static", moe_dispatch="device").generate(prompts, params)
    assert calls["grouped"] > 0 and calls["linear"] > 0
    res = score_rollout(model, batch)
    assert torch.equal(res.logprobs, batch.logprobs) and torch.equal(res.routing, batch.routing)
    monkeypatch.setattr(fp8_scaled, "on_tensor_cores", lambda t, weight_dims=2: False)
    emulated = _model()
    quantize_model(emulated, recipe, side="rollout", verbose=False)
    assert all(s.fp8 is None for m in emulated.modules() if hasattr(m, "stores") for s in m.stores.values())
    ref = score_rollout(emulated, batch)  # the same tokens through the emulated GEMMs
    assert (ref.routing != batch.routing).float().mean() < 0.05  # a near-tie may route differently
    assert (ref.logprobs - batch.logprobs).abs().max() < 0.05  # 0.005 measured: BF16 rounding, not a bug's size
    # re-sync: the same storages, new values
    monkeypatch.setattr(fp8_scaled, "on_tensor_cores", lambda t, weight_dims=2: True)
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    store = experts.stores["gate_up_proj"]
    data, scale = store.fp8.data, store.fp8.scale
    before = scale.clone()
    with torch.no_grad():
        experts.gate_up_proj.mul_(2.5)
    experts.refresh()
    assert store.fp8.data is data and store.fp8.scale is scale
    assert torch.equal(store.get(), ops.quantize_weight(experts.gate_up_proj, SPEC, torch.bfloat16)[0])
    assert not torch.equal(scale, before)


def test_without_tensor_cores_the_stores_keep_the_emulated_operand():
    """On the CPU (no FP8 tensor cores), and under the ``reference`` kernel backend, the FP8 stores keep the
    dequantized operand and the emulated GEMMs run."""
    from quads.kernels import dispatch

    model = _model()
    quantize_model(model, Recipe("t", rollout=SPEC), side="rollout", verbose=False)
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    assert experts.stores["gate_up_proj"].fp8 is None and experts.stores["gate_up_proj"].w_q is not None
    assert not fp8_scaled.on_tensor_cores(torch.zeros(1))
    with dispatch.kernels("reference"):
        assert not fp8_scaled.on_tensor_cores(torch.zeros(1))
    assert not fp8_scaled.supports(LinearSpec.of(weight="fp8", act="fp8", error_scale=2.0), 2)
    assert not fp8_scaled.supports(LinearSpec.of(weight="fp8", act="none"), 2)
    assert fp8_scaled.supports(LinearSpec.of(weight="fp8", act="fp8", fp8_scheme="tensor"), 2)
    assert not fp8_scaled.supports(LinearSpec.of(weight="fp8", act="fp8", fp8_scheme="tensor"), 3)


# ------------------------------------------------------------------------------------------------ GPU

sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                          reason="needs FP8 tensor cores and the grouped FP8 GEMM (sm90)")


@sm90
@pytest.mark.parametrize("shape", [(128, 1024, 1024), (1024, 512, 1024), (1024, 1024, 512)])
def test_gpu_kernels_are_the_fp8_product(shape):
    """``torch._scaled_mm`` and ``torch._scaled_grouped_mm`` at decode sizes (64 experts, top-8, masked slots)
    within BF16 rounding of the exact product plus Hopper's FP8 accumulation, and inside a CUDA graph the same
    bits. Hopper's FP8 MMA keeps fewer accumulator bits than fp32 (the kernels promote to fp32 between K blocks):
    run 77 measured at most 2^-13.2 of ``sum_k |q_x q_w| s_x s_w`` beyond the BF16 rounding at these shapes
    (``scripts/device_calls/fp8_accum_probe.py``); the test allows ``HOPPER_FP8_ACC`` = 2^-11."""
    M, N, K = shape
    torch.manual_seed(4)
    x = (torch.randn(M, K, device="cuda") * 2).bfloat16()
    w = fp8_scaled.quantize_weight(torch.randn(N, K, device="cuda"), SPEC, torch.bfloat16)
    a = fp8.quantize(x, granularity="row")
    got = fp8_scaled.linear(x, w)
    exact = _exact(a, w)
    mag = (a.data.double().abs() @ w.data.double().abs().T) * a.scale.double() * w.scale.double().T
    assert ((got.double() - exact).abs() <= HOPPER_FP8_ACC * mag + U_BF16 * exact.abs()).all()
    E, k = 64, 8
    T = M // k
    idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    idx.view(-1)[:5] = E
    routes = static_routes(idx, E)
    ws = fp8_scaled.quantize_weight(torch.randn(E, N, K, device="cuda"), SPEC, torch.bfloat16)
    xs = x[: T][routes.order // k]
    y = fp8_scaled.grouped(xs, ws, routes)
    a = fp8.quantize(xs, granularity="row")
    sw = ws.scale.squeeze(-1)[routes.expert.clamp_max(E - 1)].double()
    codes = ws.data.double()
    exact = routes.unpad(torch.bmm(routes.pad(a.data.double()), codes.mT)) * a.scale.double() * sw
    mag = routes.unpad(torch.bmm(routes.pad(a.data.double().abs()), codes.abs().mT)) * a.scale.double() * sw
    assert torch.equal(y[~routes.valid], torch.zeros_like(y[~routes.valid]))
    assert ((y.double() - exact).abs() <= HOPPER_FP8_ACC * mag + U_BF16 * exact.abs()).all()
    graph = torch.cuda.CUDAGraph()
    out = fp8_scaled.grouped(xs, ws, routes)  # warm
    with torch.cuda.graph(graph):
        out = fp8_scaled.grouped(xs, ws, routes)
    graph.replay()
    assert torch.equal(out, y)


@sm90
def test_gpu_rollout_stores_keep_only_fp8_codes():
    model = _model().cuda()
    quantize_model(model, Recipe("t", rollout=SPEC), side="rollout", verbose=False)
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    for s in experts.stores.values():
        assert s.fp8 is not None and s.w_q is None and s.fp8.data.dtype == fp8.F8E4M3_DTYPE
        assert torch.equal(s.get(), ops.quantize_weight(s.param, SPEC, torch.bfloat16)[0])
