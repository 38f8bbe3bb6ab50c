"""The factored W4A4 (+RAC) path (quads.quant.factored, grouped.sorted_linear) on sorted expert rows:
quantized operands bit-exact with each expert's own quantization, outputs within the fp32
accumulation bound of the exact (fp64) product of those operands, and within twice it of the fp32
emulation (grouped.grouped_linear on the padded layout); masked slots contribute nothing. With the
packed weight operand (the W4A16 kernels; Triton's interpreter on the CPU): the decoded weight is the
BF16 QDQ(W) bit for bit, the GEMM equals the tensor operand's to fp32 summation order, and the layer
output is within the fp64 bound plus the BF16 rounding of each GEMM output."""

from __future__ import annotations

import pytest
import torch

from quads.formats import nvfp4
from quads.kernels import dispatch
from quads.kernels._common import HAS_TRITON
from quads.model.moe import static_routes
from quads.quant import factored, grouped, ops
from quads.quant.rac import StaticChannelSelector, rac_channels, residual_norms
from quads.quant.recipe import LinearSpec

E, K, N, T, TOP = 4, 64, 48, 11, 2
U32 = 2.0**-24
SPECS = {
    "w4a4": LinearSpec.of(weight="nvfp4", act="nvfp4"),
    "rac50": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5),
    "rac25-token": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.25, act_scale="token"),
    "rac50-static": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, rac_selection="static"),
}


def _case(seed: int = 0, device: str = "cpu"):
    """Sorted rows of a routing with masked slots, the weight operand, a static order per expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    x[:, 5] *= 30  # an outlier channel
    idx = torch.stack([torch.randperm(E, generator=g)[:TOP] for _ in range(T)])
    idx[2] = E  # token 2 routed nowhere
    idx[7, 1] = E
    x, idx = x.to(device), idx.to(device)
    routes = static_routes(idx, E)
    xs = x[routes.order // TOP]
    w = (torch.randn(E, N, K, generator=g) * 0.1).to(device)
    w_q, _ = ops.quantize_weight(w, LinearSpec.of(weight="nvfp4"), torch.bfloat16)  # [E, N, K] bf16 operand
    order = torch.stack([torch.randperm(K, generator=g) for _ in range(E)]).to(device)
    return xs, routes, w, w_q, order


def _expert_rows(routes, e):
    return (routes.expert == e).nonzero().squeeze(1)


def _units(q: nvfp4.NVFP4Tensor) -> torch.Tensor:
    """e2m1 * s in fp64, straight from the codes and scales."""
    v = nvfp4.e2m1_values(nvfp4.unpack(q.codes)).double()
    return (v.reshape(*v.shape[:-1], -1, 16) * q.scales.double()[..., None]).reshape(v.shape)


def _exact(xs, routes, w_q, spec, order):
    """Per expert, from nvfp4.quantize and rac's selection directly: the fp64 value of the W4A4(+RAC)
    GEMM of the quantized operands (RAC as the appended-columns product of DESIGN.md), and the bound
    gamma_(K+|S|+2) * sum |a| |w| of an fp32 evaluation of it, and that magnitude sum |a| |w|."""
    per_token, n = spec.act_scale == "token", rac_channels(K, spec.rac_ratio)
    y = torch.zeros(xs.shape[0], N, dtype=torch.float64)
    mag = torch.zeros_like(y)
    for e in range(E):
        rows = _expert_rows(routes, e)
        if not len(rows):
            continue
        x_e, w_e = xs[rows], w_q[e].double()
        q = nvfp4.quantize(x_e, per_token=per_token)
        a = _units(q) * q.global_scale.double()
        y[rows] = a @ w_e.T
        mag[rows] = a.abs() @ w_e.abs().T
        if n:
            r = x_e - nvfp4.dequantize(q)
            s = (torch.argsort(residual_norms(r), descending=True, stable=True)[:n] if spec.rac_selection == "dynamic"
                 else order[e, :n])
            qr = nvfp4.quantize(r[:, s], per_token=per_token)
            ar = _units(qr) * qr.global_scale.double()
            y[rows] += ar @ w_e[:, s].T
            mag[rows] += ar.abs() @ w_e[:, s].abs().T
    gamma = (K + n + 2) * U32 / (1 - (K + n + 2) * U32)
    return y, gamma * mag + U32 * y.abs(), mag


@pytest.mark.parametrize("name", list(SPECS))
def test_sorted_linear_within_fp64_bound_and_matches_emulation(name):
    spec = SPECS[name]
    xs, routes, w, w_q, order = _case()
    got = grouped.sorted_linear(xs, routes, w_q.float(), spec, static_order=order)
    ref = routes.unpad(grouped.grouped_linear(routes.pad(xs), w, w_q, spec, static_order=order))
    exact, bound, _ = _exact(xs, routes, w_q, spec, order)
    valid = routes.valid
    err_new = (got.double() - exact).abs()
    err_ref = (ref.double() - exact).abs()
    assert (err_new[valid] <= bound[valid]).all(), f"{name}: {(err_new / bound)[valid].max():.3g} x the bound"
    assert (err_ref[valid] <= bound[valid]).all(), f"{name}: emulation {(err_ref / bound)[valid].max():.3g} x"
    assert ((got.double() - ref.double()).abs() <= 2 * bound).all()
    assert exact[valid].abs().max() > 0
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))  # masked slots: zero rows


@pytest.mark.parametrize("name", list(SPECS))
def test_operands_bit_exact_per_expert(name):
    """Codes, block scales, global scales and channel sets are each expert's own, bit for bit."""
    spec = SPECS[name]
    xs, routes, _, _, order = _case(1)
    per_token, n = spec.act_scale == "token", rac_channels(K, spec.rac_ratio)
    segs = factored.Segments.of(routes.expert, E)
    op = factored.operands(xs, segs, n=n, dtype=torch.bfloat16, per_token=per_token,
                           selection=spec.rac_selection, static_order=order)
    for e in range(E):
        rows = _expert_rows(routes, e)
        if not len(rows):
            continue
        want = nvfp4.quantize(xs[rows], per_token=per_token)
        assert torch.equal(op.g[rows, 0], want.global_scale.expand(len(rows), 1).reshape(-1))
        assert torch.equal(op.u[rows, 0].double(), _units(want))  # e2m1 * s, exact in bf16
        if not n:
            assert op.u.shape[1] == 1
            continue
        r = xs[rows] - nvfp4.dequantize(want)
        s = (torch.argsort(residual_norms(r), descending=True, stable=True)[:n] if spec.rac_selection == "dynamic"
             else order[e, :n])
        assert torch.equal(op.channels[e], s)
        qr = nvfp4.quantize(r[:, s], per_token=per_token)
        assert torch.equal(op.g[rows, 1], qr.global_scale.expand(len(rows), 1).reshape(-1))
        ur = op.u[rows, 1].double()
        assert torch.equal(ur[:, s], _units(qr))
        rest = torch.ones(K, dtype=torch.bool)
        rest[s] = False
        assert torch.equal(ur[:, rest], torch.zeros_like(ur[:, rest]))
        # the STE point: QDQ(X) + scatter(QDQ(R[:, S])), the emulation's fp32 values
        want_eff = nvfp4.dequantize(want).index_add(1, s, nvfp4.dequantize(qr))
        assert torch.equal(op.dequantized()[rows], want_eff)


