"""The decode's W4A4 + RAC operand in one CUDA launch (``quads.kernels.rac_operand_cuda``) against the launches it
replaces (``group_units`` + ``rac_units``, Triton) and the PyTorch reference steps of ``factored.operands``.

GPU tests (skipped without CUDA and nvcc): the stacked operand, both S_dec and S byte for byte at the 1b decode shapes
(1,024 rows over 64 experts, K = 1,024 / n = 512 and K = 256 / n = 128) and at small shapes with exact norm ties,
empty experts, NaN / inf rows and rows of no group (NaN at the same places, its payload free), for every instantiated
warp count, in BF16 and fp32; its replay in a CUDA graph; a compiled call. On the CPU: the per-element cast built
for the host, and the kernel's own code run on the host (``tests/csrc/cuda_host_shim.h``: threads, barriers and warp
shuffles emulated), against the reference. CPU tests: the launcher's contract (the instantiations the Python side asks for are the ones
the extension compiles; where the kernel cannot run, the launches run and give the same bytes; an unknown backend is
a clear error).
"""

from __future__ import annotations

import re

import host_kernels
import pytest
import torch
from test_quant_factored import _rac_rows, _same_bits  # _same_bits: NaN compared by place

from quads.kernels import cuda_build, dispatch, rac_operand_cuda
from quads.kernels._common import HAS_TRITON
from quads.kernels.rac_select_cuda import log_kp
from quads.quant import factored

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and rac_operand_cuda.available()),
                          reason="needs a CUDA GPU and nvcc")  # fmt: skip


def _rows(seed: int, k: int, counts: list[int], masked: int, device: str = "cpu", special: bool = True):
    """``test_quant_factored._rac_rows`` (rows sorted by group, exact norm ties, zero channels) with large values in the
    rows of no group and, with ``special``, a NaN in one row and an inf in another."""
    x, segs = _rac_rows(seed, k, counts, masked)
    if special and x.shape[0] > masked + 3:
        x[1, 5] = float("nan")
        x[2, 9] = float("inf")
    if masked:
        x[-masked:] *= 1000
    return x.to(device), factored.Segments.of(segs.group.to(device), segs.groups)


def test_configs_are_the_extension_instantiations():
    """``CONFIGS`` is exactly the ``QUADS_CASE`` list of ``rac_operand.cu`` (a config missing there would fail at
    launch), each with 1, 2, 4 or 8 channels a thread, and the default warps of every K up to ``MAX_K`` is one."""
    text = (cuda_build.CSRC / "rac_operand.cu").read_text()
    cases = tuple((int(a), int(b)) for a, b in re.findall(r"^\s*QUADS_CASE\((\d+), (\d+)\)", text, flags=re.M))
    assert cases == rac_operand_cuda.CONFIGS
    for lk, warps in cases:
        assert (1 << lk) // (32 * warps) in (1, 2, 4, 8)
    for k in range(16, rac_operand_cuda.MAX_K + 1, 16):
        assert (log_kp(k), rac_operand_cuda.default_warps(k)) in rac_operand_cuda.CONFIGS, k
    assert rac_operand_cuda.default_warps(1024) == 16 and rac_operand_cuda.default_warps(256) == 4


