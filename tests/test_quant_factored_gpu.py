"""GPU only (skipped without CUDA): the factored W4A4(+RAC) expert path on sorted rows with BF16 tensor-core
GEMMs (``torch._grouped_mm``) and the Triton quantize-to-values kernel.

Against the fp32 emulation on the padded layout (``grouped.grouped_linear``): the same quantized
operands (bit for bit, tests/test_quant_factored.py), so the outputs differ by the fp32 accumulation
bound plus the BF16 rounding of each grouped-GEMM output (2^-8 relative per term) and of the result;
no host sync; a CUDA graph replays it bit for bit. With the packed weight operand (the W4A16 kernels,
what the rollout layers hold on the GPU): the decoded weight is the BF16 QDQ(W) bit for bit and the GEMM
equals torch._grouped_mm's to fp32 summation order (one BF16 ulp per output). Run on the device:
`python3 -m pytest tests/test_quant_factored_gpu.py tests/test_quant_factored.py tests/test_engine_gpu.py -q`.
"""

import pytest
import torch

from quads.kernels import dispatch, w4a16
from quads.model.moe import MoEExperts, grouped_mm, static_routes
from quads.quant import factored, grouped, ops
from quads.quant.layers import QuantizedExperts
from quads.quant.rac import rac_channels
from quads.quant.recipe import LinearSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (BF16 grouped GEMM)")

E, K, N, T, TOP = 8, 256, 128, 64, 2
SPECS = {
    "w4a4": LinearSpec.of(weight="nvfp4", act="nvfp4"),
    "rac50": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5),
    "rac25-token": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.25, act_scale="token"),
    "rac50-static": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, rac_selection="static"),
}


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    x[:, 7] *= 30
    idx = torch.stack([torch.randperm(E, generator=g)[:TOP] for _ in range(T)])
    idx[3] = E  # routed nowhere
    idx[10, 1] = E
    w = torch.randn(E, N, K, generator=g) * 0.1
    order = torch.stack([torch.randperm(K, generator=g) for _ in range(E)])
    idx, x, w, order = idx.cuda(), x.cuda().bfloat16(), w.cuda(), order.cuda()
    routes = static_routes(idx, E)
    w_q, _ = ops.quantize_weight(w, LinearSpec.of(weight="nvfp4"), torch.bfloat16)
    return x[routes.order // TOP], routes, w, w_q, order


@pytest.mark.parametrize("name", list(SPECS))
def test_sorted_linear_matches_fp32_emulation_cuda(name):
    spec = SPECS[name]
    xs, routes, w, w_q, order = _case()
    assert factored.gemm_dtype(w_q) == torch.bfloat16
    got = grouped.sorted_linear(xs, routes, w_q, spec, static_order=order)
    ref = routes.unpad(grouped.grouped_linear(routes.pad(xs), w, w_q, spec, static_order=order))
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    valid = routes.valid
    scale = ref.float().abs().max().item()
    # fp32 accumulation bound (~K * 2^-24, negligible here) + BF16 GEMM outputs + the final BF16 cast
    err = (got.float() - ref.float()).abs()
    assert (err <= 2**-7 * ref.float().abs() + 1e-3 * scale).all(), f"{name}: max err {err.max().item()}"
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))


@pytest.mark.parametrize("name", ["w4a4", "rac50"])
def test_sorted_linear_has_no_host_sync_and_replays_in_a_graph(name):
    xs, routes, _, w_q, _ = _case(1)
    spec = SPECS[name]
    want = grouped.sorted_linear(xs, routes, w_q, spec)  # first call: Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = grouped.sorted_linear(xs, routes, w_q, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, want)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped.sorted_linear(xs, routes, w_q, spec)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = grouped.sorted_linear(xs, routes, w_q, spec)
    graph.replay()
    assert torch.equal(out, want)