def test_masked_rows_do_not_reach_any_expert():
    """Rows of masked slots form their own group: changing them changes no valid row's output."""
    xs, routes, _, w_q, _ = _case(2)
    spec = SPECS["rac50"]
    y0 = grouped.sorted_linear(xs, routes, w_q.float(), spec)
    xs2 = xs.clone()
    xs2[~routes.valid] = 1e4  # huge values would move any shared amax or residual norm
    y1 = grouped.sorted_linear(xs2, routes, w_q.float(), spec)
    assert (~routes.valid).sum() == 3 and torch.equal(y0, y1)
    assert torch.equal(y1[~routes.valid], torch.zeros_like(y1[~routes.valid]))


def test_static_statistics_match_the_padded_path():
    """The calibration statistics of the sorted path (per-expert norms) equal the padded path's."""
    xs, routes, w, w_q, _ = _case(3)
    spec = SPECS["rac50-static"]
    a, b = StaticChannelSelector(E, K), StaticChannelSelector(E, K)
    segs = factored.Segments.of(routes.expert, E)
    grouped.sorted_linear(xs, routes, w_q.float(), spec, segs=segs, static_order=a.order,
                          observe=lambda r, norms: a.observe_norms(norms, segs.counts()))
    counts = routes.offsets[1:] - routes.offsets[:-1]
    grouped.grouped_linear(routes.pad(xs), w, w_q, spec, static_order=b.order,
                           observe=lambda r: b.observe_all(r, counts))
    assert torch.equal(a.count, b.count) and a.count.sum() == routes.valid.sum()
    torch.testing.assert_close(a.sq_sum, b.sq_sum, rtol=1e-6, atol=0)
    assert a.sq_sum.abs().sum() > 0


def test_sorted_linear_refuses_other_specs():
    xs, routes, _, w_q, _ = _case()
    with pytest.raises(ValueError, match="canonical NVFP4"):
        grouped.sorted_linear(xs, routes, w_q, LinearSpec.of(weight="nvfp4", act="nvfp4", nvfp4_mode="torchao"))
    with pytest.raises(ValueError, match="at least 32 channels"):
        grouped.sorted_linear(xs, routes, w_q, SPECS["rac50-static"], static_order=torch.zeros(E, 8, dtype=torch.long))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
def test_units_kernel_is_bit_exact(gather):
    """The fused quantize-to-values kernel (interpreter on the CPU): codes, block scales, S_dec, the
    exact values and the residual equal nvfp4.quantize's with the same amax per row, byte for byte, in three
    launch configs (one tile per program, smaller tiles, several column tiles per program)."""
    from quads.kernels import factored_quant

    g = torch.Generator().manual_seed(4)
    x = torch.randn(21, 96, generator=g) * torch.logspace(-3, 2, 96)  # blocks across the scale range
    x[3, 17] = float("nan")  # the NaN policy: its block dequantizes to NaN
    x[4, :16] = 0.0  # an all-zero block
    x[5] = 0.0  # an all-zero row (amax 0)
    index = torch.stack([torch.randperm(96, generator=g)[:48] for _ in range(21)]) if gather else None
    xs = x if index is None else x.gather(1, index)
    segs = factored.Segments.of(torch.arange(21) % 3, 3)
    amax = segs.row_max(nvfp4.nan_ignoring_amax(xs, dim=-1).squeeze(-1))
    want = nvfp4.quantize(xs, amax=amax[:, None])
    if torch.cuda.is_available():
        x, amax, index = x.cuda(), amax.cuda(), None if index is None else index.cuda()
    configs = ({}, {"block_m": 16, "block_k": 32}, {"block_m": 4, "block_k": 16, "cols": 48})  # tiles per program
    for dtype, cfg in [(torch.bfloat16, c) for c in configs] + [(torch.float32, {})]:
        with dispatch.kernels("triton"):
            u, gs, r, codes, scales = factored_quant.quantize_units(x, amax, dtype=dtype, index=index,
                                                                     residual=not gather, codes=True, **cfg)
        ru, rg, rr = factored_quant.quantize_units_reference(x, amax, dtype=dtype, index=index, residual=not gather)
        u, gs, r, rg, ru = u.cpu(), gs.cpu(), None if r is None else r.cpu(), rg.cpu(), ru.cpu()
        rr = None if rr is None else rr.cpu()
        assert torch.equal(codes.cpu(), want.codes) and torch.equal(scales.view(torch.uint8).cpu(),
                                                                    want.scales.view(torch.uint8))
        assert torch.equal(gs.cpu(), want.global_scale.reshape(-1)) and torch.equal(rg, gs)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        nan = ru.isnan()
        assert nan.any() and torch.equal(u.isnan().cpu(), nan)  # same NaN elements (payloads may differ)
        assert torch.equal(u.cpu().view(bits)[~nan], ru.view(bits)[~nan])  # every other bit pattern, -0 included
        if not gather:
            assert torch.equal(r.isnan(), rr.isnan()) and torch.equal(r.nan_to_num(), rr.nan_to_num())
            qdq = nvfp4.dequantize(want)
            assert torch.equal((x.cpu() - qdq).nan_to_num(), r.cpu().nan_to_num())  # x - QDQ(x), bit for bit
    assert torch.equal(factored.row_amax(x).cpu(), nvfp4.nan_ignoring_amax(x.cpu(), dim=-1).squeeze(-1))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("name", ["rac50", "rac25-token"])
