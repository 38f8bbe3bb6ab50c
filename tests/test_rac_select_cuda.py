"""RAC's CUDA channel selection (``quads.kernels.rac_select_cuda``) against the Triton sort and count paths.

The GPU tests (skipped without CUDA) compare ``rac_units`` with ``select_backend="cuda"`` byte for byte (u, S_dec,
S) with the Triton selection, for every instantiated warp count of each K, and the replay of the CUDA path in a
CUDA graph. On the CPU the kernel's own code runs on the host (``tests/host_kernels.py``: its threads, barriers and
warp shuffles emulated) against the Triton kernel under the interpreter. The CPU tests also hold the launcher's contract (the instantiations the Python side asks for are the ones
the extension compiles; where the kernel cannot run, no GPU or one group, the Triton kernels run instead) and the
kernel's bitonic network, re-stated in Python with its position-to-thread mapping.
"""

from __future__ import annotations

import re

import host_kernels
import pytest
import torch

from quads.kernels import cuda_build, rac_select_cuda
from quads.kernels._common import HAS_TRITON

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and rac_select_cuda.available()),
                          reason="needs a CUDA GPU and nvcc")  # fmt: skip


def test_configs_are_the_extension_instantiations():
    """``CONFIGS`` (what ``supports`` admits) is exactly the ``QUADS_CASE`` list of ``rac_select.cu`` (a config
    missing there would fail at launch), each with 1, 2, 4 or 8 pairs a thread, and the default warps of every
    K up to ``MAX_K`` is among them."""
    text = (cuda_build.CSRC / "rac_select.cu").read_text()
    cases = tuple((int(a), int(b)) for a, b in re.findall(r"^\s*QUADS_CASE\((\d+), (\d+)\)", text, flags=re.M))
    assert cases == rac_select_cuda.CONFIGS
    for log_kp, warps in cases:
        assert (1 << log_kp) // (32 * warps) in (1, 2, 4, 8)
    for k in range(16, rac_select_cuda.MAX_K + 1, 16):
        assert (rac_select_cuda.log_kp(k), rac_select_cuda.default_warps(k)) in rac_select_cuda.CONFIGS, k
    assert rac_select_cuda.log_kp(1024) == 10 and rac_select_cuda.log_kp(1000) == 10 and rac_select_cuda.log_kp(16) == 5


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_cuda_backend_falls_back_to_triton_where_it_cannot_run():
    """On the CPU (Triton's interpreter) and for one group, ``select_backend="cuda"`` runs the Triton kernels: the
    same bytes as ``"triton"`` (on a GPU the grouped rows run the CUDA kernel, the same bytes too); an unknown
    backend is a ValueError naming the valid ones."""
    from quads.kernels import rac_select

    g = torch.Generator().manual_seed(3)
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3], dtype=torch.long)  # group 3: rows of no group
    r = torch.randn(9, 64, generator=g)
    assert not rac_select_cuda.supports(r, group, 2)  # a CPU tensor
    if torch.cuda.is_available():  # compiled Triton takes CUDA tensors only; there the grouped rows run CUDA
        r, group = r.cuda(), group.cuda()
    for grp, groups in ((group, 3), (None, 1)):
        outs = []
        for backend in ("triton", "cuda"):
            out = torch.full_like(r, 7.0)
            gs, s = rac_select.rac_units(r, grp, groups, out, n=32, method="sort", select_backend=backend)
            outs.append((out, gs, s))
        for got in outs[1:]:
            for a, b in zip(outs[0], got):
                assert torch.equal(a, b)
    with pytest.raises(ValueError, match="valid: triton, cuda"):
        rac_select.rac_units(r, group, 3, torch.empty_like(r), n=32, method="sort", select_backend="cub")