def test_plan_checks_the_backend_and_where_the_kernel_runs():
    """``plan``: an unknown backend is a ValueError naming the valid ones; ``launches`` never runs the kernel; on a
    CPU tensor ``cuda`` does not either (the launches run instead)."""
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="valid: launches, cuda"):
        rac_operand_cuda.plan(x, torch.float32, backend="one")
    assert rac_operand_cuda.plan(x, torch.float32, backend="launches") is None
    assert rac_operand_cuda.plan(x, torch.float32, backend="cuda") is None
    assert not rac_operand_cuda.supports(x, torch.float32, 1)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_cuda_backend_where_it_cannot_run_gives_the_launches_bytes():
    """``operands(operand_backend="cuda")`` where the kernel cannot run (here the CPU, Triton's interpreter) runs the
    launches: the same bytes as ``"launches"``."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernel runs: test_one_launch_equals_the_launches_and_the_reference")
    x, segs = _rows(0, 64, [5, 0, 7], 4)
    with dispatch.kernels("triton"):
        a = factored.operands(x, segs, n=32, dtype=torch.float32, operand_backend="launches")
        b = factored.operands(x, segs, n=32, dtype=torch.float32, operand_backend="cuda")
    assert _same_bits(a.u, b.u) and _same_bits(a.g, b.g) and torch.equal(a.channels, b.channels)


@pytest.fixture(scope="module")
def host_cast(tmp_path_factory):
    """``csrc/nvfp4_cast.cuh`` (the kernels' per-element NVFP4 cast) built for the host."""
    return host_kernels.build("nvfp4_cast_host.cpp", tmp_path_factory.mktemp("nvfp4_cast"))


def _cast_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows over 60 decades with zeros, -0.0, fp32 subnormals, NaN, +-inf, and elements at E2M1's rounding ties
    (x * enc = 0.25, 0.75, ..., 5 for the block's scale); amax: each row's NaN-ignoring max, and rows with 0, inf, a
    larger given amax, one below the row's, a subnormal one."""
    g = torch.Generator().manual_seed(seed)
    m, k = 64, 128
    x = torch.randn(m, k, generator=g) * torch.pow(10.0, torch.empty(m, 1).uniform_(-30, 30, generator=g))
    x[0] = 0.0
    x[1, ::2] = -0.0
    x[2] = torch.randn(k, generator=g) * 1e-40  # fp32 subnormals
    x[3, 5] = float("nan")
    x[4, 17] = float("inf")
    x[5, 33] = float("-inf")
    x[6, :16] = float("nan")
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    # whole rows of ties: the block amax is the row amax, so enc = 1 / c and x * enc hits the ties exactly for c a
    # power of two (near them otherwise)
    x[7:12] = ties.repeat(k // 16) * torch.tensor([1.0, 0.5, 2.0**-20, 3.0, 448.0 / 6.0])[:, None]
    amax = x.abs().nan_to_num(nan=0.0).amax(dim=1)
    amax[12], amax[13], amax[14], amax[15], amax[16] = 0.0, float("inf"), amax[14] * 37.0, amax[15] / 3.0, 1e-41
    return x.contiguous(), amax.contiguous()


@pytest.mark.parametrize("seed", [0, 1])
def test_host_build_of_the_kernels_cast_equals_the_reference(host_cast, seed):
    """The CUDA kernels' NVFP4 cast (``csrc/nvfp4_cast.cuh``, shared by ``rac_operand.cuh``), compiled for the host:
    u = e2m1 * s, its BF16 bits, S_dec and the residual equal ``quantize_units_reference`` (``nvfp4.scaled_values``)
    bit for bit, NaN where it has NaN, on rows with every special value and E2M1's rounding ties."""
    from quads.kernels.factored_quant import quantize_units_reference

    x, amax = _cast_rows(seed)
    m, k = x.shape
    u, r = torch.empty(m, k), torch.empty(m, k)
    ub, g = torch.empty(m, k, dtype=torch.int16), torch.empty(m)
    ptr = host_kernels.ptr
    host_cast.quads_units_rows(ptr(x), ptr(amax), m, k, ptr(u), ptr(ub), ptr(g), ptr(r))
    want_u, want_g, want_r = quantize_units_reference(x, amax, dtype=torch.float32, residual=True)
    want_ub = want_u.to(torch.bfloat16)
    for got, want, name in ((u, want_u, "u"), (g, want_g, "S_dec"), (r, want_r, "r"),
                            (ub.view(torch.bfloat16), want_ub, "u bf16")):
        assert _same_bits(got, want), name


def test_host_build_of_e4m3_rounding_equals_torch(host_cast):
    """``e4m3_rne`` of every multiple of 2^-12 in [0, 448] and of the midpoints between E4M3 values: the value and
    byte of torch's float8_e4m3fn cast (round to nearest even)."""
    import ctypes

    grid = torch.arange(0, 448 * 4096 + 1, dtype=torch.float64) / 4096
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[:-1].double() + vals[1:].double()) / 2
    v = torch.cat([grid, mids]).float().contiguous()
    val, byte = torch.empty_like(v), torch.empty(v.shape, dtype=torch.int32)
    host_cast.quads_e4m3_rne(host_kernels.ptr(v), ctypes.c_int(v.numel()), host_kernels.ptr(val),
                             host_kernels.ptr(byte))
    want = v.to(torch.float8_e4m3fn)
    assert torch.equal(val, want.float())
    assert torch.equal(byte, want.view(torch.uint8).int())


def _run_host_kernel(lib, x: torch.Tensor, segs: factored.Segments, n: int, warps: int):
    """The kernel's outputs (out [M, 2, K], g [M, 2], S [G, n]) for ``x`` on the host, the buffers pre-filled with
    junk so that anything it fails to write shows."""

    m, k = x.shape
    groups = segs.groups
    offs = segs.row_offsets().contiguous()
    out = torch.full((m, 2, k), 7.0, dtype=x.dtype)
    g = torch.full((m, 2), 7.0)
    s = torch.full((groups, n), -5, dtype=torch.long)
    r = torch.empty(m, k)
    zero_blocks = max(1, -(-m // rac_operand_cuda.ZERO_ROWS_PER_BLOCK))
    ptrs = [host_kernels.ptr(t) for t in (x, offs, out, g, r, s)]
    rc = lib.quads_rac_operand_host(*ptrs, m, k, n, groups, log_kp(k), warps, zero_blocks, int(x.dtype == torch.bfloat16))
    assert rc == 0, "no host instantiation for this (K, warps)"
    return out, g, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "k,n,counts,masked,warps",
    [(32, 16, [3, 2], 1, 1), (64, 32, [5, 0, 7], 4, 1), (48, 16, [4, 4], 2, 1), (128, 64, [2, 70, 1], 3, 1),
     (128, 64, [2, 70, 1], 3, 2), (256, 128, [3, 17, 0, 2], 6, 1), (256, 128, [3, 17, 0, 2], 6, 4),
     (1024, 512, [12, 0, 30], 9, 16)],
    ids=["K32-E1", "K64-E2", "K48-padded", "K128-E4-70rows", "K128-E2", "K256-E8", "K256-E2", "K1024-16warps"],
)
def test_kernel_on_the_host_equals_the_reference(host_rac_kernels, k, n, counts, masked, warps, dtype):
    """The kernel's own code, run on the host (``cuda_host_shim.h``), gives the reference's operand: u (NaN by place),
    both S_dec and S bit for bit, on rows with ties, empty experts, NaN / inf, rows of no group, an expert of 70 rows
    (several row chunks), K padded to a power of two, 1, 2, 4 and 8 channels a thread, BF16 and fp32."""
    x, segs = _rows(1, k, counts, masked)
    x = x.to(dtype).contiguous()
    out, g, s = _run_host_kernel(host_rac_kernels, x, segs, n, warps)
    with dispatch.kernels("reference"):
        ref = factored.operands(x, segs, n=n, dtype=dtype)
    assert _same_bits(out, ref.u) and _same_bits(g, ref.g) and torch.equal(s, ref.channels)


def test_kernel_on_the_host_at_a_1b_decode_shape(host_rac_kernels):
    """1,024 sorted rows over 64 experts, some slots masked (the down projection's K = 256, n = 128, 4 warps), BF16:
    the reference's operand."""
    g = torch.Generator().manual_seed(5)
    group = torch.sort(torch.randint(0, 65, (1024,), generator=g)).values
    x = (torch.randn(1024, 256, generator=g) * torch.logspace(-3, 1, 256)).bfloat16()
    segs = factored.Segments.of(group, 64)
    out, gs, s = _run_host_kernel(host_rac_kernels, x, segs, 128, 4)
    with dispatch.kernels("reference"):
        ref = factored.operands(x, segs, n=128, dtype=torch.bfloat16)
    assert _same_bits(out, ref.u) and _same_bits(gs, ref.g) and torch.equal(s, ref.channels)


def _compare(x, segs, n, dtype, warps):
    """The one launch against the launches (Triton) and the reference steps: u, g, S byte for byte."""
    with dispatch.kernels("triton"):
        assert rac_operand_cuda.plan(x, dtype, backend="cuda", warps=warps) == warps
        got = factored.operands(x, segs, n=n, dtype=dtype, operand_backend="cuda")
        torch.cuda.synchronize()
        # the same call with the kernel off
        launches = factored.operands(x, segs, n=n, dtype=dtype, operand_backend="launches")
    with dispatch.kernels("reference"):
        ref = factored.operands(x, segs, n=n, dtype=dtype)
    where = f"K={x.shape[1]} n={n} dtype={dtype} warps={warps} rows={x.shape[0]}"
    for want, name in ((launches, "launches"), (ref, "reference")):
        assert _same_bits(got.u, want.u), f"u vs {name}: {where}"
        assert _same_bits(got.g, want.g), f"S_dec vs {name}: {where}"
        assert torch.equal(got.channels, want.channels), f"S vs {name}: {where}"


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_launch_equals_the_launches_and_the_reference(dtype, monkeypatch):
    """Small shapes with ties, empty groups, NaN / inf and rows of no group, every instantiated warp count of each
    K: the same bytes as the launches and the reference."""
    for k, n, counts, masked in ((64, 32, [5, 0, 7], 4), (64, 16, [1, 9], 0), (256, 128, [3, 17, 0, 2], 6),
                                 (1024, 512, [12, 0, 30], 9), (48, 16, [4, 4], 2)):
        x, segs = _rows(1, k, counts, masked, "cuda")
        x = x.to(dtype)
        for lk, warps in rac_operand_cuda.CONFIGS:
            if lk == log_kp(k):
                monkeypatch.setattr(rac_operand_cuda, "default_warps", lambda _k, w=warps: w)
                _compare(x, segs, n, dtype, warps)


@cuda
@pytest.mark.parametrize("k,n", [(1024, 512), (256, 128)], ids=["gate_up", "down"])
def test_one_launch_at_the_1b_decode_shape(k, n):
    """1,024 sorted rows over 64 experts (128 tokens x top-8, some slots masked), BF16: the same bytes as the
    launches and the reference, with the default warps."""
    g = torch.Generator().manual_seed(5)
    group = torch.sort(torch.randint(0, 65, (1024,), generator=g)).values.cuda()
    x = (torch.randn(1024, k, generator=g) * torch.logspace(-3, 1, k)).cuda().bfloat16()
    segs = factored.Segments.of(group, 64)
    _compare(x, segs, n, torch.bfloat16, rac_operand_cuda.default_warps(k))


@cuda
def test_one_launch_replays_in_a_cuda_graph():
    """Captured once and replayed on new rows in the same buffers: the bytes of an eager call on those rows."""
    g = torch.Generator().manual_seed(7)
    group = torch.sort(torch.randint(0, 9, (96,), generator=g)).values.cuda()
    segs = factored.Segments.of(group, 8)
    offsets = segs.row_offsets()
    x = torch.randn(96, 256, generator=g).cuda().bfloat16()
    out = torch.empty(96, 2, 256, dtype=torch.bfloat16, device="cuda")
    warps = rac_operand_cuda.default_warps(256)
    rac_operand_cuda.operand(x, offsets, 8, out, n=128, warps=warps)  # builds, warms up
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        g2, s = rac_operand_cuda.operand(x, offsets, 8, out, n=128, warps=warps)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn(96, 256, generator=g).cuda().bfloat16() * 3)
    graph.replay()
    torch.cuda.synchronize()
    want_out = torch.empty_like(out)
    want = rac_operand_cuda.operand(x, offsets, 8, want_out, n=128, warps=warps)
    assert _same_bits(out, want_out) and _same_bits(g2, want[0]) and torch.equal(s, want[1])


@cuda
def test_one_launch_in_a_compiled_function():
    """``factored.operands`` under ``torch.compile(fullgraph=True)`` (the decode step is compiled): the launch plan is
    a constant of the trace, the op has its fake, and the compiled call gives the eager call's bytes."""
    x, segs = _rows(3, 256, [5, 9, 0, 3], 7, "cuda", special=False)
    x = x.bfloat16()

    def f(x):
        op = factored.operands(x, segs, n=128, dtype=torch.bfloat16, operand_backend="cuda")
        return op.u, op.g, op.channels

    with dispatch.kernels("triton"):
        want = f(x)
        got = torch.compile(f, fullgraph=True)(x)
    assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1]) and torch.equal(got[2], want[2])