@pytest.mark.parametrize("name", list(SPECS))
def test_forward_static_matches_loop_cuda(name):
    torch.manual_seed(0)
    ex = MoEExperts(E, K, 64)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.1)
    torch.nn.init.normal_(ex.down_proj, std=0.1)
    q = QuantizedExperts(ex.bfloat16().requires_grad_(False), SPECS[name], side="rollout",
                         weight_dtype=torch.bfloat16).cuda()
    q.refresh()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, K, generator=g).bfloat16().cuda()
    wts, idx = torch.softmax(torch.randn(T, E, generator=g), -1).topk(TOP)
    idx[5] = E
    idx, wts = idx.cuda(), wts.bfloat16().cuda()
    q.grouped = False
    assert all(st.kernel is not None and st.w_q is None for st in q.stores.values())  # the packed weight alone
    with torch.no_grad():
        with dispatch.kernels("reference"):  # the experts loop over the decoded BF16 QDQ(W)
            ref = q(x, idx, wts)
        got = q.forward_static(x, idx, wts)
    scale = ref.float().abs().max().item()
    assert (got.float() - ref.float()).abs().max().item() <= 2e-2 * scale
    assert torch.equal(got[5], torch.zeros_like(got[5]))


@pytest.mark.parametrize("name", ["w4a4", "rac50", "rac25-token"])
def test_dense_w4a4_linear_cuda(name):
    """The dense layer (attention projections when targeted) computes the same factored form with a BF16
    cuBLAS GEMM: close to the fp32 emulation, and no host sync."""
    from quads.formats import nvfp4
    from quads.quant.rac import rac_channels, rac_operands
    from quads.quant.w4a4 import rac_gemm_operands, w4a4_linear

    spec = SPECS[name]
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(32, K, generator=g) * 3).bfloat16().cuda()
    w = torch.randn(N, K, generator=g).cuda()
    w_q = nvfp4.qdq(w.bfloat16())
    kw = dict(rac_ratio=spec.rac_ratio, act_scale=spec.act_scale, w_q=w_q)
    got = w4a4_linear(x, w, **kw)
    xq, rq, s = rac_operands(x, n=rac_channels(K, spec.rac_ratio), act_scale=spec.act_scale)
    a, b = rac_gemm_operands(xq, rq, s, w_q)
    ref = (a @ b.T).to(x.dtype)
    scale = ref.float().abs().max().item()
    assert ((got.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-3 * scale).all()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = w4a4_linear(x, w, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, got)


def _bf16_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """BF16 outputs of two fp32 sums of the same products in different orders: one BF16 ulp apart at most
    (tests/test_kernels_w4a16.py's bound)."""
    a, b = a.double(), b.double()
    bad = (a - b).abs() > b.abs() * 2.0**-7 + b.abs().amax() * 1e-5
    assert not bad.any(), f"{what}: {int(bad.sum())} elements more than 1 bf16 ulp apart"


def _packed(w):
    return w4a16.pack(ops.nvfp4_weight(w, LinearSpec.of(weight="nvfp4"), torch.bfloat16))


@pytest.mark.parametrize("name", list(SPECS))
def test_packed_weight_matches_grouped_mm_cuda(name):
    """The packed operand: decoded bit for bit to the BF16 QDQ(W); the factored GEMM within one BF16 ulp
    of torch._grouped_mm's; sorted_linear within the sum of those ulps over the stacked terms (plus the
    final BF16 cast) of the tensor path, and as close to the fp32 emulation as it."""
    spec = SPECS[name]
    xs, routes, w, w_q, order = _case(3)
    p = _packed(w)
    assert torch.equal(w4a16.dequantize_bf16(p).view(torch.int16), w_q.view(torch.int16))
    segs = factored.Segments.of(routes.expert, E)
    op = factored.operands(xs, segs, n=rac_channels(K, spec.rac_ratio), dtype=torch.bfloat16,
                           per_token=spec.act_scale == "token", selection=spec.rac_selection, static_order=order)
    M, P, _ = op.u.shape
    stacked = grouped.stacked_routes(routes, P)
    y_p = factored.gemm(op.u.reshape(M * P, K), p, stacked)
    y_t = grouped_mm(op.u.reshape(M * P, K), w_q, stacked)
    _bf16_close(y_p, y_t, f"{name}: packed vs torch._grouped_mm")
    got = grouped.sorted_linear(xs, routes, p, spec, static_order=order)
    want = grouped.sorted_linear(xs, routes, w_q, spec, static_order=order)
    terms = (y_t.view(M, P, -1).float() * op.g[..., None]).abs().sum(1)  # sum_p |g_p y_p|
    tol = 2.0**-7 * (terms + want.float().abs()) + 1e-5 * want.float().abs().max()
    assert ((got.float() - want.float()).abs() <= tol).all(), name
    ref = routes.unpad(grouped.grouped_linear(routes.pad(xs), w, w_q, spec, static_order=order))
    scale = ref.float().abs().max().item()
    assert ((got.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-3 * scale).all()
    assert torch.equal(got[~routes.valid], torch.zeros_like(got[~routes.valid]))


@pytest.mark.parametrize("name", ["w4a4", "rac50"])
def test_packed_sorted_linear_no_host_sync_graph_follows_refresh(name):
    """With the packed weight: no host sync, a CUDA graph replays it bit for bit, and a refresh copied into
    the packed tensors (weight sync) reaches the captured graph."""
    xs, routes, w, _, _ = _case(4)
    spec, p = SPECS[name], _packed(w)
    want = grouped.sorted_linear(xs, routes, p, spec)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = grouped.sorted_linear(xs, routes, p, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped.sorted_linear(xs, routes, p, spec)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped.sorted_linear(xs, routes, p, spec)
    graph.replay()
    assert torch.equal(out, want)
    p2 = _packed(-2 * w)
    assert p.copy_(p2)
    graph.replay()
    assert torch.equal(out, grouped.sorted_linear(xs, routes, p2, spec)) and not torch.equal(out, want)


@pytest.mark.parametrize("name", ["w4a4", "rac25-token"])
def test_dense_w4a4_linear_packed_cuda(name):
    """The dense factored call with the packed weight (w4a16.linear_op): within the BF16 ulps of the cuBLAS
    tensor path, no host sync."""
    from quads.quant.w4a4 import w4a4_linear

    spec = SPECS[name]
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(32, K, generator=g) * 3).bfloat16().cuda()
    w = torch.randn(N, K, generator=g).cuda()
    p = _packed(w)
    w_q = w4a16.dequantize_bf16(p)
    kw = dict(rac_ratio=spec.rac_ratio, act_scale=spec.act_scale)
    got, want = w4a4_linear(x, w, w_q=p, **kw), w4a4_linear(x, w, w_q=w_q, **kw)
    scale = want.float().abs().max().item()
    assert ((got.float() - want.float()).abs() <= 2**-7 * want.float().abs() + 1e-3 * scale).all()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = w4a4_linear(x, w, w_q=p, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, got)


@pytest.mark.parametrize("method", ["sort", "count"])
@pytest.mark.parametrize("k", [1024, 256], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("per_token", [False, True], ids=["group", "token"])
def test_fused_rac_operands_bit_exact_cuda(k, per_token, method):
    """The 1b decode shapes (128 tokens x top-8 over 64 experts: M = 1024 sorted rows, masked slots
    included): the fused residual operand (``quads::rac_units``, both selection methods) equals the
    step-by-step path on the same device (torch's CUDA argsort) and the reference backend, byte for byte
    (u, g, channel sets), with exact norm ties (channels 16..31 repeat 0..15)."""
    e, tokens, topk = 64, 128, 8
    g = torch.Generator().manual_seed(k)
    idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
    idx[5, 3] = e  # masked slots
    idx[9] = e
    routes = static_routes(idx.cuda(), e)
    x = torch.randn(tokens * topk, k, generator=g) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=g)]
    x[:, 16:32] = x[:, :16]
    x = x.cuda().bfloat16()
    segs = factored.Segments.of(routes.expert, e)
    for n in (k // 2, 0):  # W4A4 + RAC 50%, and W4A4 alone (the group amax and quantize in one launch)
        kw = dict(n=n, dtype=torch.bfloat16, per_token=per_token)
        got = factored.operands(x, segs, rac_method=method, **kw)
        steps = factored.operands(x, segs, fused_rac=False, fused_amax=False, **kw)
        with dispatch.kernels("reference"):
            ref = factored.operands(x, segs, **kw)
        for want in (steps, ref):
            assert torch.equal(got.u.view(torch.int16), want.u.view(torch.int16))
            assert torch.equal(got.g.view(torch.int32), want.g.view(torch.int32))
            assert (got.channels is None and want.channels is None) or torch.equal(got.channels, want.channels)
    # the calibrated order (quads::rac_static_units, observing as the rollout does): the same bits as the steps
    order = torch.stack([torch.randperm(k, generator=g) for _ in range(e)]).cuda()
    seen = []
    kw = dict(n=k // 2, dtype=torch.bfloat16, per_token=per_token, selection="static", static_order=order,
              observe=lambda r, norms: seen.append(norms))  # fmt: skip
    got = factored.operands(x, segs, **kw)
    steps = factored.operands(x, segs, fused_rac=False, **kw)
    assert torch.equal(got.u.view(torch.int16), steps.u.view(torch.int16))
    assert torch.equal(got.g.view(torch.int32), steps.g.view(torch.int32)) and torch.equal(got.channels, steps.channels)
    assert torch.allclose(seen[0], seen[1], rtol=1e-12, atol=0)


@pytest.mark.parametrize("k,n", [(4096, 2048), (2880, 1440), (1024, 512), (208, 16), (208, 208)], ids=lambda v: str(v))
@pytest.mark.parametrize("per_token", [False, True], ids=["group", "token"])
def test_rac_sort_equals_count_cuda(k, n, per_token):
    """The compiled sort path (xor partner exchange, one row per program; one sorted run, and runs of 128
    channels merged by binary search where K <= 1024) against the count path on the GPU,
    byte for byte (u, S_dec, S): the widest sort (K = 4096, 4096 pairs in one program), K not a power of
    two (2880 = the 20b's hidden size, 208), n = 16 and n = K, empty experts, NaN and inf rows, masked rows,
    and one group of 512 rows."""
    from quads.kernels.rac_select import rac_units

    e, rows = 16, 640
    g = torch.Generator().manual_seed(k + n)
    group = torch.sort(torch.randint(0, e + 1, (rows,), generator=g)).values
    group[(group == 3) | (group == 11)] = 4  # experts 3 and 11 empty (still sorted)
    group = torch.sort(group).values.cuda()
    r = torch.randn(rows, k, generator=g) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=g)]
    r[:, 16:32] = r[:, :16]  # norm ties
    r[7] = float("nan")
    r[100, 5], r[300, 9] = float("inf"), float("nan")
    r = r.cuda()
    for grp, groups in ((group, e), (None, 1)):
        rr = r if grp is not None else r[64:576].contiguous()
        outs = []
        runs = (None, 128) if k <= 1024 else (None,)  # sorted runs merged (sort_run) where they unroll small
        cfgs = (("count", None, None),) + tuple(("sort", v, None) for v in runs) + tuple(
            ("sort", v, True) for v in runs if v is not None and v < k)  # a program per run (split_runs)
        for method, run, split in cfgs:
            out = torch.full_like(rr, 7.0).bfloat16()
            gs, s = rac_units(rr, grp, groups, out, n=n, per_token=per_token, method=method, sort_run=run,
                              split_runs=split)
            outs.append((out.view(torch.int16), gs.view(torch.int32), s))
        for got in outs[1:]:
            for a, b in zip(outs[0], got):
                assert torch.equal(a, b), f"K={k} n={n} per_token={per_token} one_group={grp is None}"