def test_a_failed_build_warns_once_and_reports_false(monkeypatch):
    """``cuda_build.try_build`` (what ``supports`` asks before the CUDA selection runs by default): a build that
    raises gives False and one RuntimeWarning naming the extension and the error, and is not retried."""
    from quads.kernels import cuda_build

    calls = []

    def failing(name, source):
        calls.append(name)
        raise RuntimeError("nvcc: version mismatch")

    monkeypatch.setattr(cuda_build, "build", failing)
    cuda_build.try_build.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="rac_select.*Triton twin.*version mismatch"):
            assert cuda_build.try_build("rac_select", "rac_select.cu") is False
        assert cuda_build.try_build("rac_select", "rac_select.cu") is False
        assert calls == ["rac_select"]
    finally:
        cuda_build.try_build.cache_clear()


def _network(log_kp: int, warps: int, keys: list[int]) -> list[int]:
    """The CUDA kernel's bitonic network re-stated in Python with its position-to-thread mapping: thread t holds
    positions [t E, (t + 1) E); a step with partners D apart swaps in the thread (D < E) or takes the partner
    thread t ^ (D / E)'s pair (shuffle or shared memory), keeping the first pair where its slot is the lower one of
    an ascending run. Returns the channels in the final order."""
    kp, t_n = 1 << log_kp, warps * 32
    e_n = kp // t_n

    def before(a, b):  # (key, channel): key descending, ties by channel ascending
        return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])

    pairs = [[(keys[t * e_n + e], t * e_n + e) for e in range(e_n)] for t in range(t_n)]
    for s in range(1, log_kp + 1):
        for j in range(s - 1, -1, -1):
            d = 1 << j
            if d < e_n:
                for t in range(t_n):
                    for e in range(e_n):
                        if e & d == 0:
                            asc = ((t * e_n + e) >> s) & 1 == 0
                            if before(pairs[t][e + d], pairs[t][e]) == asc:
                                pairs[t][e], pairs[t][e + d] = pairs[t][e + d], pairs[t][e]
            else:
                old = [row[:] for row in pairs]
                for t in range(t_n):
                    for e in range(e_n):
                        p, partner = t * e_n + e, old[t ^ (d // e_n)][e]
                        want_first = ((p & d) == 0) == (((p >> s) & 1) == 0)
                        if before(partner, old[t][e]) == want_first:
                            pairs[t][e] = partner
    return [c for row in pairs for _, c in row]


def test_the_kernels_bitonic_network_is_the_stable_descending_order():
    """For every instantiated (padded K, warps), the network as the kernel runs it orders (key, channel) pairs as
    ``torch.argsort(descending=True, stable=True)``: keys with many ties, the NaN key above +inf, padding -1."""
    g = torch.Generator().manual_seed(2)
    nan_key = 0x7FF8000000000000
    for log_kp, warps in rac_select_cuda.CONFIGS:
        kp = 1 << log_kp
        k = kp - 16 if kp > 32 else kp
        pool = torch.tensor([0, 1, 5, 2**62, nan_key, 7, 3])
        keys = pool[torch.randint(len(pool), (k,), generator=g)].tolist() + [-1] * (kp - k)
        want = torch.argsort(torch.tensor(keys), descending=True, stable=True).tolist()
        assert _network(log_kp, warps, keys) == want, (log_kp, warps)


def _rows(k: int, counts: list[int], masked: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual [M, K] on the GPU with rows sorted by group (``counts[g]`` rows each, then ``masked`` rows of no
    group): norms spread over four decades, exact ties (channels 16..31 repeat 0..15; 40..47 zero in every row,
    so many keys 0), a NaN row in group 1, an inf and a NaN element elsewhere."""
    g = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((c,), i) for i, c in enumerate(counts + [masked])]).long()
    r = torch.randn(len(group), k, generator=g) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=g)]
    r[:, 16:32] = r[:, :16]
    r[:, 40:48] = 0.0
    if counts[1]:
        r[counts[0]] = float("nan")
    r[-1, 5], r[len(group) // 2, 9] = float("inf"), float("nan")
    return r.cuda(), group.cuda()


@cuda
@pytest.mark.parametrize("k,n,dtype", [(1024, 512, torch.bfloat16), (256, 128, torch.bfloat16), (1024, 16, torch.float32),
                                       (208, 208, torch.bfloat16), (64, 32, torch.float32), (16, 16, torch.bfloat16)],
                         ids=lambda v: str(v).replace("torch.", ""))  # fmt: skip
@pytest.mark.parametrize("per_token", [False, True], ids=["group", "token"])
def test_cuda_selection_is_the_triton_selection_bit_for_bit(k, n, dtype, per_token):
    """u (BF16 or fp32, written into a strided slot of a stacked operand), S_dec and S with the CUDA selection, under
    every instantiated warp count of this K, equal the Triton sort path's (one run, and runs of 128 merged where K
    allows) and the count path's, byte for byte: empty experts, a lone row, 40 rows in one expert, groups of
    hundreds of rows, masked rows, NaN / inf, exact ties, K not a power of two."""
    from quads.kernels.rac_select import rac_units

    for counts, masked in (([5, 3, 0, 1, 40, 0, 17, 2], 3), ([150, 0, 400, 120], 7)):
        r, group = _rows(k, counts, masked=masked, seed=k + n)
        groups = len(counts)

        def run(r=r, group=group, groups=groups, **kw):
            stacked = torch.full((r.shape[0], 2, k), 7.0, device=r.device, dtype=dtype)
            gs, s = rac_units(r, group, groups, stacked[:, 1], n=n, per_token=per_token, **kw)
            assert (stacked[:, 0] == 7.0).all()  # the other slot untouched
            return stacked[:, 1].contiguous().view(torch.int16), gs.view(torch.int32), s

        want = run(method="count")
        refs = [run(method="sort", select_backend="triton")]
        if k >= 256:
            refs.append(run(method="sort", sort_run=128, select_backend="triton"))
        for ref in refs:
            for a, b in zip(ref, want):
                assert torch.equal(a, b)
        warps = [w for lk, w in rac_select_cuda.CONFIGS if lk == rac_select_cuda.log_kp(k)]
        assert warps
        for w in warps:
            assert rac_select_cuda.supports(r, group, w)
            got = run(method="sort", select_backend="cuda", cuda_warps=w)
            for a, b, what in zip(got, want, ("u", "S_dec", "S")):
                assert torch.equal(a, b), f"{what}: K={k} n={n} per_token={per_token} warps={w} rows={len(group)}"


@cuda
def test_cuda_selection_rank_and_gmax_equal_the_triton_kernel():
    """The kernel's own outputs, not only what the units kernel makes of them: S, rank and gmax (one per group)
    equal ``_rac_select_kernel``'s at the 1b decode shape (1,024 rows over 64 experts, K = 1,024, n = 512)."""
    import triton

    from quads.kernels import rac_select

    k, n, e = 1024, 512, 64
    g = torch.Generator().manual_seed(0)
    group = torch.sort(torch.randint(0, e + 1, (1024,), generator=g)).values.cuda()
    r = (torch.randn(1024, k, generator=g) * torch.logspace(-3, 1, k)).cuda()
    outs = []
    for backend in ("triton", "cuda"):
        s = torch.empty(e, n, dtype=torch.long, device="cuda")
        rank = torch.empty(e, k, dtype=torch.int32, device="cuda")
        gmax = torch.empty(e, dtype=torch.float32, device="cuda")
        if backend == "cuda":
            rac_select_cuda.select(r, group, s, rank, gmax, n=n, groups=e, per_token=False,
                                   warps=rac_select_cuda.default_warps(k))  # fmt: skip
        else:
            rac_select._rac_select_kernel[(e,)](
                r, group, s, rank, gmax, gmax, gmax, 1024, k, n, ONE_GROUP=False, PER_TOKEN=False, ROWS=4,
                BLOCK_G=1024, LOG_K=triton.next_power_of_2(k).bit_length() - 1, LOG_W=0, INTERP=False, num_warps=8,
            )  # fmt: skip
        outs.append((s, rank, gmax))
    for a, b, what in zip(*outs, ("S", "rank", "gmax")):
        assert torch.equal(a, b), what


@cuda
def test_cuda_selection_replays_in_a_graph():
    """``rac_units`` on the CUDA selection captured in a CUDA graph, replayed on new values in the same buffers,
    gives the eager call's bytes (no host sync, no allocation outside the capture)."""
    from quads.kernels.rac_select import rac_units

    counts = [12, 0, 30, 7]
    r, group = _rows(1024, counts, masked=2, seed=1)
    out = torch.zeros(r.shape, device=r.device, dtype=torch.bfloat16)

    def call():
        return rac_units(r, group, len(counts), out, n=512, method="sort", select_backend="cuda")

    call()  # the build and Triton's compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gs, s = call()
    r.copy_(torch.randn(r.shape, generator=torch.Generator().manual_seed(9)).cuda())
    graph.replay()
    got = (out.clone(), gs.clone(), s.clone())
    want = call()
    assert torch.equal(got[0].view(torch.int16), out.view(torch.int16))
    assert torch.equal(got[1], want[0]) and torch.equal(got[2], want[1])


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("k,n,warps,per_token", [(64, 32, 1, False), (256, 128, 2, False), (256, 128, 8, False),
                                                 (48, 16, 1, False), (64, 16, 1, True)],
                         ids=["K64", "K256-E4", "K256-E1", "K48-padded", "per-token"])  # fmt: skip
def test_kernel_on_the_host_equals_the_triton_kernel(host_rac_kernels, k, n, warps, per_token):
    """The CUDA kernel's code run on the host writes ``_rac_select_kernel``'s S, rank and gmax (Triton's interpreter)
    bit for bit: groups with exact norm ties, NaN and inf residuals, an empty group, rows of no group; unless
    ``per_token``, gmax per group and no slot for the rows of no group."""
    import triton

    from quads.kernels import rac_select

    if torch.cuda.is_available():
        pytest.skip("on a GPU the compiled kernel is compared (test_cuda_selection_rank_and_gmax_equal_the_triton_kernel)")
    g = torch.Generator().manual_seed(11)
    counts, masked = [6, 0, 13, 3], 5
    e = len(counts)
    group = torch.cat([torch.full((c,), i) for i, c in enumerate(counts + [masked])]).long()
    r = torch.randn(len(group), k, generator=g) * torch.logspace(-3, 1, k)
    r[:, 16:32] = r[:, :16]  # equal norms
    r[2, 7], r[20, 40 % k] = float("nan"), float("inf")  # groups 0 and 3
    r[-masked:] = 1e30  # rows of no group: never read
    # group 2 (rows 6..18): the n-th selected channel (n - 1, one spike of 3, norm 9) holds the group's largest |r|,
    # below n - 1 channels of norm 13 (ones) and above the rest: gmax is 3 only if the threshold pair counts as in S
    r[6:19] = 1e-3
    r[6:19, : n - 1] = 1.0
    r[10, n - 1] = 3.0
    outs = []
    for backend in ("triton", "host"):
        s = torch.full((e, n), -5, dtype=torch.long)
        rank = torch.full((e, k), -5, dtype=torch.int32)
        gmax = torch.full((e,), -5.0)
        if backend == "host":
            ptrs = [host_kernels.ptr(t) for t in (r, group, s, rank, gmax)]
            rc = host_rac_kernels.quads_rac_select_host(*ptrs, len(group), k, n, e, rac_select_cuda.log_kp(k), warps,
                                                        int(per_token))  # fmt: skip
            assert rc == 0
        else:
            rac_select._rac_select_kernel[(e,)](
                r, group, s, rank, gmax, gmax, gmax, len(group), k, n, ONE_GROUP=False, PER_TOKEN=per_token, ROWS=4,
                BLOCK_G=triton.next_power_of_2(len(group)), LOG_K=triton.next_power_of_2(k).bit_length() - 1, LOG_W=0,
                INTERP=True,
            )  # fmt: skip
        outs.append((s, rank, gmax))
    for a, b, what in zip(*outs, ("S", "rank", "gmax")):
        assert torch.equal(a, b), what