def test_sorted_linear_triton_matches_reference_backend(name):
    """The whole sorted path with the Triton kernels (interpreter on the CPU; same GEMM) gives the
    reference backend's output bit for bit."""
    xs, routes, _, w_q, _ = _case(5, "cuda" if torch.cuda.is_available() else "cpu")
    with dispatch.kernels("reference"):
        want = grouped.sorted_linear(xs, routes, w_q.float(), SPECS[name])
    with dispatch.kernels("triton"):
        got = grouped.sorted_linear(xs, routes, w_q.float(), SPECS[name])
    assert torch.equal(got, want)


# ------------------------------------------------------------------- the fused RAC selection kernels


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, NaN elements compared as NaN (their payloads may differ)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    nan = b.isnan()
    return torch.equal(a.isnan(), nan) and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


def _rac_rows(seed: int, k: int, counts: list[int], masked: int):
    """Rows sorted by group (``counts[g]`` rows each, then ``masked`` rows of group G) with exact norm ties:
    channels 16..31 repeat 0..15 (scaled up, so selected), channels 40..47 are zero in every row."""
    g = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((c,), i) for i, c in enumerate(counts + [masked])]).long()
    x = torch.randn(len(group), k, generator=g) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=g)]
    x[:, :16] *= 8
    x[:, 16:32] = x[:, :16]  # equal residual columns: equal norms, the tie-break decides their order
    x[:, 40:48] = 0.0
    return x, factored.Segments.of(group, len(counts))


METHODS = ("sort", "count")  # rac_select's selection algorithms: the same bits as the reference, and so each other


