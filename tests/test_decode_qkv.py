"""quads.kernels.decode_qkv (the decode step's q/k norm + RoPE + cache write) against the model's own eager
operations (CPU: Triton's interpreter at small sizes; CUDA: the 1b decode shapes)."""

import pytest
import torch

from quads.kernels import decode_qkv as dq
from quads.kernels._common import interpreter_on

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreter_on(), reason="needs TRITON_INTERPRET=1 on CPU")


def _case(b, nh, nkv, d, s, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype).to(DEV)

    pos_f = (torch.arange(b)[:, None].double() + 1) * 37.0 * torch.rand(d, generator=gen, dtype=torch.float64)
    args = dict(q=rnd(b, nh * d, scale=3.0), k=rnd(b, nkv * d, scale=0.5), v=rnd(b, nkv * d),
                q_weight=rnd(d, scale=0.1, shift=1.0), k_weight=rnd(d, scale=0.1, shift=1.0), eps=1e-6,
                cos=pos_f.cos().to(dtype).to(DEV), sin=pos_f.sin().to(dtype).to(DEV),
                k_cache=rnd(b, nkv, s, d), v_cache=rnd(b, nkv, s, d))
    args["q"][0] = 0.0  # a finished row of the fixed-slot decode: zeros in, zeros out
    return args


def _within_one_rounding(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """The kernel and the eager operations differ only in the fp32 sum of squares' order and rsqrt's rounding
    (a few fp32 ulps of a head's scale), which moves a normed value by at most one rounding of its dtype; RoPE
    then mixes two of them, so the bound is relative to the head's largest value (a rotated value may
    cancel to near zero)."""
    eps = torch.finfo(got.dtype).eps
    err = (got.double() - ref.double()).abs()
    bound = 4 * eps * ref.double().abs().amax(-1, keepdim=True) + torch.finfo(got.dtype).tiny
    assert (err <= bound).all(), f"{what}: max error {err.max():.3e}"


@pytest.mark.parametrize("b,nh,nkv,d,s,p", [(3, 4, 2, 32, 10, 4), (2, 2, 2, 64, 5, 0), (1, 8, 1, 16, 3, 2)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_decode_qkv_matches_the_eager_operations(b, nh, nkv, d, s, p, dtype):
    a = _case(b, nh, nkv, d, s, dtype)
    r = {n: (t.clone() if torch.is_tensor(t) else t) for n, t in a.items()}
    pos = torch.tensor([p], device=DEV)
    got = dq.decode_qkv(**a, pos=pos)
    ref = dq.decode_qkv_reference(**r, pos=pos)
    assert got.shape == (b, nh, d) and got.dtype == dtype
    _within_one_rounding(got, ref, "q")
    assert (got[0] == 0).all()
    _within_one_rounding(a["k_cache"][:, :, p], r["k_cache"][:, :, p], "k column")
    assert torch.equal(a["v_cache"], r["v_cache"])  # the value column copied, the rest untouched
    other = torch.arange(s, device=DEV) != p
    assert torch.equal(a["k_cache"][:, :, other], r["k_cache"][:, :, other])
    assert not torch.equal(a["k_cache"][:, :, p], _case(b, nh, nkv, d, s, dtype)["k_cache"][:, :, p])  # written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_qkv_reads_the_column_slices_of_one_fused_projection(dtype):
    """q, k, v as the column slices of one ``[B, (nh + 2 nkv) D]`` output (a fused q/k/v projection): the same
    bits as from contiguous copies, q_out and both caches."""
    b, nh, nkv, d, s, p = 3, 4, 2, 32, 7, 5
    a = _case(b, nh, nkv, d, s, dtype)
    fused = torch.cat([a["q"], a["k"], a["v"]], dim=1)
    sl = dict(zip("qkv", fused.split([nh * d, nkv * d, nkv * d], dim=1)))
    assert not sl["k"].is_contiguous() and dq.rows_contiguous(sl["k"])
    c = {n: (t.clone() if torch.is_tensor(t) else t) for n, t in a.items()}
    pos = torch.tensor([p], device=DEV)
    got = dq.decode_qkv(**{**a, **sl}, pos=pos)
    want = dq.decode_qkv(**c, pos=pos)
    assert torch.equal(got, want)
    assert torch.equal(a["k_cache"], c["k_cache"]) and torch.equal(a["v_cache"], c["v_cache"])


def test_decode_qkv_refuses_bad_operands():
    a = _case(2, 4, 2, 32, 6, torch.bfloat16)
    pos = torch.tensor([1], device=DEV)
    with pytest.raises(ValueError, match="one of bf16, fp16, fp32"):
        dq.decode_qkv(**{**a, "cos": a["cos"].float()}, pos=pos)
    with pytest.raises(ValueError, match="q must be"):
        dq.decode_qkv(**{**a, "q": a["q"][:, :96]}, pos=pos)
    with pytest.raises(ValueError, match="caches must be"):
        dq.decode_qkv(**{**a, "v_cache": a["v_cache"][:, :, :3]}, pos=pos)
    with pytest.raises(ValueError, match="norm weights"):
        dq.decode_qkv(**{**a, "k_weight": a["k_weight"][:16]}, pos=pos)
    with pytest.raises(ValueError, match="pos must be one integer"):
        dq.decode_qkv(**a, pos=torch.tensor([1, 2], device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        dq.decode_qkv(**{**a, "q": a["q"].t().contiguous().t()}, pos=pos)


@pytest.mark.skipif(DEV != "cuda", reason="the 1b decode shapes, on the GPU")
def test_decode_qkv_1b_shapes_on_the_gpu():
    a = _case(128, 16, 4, 64, 128, torch.bfloat16)
    r = {n: (t.clone() if torch.is_tensor(t) else t) for n, t in a.items()}
    pos = torch.tensor([77], device=DEV)
    got = torch.ops.quads.decode_qkv(*a.values(), pos)
    ref = dq.decode_qkv_reference(**r, pos=pos)
    _within_one_rounding(got, ref, "q")
    _within_one_rounding(a["k_cache"][:, :, 77], r["k_cache"][:, :, 77], "k column")
    assert torch.equal(a["v_cache"], r["v_cache"])
