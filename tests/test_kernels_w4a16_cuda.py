"""The CUDA grouped W4A16 decode kernel (quads.kernels.w4a16_cuda) against the references, on a GPU.

Bit-exact where the format defines the answer (the decode alone, every code and scale byte under global scales
that take the products out of the normal range, where the kernel's two-rounding table must fall back to the
exact one), the GEMM within the fp32-summation-order tolerance of ``w4a16.grouped_gemm_reference`` and exactly
on identity rows, inside a CUDA graph after a weight refresh. The whole module needs CUDA (the kernel is built
with nvcc on first use); on the CPU it is skipped.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the CUDA W4A16 kernel needs a CUDA GPU (sm_89+) and nvcc; none here", allow_module_level=True)

from test_kernels_w4a16 import _bf16_close, _every_code_and_scale, _rel, _same_bits, _weight  # noqa: E402

from quads.formats import nvfp4  # noqa: E402
from quads.kernels import w4a16, w4a16_cuda  # noqa: E402
from quads.model import moe  # noqa: E402

pytestmark = pytest.mark.skipif(not w4a16_cuda.available(), reason="needs compute capability >= 8.9 and nvcc")


@pytest.mark.parametrize("gbits", [0x3A07CB7C, 0x3F800000, 0xBF800000, 0x7E7FFFFF, 0x00012345, 0x05000000, 0x7A800000,
                                   0x0B000000, 0x7F800000, 0x7FC00000, 0x00000000],
                         ids=["g=5.18e-4", "g=1", "g=-1", "g=8.5e37", "g=1.0e-40", "g=2^-117", "g=2^118", "g=2^-105",
                              "g=inf", "g=nan", "g=0"])  # fmt: skip
def test_cuda_decode_every_code_and_scale_byte_bit_exact(gbits):
    """Every (E2M1 code, E4M3 scale byte) pair: the decode's table from two roundings where exponent shifts
    are exact, the exact table (8 roundings) where they are not (subnormal or overflowing products, NaN / inf,
    zero scales), so the bits are the reference's for every global scale."""
    q = _every_code_and_scale(gbits, nan_scales=True)  # all 256 scale bytes
    want = nvfp4.dequantize(q, torch.bfloat16)
    p = w4a16.pack(q)
    got = w4a16_cuda.decode(p.codes.unsqueeze(0), p.scales.unsqueeze(0), p.global_scale)[0, :, :16]
    assert _same_bits(got, want)