def _fused_matches_reference(x, segs, n, per_token, dtype=torch.bfloat16):
    """Both selection methods of the fused operand against the reference path: u, g, channels byte for byte."""
    with dispatch.kernels("reference"):
        want = factored.operands(x, segs, n=n, dtype=dtype, per_token=per_token)
    for method in METHODS:
        with dispatch.kernels("triton"):
            got = factored.operands(x, segs, n=n, dtype=dtype, per_token=per_token, rac_method=method)
        where = f"method={method} n={n} K={x.shape[1]} per_token={per_token} groups={segs.groups}"
        assert got.u.shape == want.u.shape and _same_bits(got.u, want.u), where
        assert _same_bits(got.g, want.g), where
        assert (got.channels is None) == (want.channels is None), where
        assert got.channels is None or torch.equal(got.channels, want.channels), where
    return want


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("k", [80, 208], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("per_token", [False, True], ids=["group", "token"])
def test_fused_static_rac_operand_bit_exact(k, per_token, monkeypatch):
    """The calibrated-order residual operand in two launches (``factored_quant.rac_static_units``, interpreter)
    against the steps (gather, row amax, group max, quantize) and the reference backend: u, g, channels byte for
    byte; empty groups first, in the middle and last, masked rows (group G: zero rows), NaN and inf rows, n = 16 and
    n = K, orders longer than n, one group."""
    from quads.kernels import factored_quant

    calls = []
    real = factored_quant.rac_static_units_op
    monkeypatch.setattr(factored_quant, "rac_static_units_op", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, segs = _rac_rows(k + 3, k, [0, 6, 0, 3, 0], masked=2)
    x[1, 3], x[7, 5] = float("nan"), float("inf")
    g = torch.Generator().manual_seed(k)
    order = torch.stack([torch.randperm(k, generator=g) for _ in range(segs.groups)])
    for n in (16, k):
        kw = dict(n=n, dtype=torch.bfloat16, per_token=per_token, selection="static", static_order=order)
        with dispatch.kernels("triton"):
            got = factored.operands(x, segs, **kw)
            steps = factored.operands(x, segs, fused_rac=False, **kw)
        with dispatch.kernels("reference"):
            ref = factored.operands(x, segs, **kw)
        for want in (steps, ref):
            assert _same_bits(got.u, want.u) and _same_bits(got.g, want.g), f"n={n}"
            assert torch.equal(got.channels, want.channels)
    # observing (the rollout gathers the next calibration's statistics): the same operand, and the norms of
    # rac_group_norms equal Segments.sq_norms' up to fp64 summation order (NaN and inf where they are)
    seen = {}
    kw = dict(n=16, dtype=torch.bfloat16, per_token=per_token, selection="static", static_order=order)
    with dispatch.kernels("triton"):
        got = factored.operands(x, segs, observe=lambda r, norms: seen.setdefault("fused", norms), **kw)
        steps = factored.operands(x, segs, fused_rac=False, observe=lambda r, norms: seen.setdefault("steps", norms),
                                  **kw)  # fmt: skip
    assert _same_bits(got.u, steps.u) and _same_bits(got.g, steps.g)
    a, b = seen["fused"], seen["steps"]
    assert a.shape == b.shape == (segs.groups, k) and a.dtype == b.dtype == torch.float64
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()) and a.isinf().any()
    fin = a.isfinite()
    assert torch.allclose(a[fin], b[fin], rtol=1e-12, atol=0)
    one = factored.Segments.of(None)
    kw = dict(n=k // 32 * 16, dtype=torch.float32, per_token=per_token, selection="static", static_order=order[:1])
    with dispatch.kernels("triton"):
        got, steps = factored.operands(x, one, **kw), factored.operands(x, one, fused_rac=False, **kw)
    assert _same_bits(got.u, steps.u) and _same_bits(got.g, steps.g) and torch.equal(got.channels, steps.channels)
    assert len(calls) == 4  # the fused op ran for each Triton call without fused_rac=False
    with pytest.raises(ValueError, match="channel order"):
        factored_quant.rac_static_units(x.float().contiguous(), segs.group, segs.groups, order[:2], torch.zeros_like(x),
                                        n=16)  # fmt: skip


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("per_token", [False, True], ids=["group", "token"])
def test_rows_of_no_group_are_zero_rows(per_token):
    """The rows of no group (group G: a fixed-slot decode's masked slots) are zero rows of both terms, whatever they
    hold: ``factored.operands`` (reference and Triton) gives them u = 0 and S_dec = 1 and leaves every other row's
    operand as without them; the residual kernels read them as zeros (each RAC selection method, the static order),
    so a residual with NaN, inf and large values there gives the bytes of one with zeros there, and no kernel walks
    them (no selection sums them, and no ``gmax`` slot is written for them)."""
    from quads.kernels import factored_quant, rac_select

    k, counts, masked = 64, [5, 0, 7], 4
    x, segs = _rac_rows(k + 11, k, counts, masked)
    no_group = segs.group == segs.groups
    x[no_group] *= 1000
    x[no_group.nonzero()[0], :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    valid = ~no_group
    alone = factored.Segments.of(segs.group[valid], segs.groups)
    for backend in ("reference", "triton"):
        with dispatch.kernels(backend):
            got = factored.operands(x, segs, n=32, dtype=torch.bfloat16, per_token=per_token)
            without = factored.operands(x[valid], alone, n=32, dtype=torch.bfloat16, per_token=per_token)
        assert (got.u[no_group] == 0).all() and (got.g[no_group] == 1).all(), backend
        assert _same_bits(got.u[valid], without.u) and _same_bits(got.g[valid], without.g), backend
        assert torch.equal(got.channels, without.channels), backend
    r = x.float().contiguous()
    zeroed = torch.where(no_group[:, None], 0.0, r)
    order = torch.stack([torch.randperm(k, generator=torch.Generator().manual_seed(g)) for g in range(segs.groups)])
    calls = [lambda r, out, method=method: rac_select.rac_units(r, segs.group, segs.groups, out, n=32,
                                                                 per_token=per_token, method=method)[0]
             for method in METHODS]
    calls.append(lambda r, out: factored_quant.rac_static_units(r, segs.group, segs.groups, order, out, n=32,
                                                                per_token=per_token))
    for call in calls:
        outs = []
        for res in (r, zeroed):
            out = torch.zeros(r.shape, dtype=torch.bfloat16)
            outs.append((out, call(res, out)))
        assert _same_bits(outs[0][0], outs[1][0]) and _same_bits(outs[0][1], outs[1][1])
        assert (outs[0][0][no_group] == 0).all() and (outs[0][1][no_group] == 1).all()


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("k", [64, 512], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("per_token", [False, True], ids=["group", "token"])
def test_fused_rac_operands_bit_exact(k, per_token):
    """rac_select's kernels (interpreter on the CPU), both methods, against the reference path: u, g and the
    channel sets byte for byte, with exact norm ties, a group of no rows, masked rows (group G) and n = K/2,
    K. K = 512 is four channel blocks of 128: the middle ones run all three loops of the rank kernel
    (channels before, inside and after the block); the sort path sorts 512 pairs in one program. Two
    blocks, the last one partial: K = 208 below. The 1024-wide decode shapes run on CUDA
    (test_quant_factored_gpu)."""
    x, segs = _rac_rows(k, k, [5, 0, 7], masked=3)
    for n in (k // 2, k):
        want = _fused_matches_reference(x, segs, n, per_token)
        pairs = torch.isin(torch.arange(16), want.channels[0]) & torch.isin(torch.arange(16, 32), want.channels[0])
        assert pairs.sum() >= 8  # tied channels selected together: their order is compared
    x2, segs2 = _rac_rows(k + 1, k, [9], masked=0)
    _fused_matches_reference(x2, factored.Segments.of(None), k // 4, per_token, torch.float32)  # one group
    _fused_matches_reference(x2, segs2, k // 2, per_token, torch.float32)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("k,per_token", [(80, False), (208, True)], ids=["K80-group", "K208-token"])
def test_fused_rac_operands_k_not_a_power_of_two(k, per_token):
    """K = 80 / 208 (the sort pads to 128 / 256 pairs, keys -1 after every real channel), n = 16 (the
    smallest set) and n = K; empty groups first, in the middle and last; a one-group call."""
    x, segs = _rac_rows(k + 7, k, [0, 6, 0, 3], masked=2)
    for n in (16, k):
        _fused_matches_reference(x, segs, n, per_token)
    _fused_matches_reference(x, factored.Segments.of(None), k - 16, per_token, torch.float32)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("k,counts,masked,dtype,residual", [
    (64, [5, 0, 7], 3, torch.bfloat16, True),
    (80, [0, 17, 2, 0], 0, torch.float32, False),  # empty groups first and last, a partial K block
    (512, [40], 5, torch.bfloat16, True),  # two K blocks of 256, a group of three row blocks
    (208, [0, 0, 3], 1, torch.bfloat16, False),
    (32, [2, 150, 0, 5], 70, torch.bfloat16, True),  # groups of several row-maxima chunks (64) and programs
], ids=["K64", "K80-fp32", "K512", "K208", "K32-long-groups"])
def test_group_units_is_row_amax_row_max_and_units(k, counts, masked, dtype, residual):
    """``factored_quant.group_units`` (each program takes its rows' group amaxes from the groups' row maxima,
    then quantizes) writes the bits of ``row_amax`` + ``Segments.row_max`` + ``units`` and of the PyTorch
    reference (interpreter), into a strided slot of the stacked operand, in two launch configs (one tile per
    program; several rows and column tiles per program, the last partial where K allows), with NaN and inf
    rows (an inf makes its group's scale 1, a NaN is ignored by the amax), groups longer than a chunk of row
    maxima, and the rows of no group (non-zero values and row maxima, a NaN among them) read as zero rows: u = 0,
    r = 0, S_dec 1."""
    from quads.kernels import factored_quant

    x, segs = _rac_rows(k + len(counts), k, counts, masked)
    offs = segs.row_offsets()
    ends = torch.cat([offs[1:], torch.tensor([x.shape[0]])])
    last = ends[ends > offs] - 1  # each non-empty group's last row, the rows of no group's too
    x[last, 0] *= 100  # its amax: past the first chunk of row maxima in a long group
    if x.shape[0] > 3:  # in the first group, not the long one
        x[1, 3], x[0, 5] = float("nan"), float("inf")
    no_group = segs.group == segs.groups
    x[no_group, 2] = float("nan")
    rmax = factored.row_amax(x)  # what the kernel is given: the rows of no group's maxima non-zero
    xz = torch.where(no_group[:, None], 0.0, x)  # the reference's zero rows
    amax = segs.row_max(factored.row_amax(xz))
    ref_u, ref_g, ref_r = factored_quant.quantize_units_reference(xz, amax, dtype=dtype, residual=residual)
    if masked:
        assert (ref_u[no_group] == 0).all() and (ref_g[no_group] == 1).all()
    for slot in (1,) if k >= 512 else (0, 1):  # the second slot: rows strided and offset in the stacked operand
        want = torch.zeros(x.shape[0], 2, k, dtype=dtype)
        with dispatch.kernels("triton"):
            gw, rw = factored.units(xz, amax, want, slot, residual=residual)
        assert _same_bits(want[:, slot], ref_u) and _same_bits(gw, ref_g)
        assert (rw is None and ref_r is None) or _same_bits(rw, ref_r)
        got = torch.zeros_like(want)
        gg, rg = factored_quant.group_units_op(x, rmax, segs.group, segs.row_offsets(), segs.groups, got, slot,
                                               residual=residual)
        cols = torch.zeros_like(want)
        bk = 16 if k < 64 else 32 if k < 512 else 128
        gc, rc = factored_quant.group_units(x, rmax, segs.group, segs.row_offsets(), segs.groups, cols[:, slot],
                                            residual=residual, block_m=4, block_k=bk, cols=2 * bk)
        for u, g, r in ((got, gg, rg), (cols, gc, rc)):
            assert _same_bits(u, want) and _same_bits(g, gw)
            assert (r is None and rw is None) or _same_bits(r, rw)
    args = (segs.group, segs.row_offsets(), segs.groups)
    with pytest.raises(ValueError, match="multiple of 16"):
        factored_quant.group_units(x[:, : k - 8], rmax, *args, got[:, 0, : k - 8])
    with pytest.raises(ValueError, match="multiple of block_k"):
        factored_quant.group_units(x, rmax, *args, got[:, 0], block_k=32, cols=48)
    with pytest.raises(ValueError, match="offsets"):
        factored_quant.group_units(x, rmax, segs.group, segs.row_offsets()[1:], segs.groups, got[:, 0])
    with pytest.raises(ValueError, match="fp32"):
        factored_quant.group_units(x, rmax.double(), *args, got[:, 0])


def test_operands_decode_groups_compiled_and_eager_and_the_routes_offsets():
    """The decode operand's row maxima as ATen ops under ``torch.compile`` (for Inductor to fuse into the kernel
    that makes the rows) and as ``row_amax`` eagerly give the same bits; the groups' offsets counted by
    ``Segments.row_offsets`` are the routes' own (``moe.StaticRoutes.offsets``, what the decode step passes)."""
    xs, routes, _, _, _ = _case(3)
    segs = factored.Segments.of(routes.expert, E, routes.offsets)
    assert torch.equal(factored.Segments.of(routes.expert, E).row_offsets(), routes.offsets)
    with pytest.raises(ValueError, match="offsets"):
        factored.Segments.of(routes.expert, E, routes.offsets[1:])

    def operand(x):
        op = factored.operands(x, segs, n=0, dtype=torch.bfloat16)
        return op.u, op.g

    with dispatch.kernels("triton"):
        eager = operand(xs)
        torch._dynamo.reset()
        compiled = torch.compile(operand, backend="aot_eager", fullgraph=True)(xs)
    for a, b in zip(eager, compiled, strict=True):
        assert _same_bits(a, b)
    assert eager[1].unique().numel() > 2  # several groups' own scales


def test_operands_quantize_decode_groups_in_one_launch(monkeypatch):
    """``factored.operands`` takes ``group_units`` for rows in groups with few rows per group on a Triton device
    (the decode step), and the three-step path per token, for one group, and with many rows per group."""
    from quads.kernels import factored_quant

    calls = []
    real = factored_quant.group_units_op
    monkeypatch.setattr(factored_quant, "group_units_op", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    x, segs = _rac_rows(1, 32, [3, 4], masked=1)
    with dispatch.kernels("triton"):
        factored.operands(x, segs, n=0, dtype=torch.bfloat16)
        factored.operands(x, segs, n=16, dtype=torch.bfloat16)
        factored.operands(x, segs, n=0, dtype=torch.bfloat16, per_token=True)
        factored.operands(x, factored.Segments.of(None), n=0, dtype=torch.bfloat16)
        factored.operands(x, segs, n=0, dtype=torch.bfloat16, fused_amax=False)
        many, msegs = _rac_rows(2, 32, [factored_quant.GROUP_UNITS_MAX_ROWS + 1], masked=0)
        factored.operands(many, msegs, n=0, dtype=torch.bfloat16)
    with dispatch.kernels("reference"):
        factored.operands(x, segs, n=0, dtype=torch.bfloat16)
    assert calls == [x.shape, x.shape]


def test_sq_norms_keep_nan_and_inf_in_their_group():
    """Segments.sq_norms equals each group's own sum of r^2, a NaN or inf square included (a plain GEMM
    with the 0/1 membership would spread them to every group: 0 * inf = NaN)."""
    r = torch.randn(9, 32)
    r[1, 3], r[5, 7] = float("nan"), float("inf")
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3])
    got = factored.Segments.of(group, 3).sq_norms(r)
    for g in range(3):
        want = r[group == g].double().square().sum(0)
        assert torch.allclose(got[g], want, rtol=1e-15, atol=0, equal_nan=True)
    assert got[0, 3].isnan() and got[2, 7].isinf() and got[1].isfinite().all()


def test_sq_norms_with_counts_are_each_groups_own_sum():
    """``sq_norms(counts=)``: each group's ``sum(dim=0)`` of its rows alone, bit for bit (NaN and inf kept in
    their group, an empty group zero); counts that do not fit the rows are refused."""
    r = torch.randn(40, 48) * torch.rand(40, 1) * 100
    r[1, 3], r[30, 7] = float("nan"), float("inf")
    counts = [3, 0, 12, 25]
    group = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    got = factored.Segments.of(group, 4).sq_norms(r, counts)
    start = 0
    for g, c in enumerate(counts):
        want = r[start : start + c].clone().double().square().sum(dim=0)
        assert torch.equal(got[g].nan_to_num(-1.0), want.nan_to_num(-1.0)), g
        start += c
    assert got[0, 3].isnan() and got[3, 7].isinf() and torch.equal(got[1], torch.zeros(48, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not cover"):
        factored.Segments.of(group, 4).sq_norms(r, [3, 0, 12])


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_fused_rac_operands_nan_and_n0():
    """A NaN in a group's residual makes its norm NaN: selected first (torch sorts NaN above every number),
    as the reference; n = 0 has no residual operand on either path."""
    x, segs = _rac_rows(3, 64, [4, 6], masked=2)
    x[2, 50] = float("nan")  # group 0: channels 48..63 get a NaN residual in row 2
    want = _fused_matches_reference(x, segs, 32, False)
    assert torch.equal(want.channels[0, :16], torch.arange(48, 64))
    assert not torch.isin(want.channels[1, :16], torch.arange(48, 64)).any()  # group 1's rows hold no NaN
    want0 = _fused_matches_reference(x, segs, 0, False)
    assert want0.u.shape[1] == 1 and want0.channels is None


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("n,per_token", [(32, False), (96, True)], ids=["n32-group", "n96-token"])
def test_fused_rac_operands_nan_inf_rows(n, per_token):
    """Whole NaN rows, inf elements (their blocks' residual NaN or inf: norms NaN / inf, ranked above every
    finite norm, NaN above inf, ties among them by channel) in groups, in the masked rows and in one group:
    both methods equal the reference byte for byte."""
    x, segs = _rac_rows(5, 96, [3, 4, 0, 5], masked=3)
    x[1] = float("nan")  # group 0: every channel's norm NaN: S = the first n channels
    x[4, 70], x[5, 3] = float("inf"), float("-inf")  # group 1
    x[8, 33] = float("nan")  # group 1
    x[9, 90] = float("inf")  # group 3
    x[13] = float("nan")  # a masked row (group G)
    x[14, 60] = float("inf")
    want = _fused_matches_reference(x, segs, n, per_token)
    assert torch.equal(want.channels[0, :16], torch.arange(16))
    _fused_matches_reference(x[3:12], factored.Segments.of(None), 48, per_token, torch.float32)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels.rac_select import _merge_ranks, _sort_rows

    @triton.jit
    def _sort_pairs_kernel(key_ptr, out_ptr, LOG: tl.constexpr, INTERP: tl.constexpr):
        c = tl.arange(0, 1 << LOG)[None, :]  # one run of 2**LOG pairs, as the select kernel's one-run sort
        _, idx = _sort_rows(tl.load(key_ptr + c), c, 1, LOG, INTERP)
        tl.store(out_ptr + c, idx)

    @triton.jit
    def _merged_ranks_kernel(key_ptr, rank_ptr, sk_ptr, si_ptr, LOG_W: tl.constexpr, LOG_L: tl.constexpr,
                             INTERP: tl.constexpr):  # fmt: skip
        W: tl.constexpr = 1 << LOG_W
        L: tl.constexpr = 1 << LOG_L
        c = tl.arange(0, W)[:, None] * L + tl.arange(0, L)[None, :]
        rk, ri = _sort_rows(tl.load(key_ptr + c), c, W, LOG_L, INTERP)
        tl.store(rank_ptr + ri, _merge_ranks(rk, ri, sk_ptr, si_ptr, W, LOG_L))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("gpu_form", [False, True], ids=["interp-form", "gpu-form"])
def test_sort_pairs_is_torch_stable_argsort(gpu_form):
    """The bitonic network alone (rac_select._sort_rows, one run) on int64 keys with many ties, the NaN key and the
    padding key -1: the order of torch.argsort(descending=True, stable=True), for every size 2 .. 64,
    with the interpreter's form of the partner exchange and with the GPU's (xor) form."""
    g = torch.Generator().manual_seed(0)
    nan_key = 0x7FF8000000000000
    for log in range(1, 7):
        for pool in (torch.tensor([-1, 0, 3, nan_key]), torch.randint(0, 2**62, (1 << log,), generator=g)):
            key = pool[torch.randint(len(pool), (1 << log,), generator=g)]
            out = torch.empty(1 << log, dtype=torch.int32)
            _sort_pairs_kernel[(1,)](key, out, LOG=log, INTERP=not gpu_form)
            want = torch.argsort(key, descending=True, stable=True)
            assert torch.equal(out.long(), want), f"size {1 << log}: keys {key.tolist()}"


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("gpu_form", [False, True], ids=["interp-form", "gpu-form"])
def test_sorted_runs_merged_are_torch_stable_argsort(gpu_form):
    """Runs sorted in registers (rac_select._sort_rows) and their ranks merged by binary searches
    (_merge_ranks): every pair's rank is its position in torch.argsort(descending=True, stable=True), over
    keys with many ties across runs, the NaN key and the padding key -1, for 2..8 runs of 2..16 pairs."""
    g = torch.Generator().manual_seed(1)
    nan_key = 0x7FF8000000000000
    for log_w, log_l in ((1, 1), (1, 3), (2, 2), (3, 4), (2, 4)):
        size = 1 << (log_w + log_l)
        for pool in (torch.tensor([-1, 0, 3, nan_key]), torch.randint(0, 2**62, (size,), generator=g)):
            key = pool[torch.randint(len(pool), (size,), generator=g)]
            rank = torch.full((size,), -1, dtype=torch.int32)
            sk, si = torch.empty(size, dtype=torch.long), torch.empty(size, dtype=torch.int32)
            _merged_ranks_kernel[(1,)](key, rank, sk, si, LOG_W=log_w, LOG_L=log_l, INTERP=not gpu_form)
            want = torch.empty(size, dtype=torch.long)
            want[torch.argsort(key, descending=True, stable=True)] = torch.arange(size)
            assert torch.equal(rank.long(), want), f"{1 << log_w} runs of {1 << log_l}: keys {key.tolist()}"


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("per_token", [False, True], ids=["group", "token"])
def test_sort_units_one_row_per_program(per_token):
    """The sort path as launched on the GPU (one row per program of the units kernel; one sorted run, or
    runs of 16 and 32 channels merged, in the select kernel or by a program per run (``split_runs``); the
    norms' rows loaded 1, 3 or 16 at a time) equals the count path, byte for byte (u, S_dec, S), masked rows
    and an empty group included."""
    from quads.kernels import rac_select

    x, segs = _rac_rows(11, 64, [3, 0, 4], masked=2)
    r = x - nvfp4.dequantize(nvfp4.quantize(x), torch.float32)
    outs = []
    for method, bm, run, rows, split in (("count", None, None, None, None), ("sort", 1, None, None, None),
                                         ("sort", 1, 16, 3, False), ("sort", 1, 32, 16, False), ("sort", 1, None, 1, None),
                                         ("sort", 1, 16, 3, True), ("sort", 1, 32, 2, True)):
        out = torch.full_like(r, 7.0)  # every element written: selected values or zero
        g, s = rac_select.rac_units(r, segs.group, segs.groups, out, n=32, per_token=per_token, method=method,
                                    block_m=bm, sort_run=run, select_rows=rows, split_runs=split)
        outs.append((out, g, s))
    for got in outs[1:]:
        for a, b in zip(outs[0], got):
            assert torch.equal(a, b)
    assert (outs[0][0] != 7.0).all()


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_group_scale_takes_the_last_selected_channel():
    """The residual's group amax is the max over every selected channel, the last one in the order included: a
    group whose largest |r| sits in the channel ranked exactly n-th (31 channels of norm 36 and |r| 3, then one of
    norm 34.81 and |r| 5.9, then norm 4) gets S_dec from 5.9 on every sort path (one program; runs merged in it or
    by a program per run) and on the count path, and the same bytes."""
    from quads.kernels import rac_select

    k, n, rows = 64, 32, 4
    r = torch.ones(rows, k)  # unselected channels: norm 4
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(5))
    r[:, perm[:31]] = 3.0
    r[:, perm[31]] = torch.tensor([5.9, 0.0, 0.0, 0.0])
    group = torch.zeros(rows, dtype=torch.long)
    outs = []
    for method, run, split in (("count", None, None), ("sort", None, None), ("sort", 16, False), ("sort", 16, True)):
        out = torch.full_like(r, 7.0)
        g, s = rac_select.rac_units(r, group, 1, out, n=n, method=method, block_m=1, sort_run=run, split_runs=split)
        assert int(s[0, n - 1]) == int(perm[31]), (method, run, split)
        outs.append((out, g, s))
    for got in outs[1:]:
        for a, b in zip(outs[0], got):
            assert torch.equal(a, b)
    # the amax behind S_dec: 5.9 (S_dec = amax / (6 * 448)), not the 3.0 of the other selected channels
    assert torch.allclose(outs[0][1], torch.full((rows,), 5.9 / (6 * 448)), rtol=1e-6)


def test_rac_method_default_and_errors():
    """sort for experts up to SORT_MAX_K channels (padded to a power of two), count above and for one group;
    an unknown method or a sort too wide for one program is a ValueError naming the fix."""
    from quads.kernels import rac_select

    assert rac_select.default_method(1024) == "sort" and rac_select.default_method(4096) == "sort"
    assert rac_select.default_method(4097) == "count" and rac_select.default_method(80) == "sort"
    assert rac_select.default_method(1024, grouped=False) == "count"
    if not HAS_TRITON:
        return
    r, out = torch.zeros(2, 4112), torch.zeros(2, 4112)
    with pytest.raises(ValueError, match="method='count'"):
        rac_select.rac_units(r, None, 1, out, n=16, method="sort")
    with pytest.raises(ValueError, match="valid: sort, count"):
        rac_select.rac_units(r[:, :64].contiguous(), None, 1, out[:, :64], n=16, method="rank")
    with pytest.raises(ValueError, match="sort_run must be a power of two"):
        rac_select.rac_units(r[:, :64].contiguous(), None, 1, out[:, :64], n=16, method="sort", sort_run=24)
    with pytest.raises(ValueError, match="split_runs needs runs shorter"):
        rac_select.rac_units(r[:, :64].contiguous(), None, 1, out[:, :64], n=16, method="sort", split_runs=True)
    with pytest.raises(ValueError, match="split_runs needs method='sort'"):
        rac_select.rac_units(r[:, :64].contiguous(), None, 1, out[:, :64], n=16, method="count", split_runs=True)
    with pytest.raises(ValueError, match="select_rows must be >= 1"):
        rac_select.rac_units(r[:, :64].contiguous(), None, 1, out[:, :64], n=16, method="sort", select_rows=0)


# ------------------------------------------------------------------------ the packed weight operand

BF16_U = 2.0**-8  # unit roundoff of BF16: 8 significant bits, round to nearest even


def _packed(w: torch.Tensor):
    """Master ``w`` ([N, K] or [E, N, K]) -> its BF16 QDQ(W) (the tensor operand) and its packed form."""
    from quads.kernels import w4a16

    spec = LinearSpec.of(weight="nvfp4")
    w_q, _ = ops.quantize_weight(w, spec, torch.bfloat16)
    return w_q, w4a16.pack(ops.nvfp4_weight(w, spec, torch.bfloat16))


def _bf16_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """BF16 outputs of two fp32 sums of the same products in different orders: one BF16 ulp apart at most
    (tests/test_kernels_w4a16.py's bound)."""
    a, b = a.double(), b.double()
    tol = b.abs() * 2.0**-7 + b.abs().amax() * 1e-5
    bad = (a - b).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements more than 1 bf16 ulp apart"


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_packed_operand_decodes_to_the_bf16_qdq_bit_for_bit():
    """The weight the W4A16 kernels multiply (their own Triton decode, and its PyTorch twin) is the BF16
    QDQ(W) the tensor path reads, bit for bit, for an expert stack and for one weight."""
    from quads.kernels import w4a16

    _, _, w, _, _ = _case(6)
    w[1, 3, :16] = 0.0  # an all-zero block
    for master in (w, w[2]):
        w_q, p = _packed(master)
        assert w_q.dtype == torch.bfloat16
        assert torch.equal(w4a16.dequantize(p).view(torch.int16), w_q.view(torch.int16))
        with dispatch.kernels("triton"):
            assert torch.equal(w4a16.dequantize_bf16(p).view(torch.int16), w_q.view(torch.int16))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("name", ["w4a4", "rac50"])
def test_packed_gemm_matches_the_tensor_gemm(name):
    """factored.gemm of the stacked exact values: the packed kernel against the BF16 tensor operand
    (torch._grouped_mm / F.linear, fp32 accumulation, BF16 out): the same sums in another order."""
    from quads.model import moe

    xs, routes, w, _, _ = _case(7)
    spec = SPECS[name]
    segs = factored.Segments.of(routes.expert, E)
    op = factored.operands(xs, segs, n=rac_channels(K, spec.rac_ratio), dtype=torch.bfloat16)
    M, P, _ = op.u.shape
    u = op.u.reshape(M * P, K)
    stacked = grouped.stacked_routes(routes, P)
    w_q, p = _packed(w)
    with dispatch.kernels("triton"):
        got = factored.gemm(u, p, stacked)
    want = moe.grouped_mm(u, w_q, stacked)  # the tensor operand's grouped GEMM in BF16
    assert got.dtype == want.dtype == torch.bfloat16
    _bf16_close(got, want, f"{name}: grouped")
    assert torch.equal(got[~stacked.valid], torch.zeros_like(got[~stacked.valid]))
    w_q1, p1 = _packed(w[0])
    with dispatch.kernels("triton"):
        got1 = factored.gemm(u, p1)
    _bf16_close(got1, (u.float() @ w_q1.float().T).bfloat16(), f"{name}: dense")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("name", list(SPECS))
def test_sorted_linear_packed_weight_within_bound(name):
    """sorted_linear with the packed weight: within the fp64 bound of the exact product plus the BF16
    rounding of each GEMM output (2^-8 relative per term), so within both bounds of the fp32 tensor path."""
    spec = SPECS[name]
    xs, routes, w, w_q, order = _case(8)
    _, p = _packed(w)
    with dispatch.kernels("triton"):
        got = grouped.sorted_linear(xs, routes, p, spec, static_order=order)
    ref = grouped.sorted_linear(xs, routes, w_q.float(), spec, static_order=order)
    exact, bound, mag = _exact(xs, routes, w_q, spec, order)
    # bf16(y_p) = y_p (1 + d), |d| <= 2^-8, |y_p| <= (1 + gamma) mag_p; the fp32 roundings of the scale
    # and the sum on top (2^-24 each) stay inside the (1 + 2^-7) factor
    bound_packed = bound + BF16_U * (1 + 2.0**-7) * mag
    valid = routes.valid
    err = (got.double() - exact).abs()
    assert (err[valid] <= bound_packed[valid]).all(), f"{name}: {(err / bound_packed)[valid].max():.3g} x the bound"
    assert ((got.double() - ref.double()).abs() <= bound_packed + bound).all()
    assert not torch.equal(got, ref)  # BF16 GEMM outputs round differently: the comparison has teeth
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("name", ["w4a4", "rac50", "rac25-token"])
def test_dense_w4a4_linear_packed_weight(name):
    """The dense factored call (w4a4_linear: attention projections) with the packed weight: within the
    fp32 tensor path's result by both GEMMs' fp32 bounds plus the BF16 rounding of the GEMM outputs."""
    from quads.quant.w4a4 import w4a4_linear

    spec = SPECS[name]
    xs, _, w, _, _ = _case(9)
    master = w[1]
    w_q, p = _packed(master)
    kw = dict(rac_ratio=spec.rac_ratio, act_scale=spec.act_scale)
    with dispatch.kernels("triton"):
        got = w4a4_linear(xs, master, w_q=p, **kw)
    ref = w4a4_linear(xs, master, w_q=w_q.float(), **kw)
    op = factored.operands(xs, factored.Segments.of(None), n=rac_channels(K, spec.rac_ratio),
                           dtype=torch.float32, per_token=spec.act_scale == "token")
    mag = (op.u.double().abs() * op.g.double()[..., None]).sum(1) @ w_q.double().abs().T  # sum |a| |w|
    gamma = (K + 2) * U32 / (1 - (K + 2) * U32)
    tol = (2 * gamma + BF16_U * (1 + 2.0**-7)) * mag + 2 * U32 * ref.double().abs()
    assert ((got.double() - ref.double()).abs() <= tol).all()
    assert not torch.equal(got, ref)
    with pytest.raises(ValueError, match="canonical NVFP4 mode"):
        w4a4_linear(xs, master, w_q=p, mode="torchao")