def test_cuda_decode_of_weight_stacks_bit_exact():
    q = _weight((3, 128, 192), experts_amax=True)
    p = w4a16.pack(q)
    got = w4a16_cuda.decode(p.codes, p.scales, p.global_scale)
    assert torch.equal(got.view(torch.int16), nvfp4.dequantize(q, torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("cfg", w4a16_cuda.CONFIGS, ids=str)
def test_cuda_grouped_identity_rows_give_the_weights(cfg):
    """x = identity rows of one expert: every output is one exact product (w * 1) plus exact zeros, so the
    GEMM returns the decoded weight's columns bit for bit, whatever the summation order."""
    ng, nt, warps, ksplit = cfg
    n = 16 * ng * (warps // ksplit) * 2  # two blocks
    q = _weight((1, n, 256))
    p = w4a16.pack(q)
    x = torch.eye(256, dtype=torch.bfloat16, device="cuda")
    ends = torch.tensor([256], dtype=torch.int32, device="cuda")
    y = w4a16_cuda.grouped_gemm(x, p.codes, p.scales, p.global_scale, ends, n, 256, ng=ng, nt=nt, warps=warps,
                                ksplit=ksplit)
    want = nvfp4.dequantize(q, torch.bfloat16)[0].T.contiguous() + 0.0
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("cfg", w4a16_cuda.CONFIGS, ids=str)
@pytest.mark.parametrize("tokens,e,n,k,topk,skew", [(1, 128, 1536, 2048, 8, False), (16, 128, 1536, 2048, 8, False),
                                                    (64, 128, 1536, 2048, 8, False), (128, 64, 512, 1024, 8, False),
                                                    (128, 64, 1024, 256, 8, False), (128, 64, 512, 1024, 8, True)],
                         ids=str)  # fmt: skip
def test_cuda_grouped_matches_the_reference(cfg, tokens, e, n, k, topk, skew):
    """The 1b decode GEMMs and Qwen3-30B-A3B's gate_up, with masked slots (zeros) and, skewed, one expert with
    hundreds of rows (many passes over K): within one BF16 ulp of the reference's fp32 sums."""
    ng, nt, warps, ksplit = cfg
    if n % (16 * ng * (warps // ksplit)):
        pytest.skip("N not a multiple of this config's features per block")
    torch.manual_seed(0)
    w = (torch.randn(e, n, k, device="cuda") * 0.02).bfloat16()
    q = nvfp4.quantize(w, amax=w.float().abs().amax(dim=(-2, -1), keepdim=True))
    p = w4a16.pack(q)
    ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(tokens)])
    if skew:
        ids[:, 0] = 3
    ids.view(-1)[: tokens // 4] = e  # some masked slots
    routes = moe.static_routes(ids, e)
    x = torch.randn(tokens * topk, k, device="cuda").bfloat16()
    got = w4a16_cuda.grouped_gemm(x, p.codes, p.scales, p.global_scale, routes.ends, n, k, ng=ng, nt=nt, warps=warps,
                                  ksplit=ksplit)
    _bf16_close(got, w4a16.grouped_gemm_reference(x, p, routes.ends), f"cuda {cfg} T={tokens} E={e} N={n} K={k}")
    assert _rel(got, w4a16.grouped_gemm(x, p, routes.ends, backend="triton")) < 2.0**-8


@pytest.mark.parametrize("cfg", w4a16_cuda.CONFIGS, ids=str)
def test_cuda_grouped_on_a_one_expert_stack_is_the_dense_gemm(cfg):
    """A single weight as a one-expert stack (``as_stack``, ``ends = [M]``; the bench's dense CUDA rows) at
    M = 1 and 16: within one BF16 ulp of the dense reference."""
    ng, nt, warps, ksplit = cfg
    n, k = 1024, 2048
    torch.manual_seed(1)
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    p = w4a16.pack(nvfp4.quantize(w))
    s = p.as_stack()
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda").bfloat16()
        ends = torch.full((1,), m, dtype=torch.int32, device="cuda")
        got = w4a16_cuda.grouped_gemm(x, s.codes, s.scales, s.global_scale, ends, n, k, ng=ng, nt=nt, warps=warps,
                                      ksplit=ksplit)
        _bf16_close(got, w4a16.gemm_reference(x, p), f"cuda {cfg} dense M={m}")
    if cfg == (2, 1, 4, 4):  # the launcher's dense path (w4a16_grouped_cuda.dense: 2 / null / 4 / 4)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()
            _bf16_close(w4a16.gemm(x, p, kernel="cuda"), w4a16.gemm_reference(x, p), f"gemm kernel=cuda M={m}")


def test_cuda_backend_refuses_what_it_cannot_run():
    """Asked for explicitly, the CUDA backend refuses K not a multiple of 64 (chosen by the table, it would run the
    Triton kernel, as the table's default does here); its graph replay after a weight refresh is
    tests/test_kernels_w4a16.py's, parametrized over the backend."""
    q = nvfp4.quantize(torch.randn(4, 128, 96, device="cuda").bfloat16(), amax=torch.ones(4, 1, 1, device="cuda"))
    x, ends = torch.randn(8, 96, device="cuda").bfloat16(), torch.tensor([2, 4, 6, 8], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="backend='cuda' takes"):
        w4a16.grouped_gemm(x, w4a16.pack(q), ends, backend="cuda")
    _bf16_close(w4a16.grouped_gemm(x, w4a16.pack(q), ends), w4a16.grouped_gemm_reference(x, w4a16.pack(q), ends), "K=96")
