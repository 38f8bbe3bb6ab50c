"""quads.kernels.decode_attention against an fp64 reference and SDPA (CPU: Triton's interpreter at small
sizes; CUDA: the 1b decode shapes)."""

import math

import pytest
import torch
import torch.nn.functional as F

from quads.kernels import decode_attention as da
from quads.kernels._common import interpreter_on

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreter_on(), reason="needs TRITON_INTERPRET=1 on CPU")


def _case(b, h, g, s, d, dtype=torch.bfloat16, seed=0, pad=None):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for n in (g, s, s))
    mask = torch.ones(b, s, dtype=torch.bool)
    for row, p in enumerate(pad or []):
        mask[row, :p] = False  # left padding of a shorter prompt
    return q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV)


def _within_one_rounding(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``got`` (rounded once to its dtype) within one unit in the last place of the fp64 ``ref``, plus the
    fp32 softmax's own error (a few fp32 ulps, far below a bf16 ulp)."""
    eps = torch.finfo(got.dtype).eps
    err = (got.double() - ref).abs()
    bound = eps * ref.abs() + 64 * torch.finfo(torch.float32).eps * ref.abs().amax()
    assert (err <= bound).all(), f"{what}: max error {err.max():.3e}, bound {bound.min():.3e}"


@pytest.mark.parametrize("b,h,g,s,d,n,pad,splits", [
    (2, 2, 2, 40, 32, 40, [0, 7], None),  # every column written, one row left-padded
    (3, 1, 4, 70, 32, 33, [5, 0, 32], 4),  # a short prefix read over 4 splits, a row seeing 1 key
    (1, 2, 1, 64, 64, 64, None, 2),  # g = 1 (no GQA), D 64
    (2, 2, 3, 50, 32, 17, [0, 3], 3),  # g = 3 (padded to 4), uneven splits, the last splits empty
], ids=str)
def test_decode_attention_matches_fp64_reference(b, h, g, s, d, n, pad, splits):
    q, k, v, mask = _case(b, h, g, s, d, pad=pad)
    last = torch.tensor([n - 1], device=DEV)  # n columns written
    got = da.decode_attention(q, k, v, mask, last, block_s=16, splits=splits)
    assert got.dtype == q.dtype and got.shape == q.shape
    _within_one_rounding(got, da.decode_attention_reference(q, k, v, mask, last), f"S={s} n={n}")
    # the engine's path today: SDPA over the whole cache with the mask hiding unwritten columns
    seen = mask & (torch.arange(s, device=DEV) < n)
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=seen[:, None, None, :])
    assert torch.allclose(got.float(), sdpa, rtol=2 * torch.finfo(q.dtype).eps, atol=1e-6)


def test_decode_attention_never_reads_columns_after_last():
    """Columns after ``last`` may hold anything (NaN here): they are not read, even when the mask
    says True there."""
    q, k, v, mask = _case(2, 2, 2, 48, 32)
    n = 21
    k[:, :, n:], v[:, :, n:] = float("nan"), float("nan")
    got = da.decode_attention(q, k, v, mask, torch.tensor([n - 1], device=DEV), block_s=16, splits=2)
    assert torch.isfinite(got).all()
    _within_one_rounding(got, da.decode_attention_reference(q, k[:, :, :n], v[:, :, :n], mask[:, :n], n - 1),
                         "prefix")  # fmt: skip


def test_decode_attention_is_deterministic_and_fp32_works():
    q, k, v, mask = _case(2, 2, 2, 37, 32, dtype=torch.float32, pad=[3, 0])
    last = torch.tensor([36], device=DEV)
    a = da.decode_attention(q, k, v, mask, last, block_s=16, splits=3)
    assert torch.equal(a, da.decode_attention(q, k, v, mask, last, block_s=16, splits=3))
    ref = da.decode_attention_reference(q, k, v, mask, last)
    assert ((a.double() - ref).abs() <= 1e-5 * ref.abs().amax()).all()


def test_decode_attention_fp16_keeps_small_probabilities():
    """FP16: one dominant key and 511 keys of probability ~7e-8 each (in FP16's subnormal range, where a
    plain FP16 copy of p keeps ~1 significant bit): their values still reach the output to its rounding."""
    s, d = 512, 32
    q = torch.zeros(1, 1, 1, d, dtype=torch.float16)
    q[..., 0] = 9.66  # score of key 0: 9.66^2 / sqrt(32) = 16.5; the others score 0: p ~ exp(-16.5)
    k = torch.zeros(1, 1, s, d, dtype=torch.float16)
    k[:, :, 0, 0] = 9.66
    v = torch.full((1, 1, s, d), 64.0, dtype=torch.float16)
    v[:, :, 0] = 0.0  # the output is the small keys' share alone, ~2.2e-3
    mask = torch.ones(1, s, dtype=torch.bool)
    q, k, v, mask = q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV)
    got = da.decode_attention(q, k, v, mask, torch.tensor([s - 1], device=DEV), block_s=64)
    _within_one_rounding(got, da.decode_attention_reference(q, k, v, mask, s - 1), "fp16 small p")


def test_decode_attention_refuses_fp64_and_mixed_dtypes():
    q, k, v, mask = _case(1, 1, 2, 16, 32, dtype=torch.float64)
    n = torch.tensor([15], device=DEV)
    with pytest.raises(ValueError, match="must share one of"):
        da.decode_attention(q, k, v, mask, n)
    with pytest.raises(ValueError, match="must share one of"):
        da.decode_attention(q.float(), k.float(), v.bfloat16(), mask, n)


def test_decode_attention_row_with_no_visible_key_is_zero():
    q, k, v, mask = _case(2, 1, 2, 16, 32)
    mask[1] = False
    got = da.decode_attention(q, k, v, mask, torch.tensor([15], device=DEV), block_s=16)
    assert (got[1] == 0).all() and torch.isfinite(got).all()


def test_decode_attention_rows_false_give_zeros_and_the_rest_the_same_bits():
    """``rows`` (the fixed-slot decode's live rows): what ``torch.where(rows, out, 0)`` gave, bit for bit, and a
    dead row's cache is never read (NaN keys and values there change nothing); a dead row with no visible key
    (plain output zeros anyway) included."""
    q, k, v, mask = _case(4, 2, 2, 40, 32, pad=[0, 3, 0, 9])
    mask[3] = False
    last = torch.tensor([39], device=DEV)
    rows = torch.tensor([True, False, True, False], device=DEV)
    plain = da.decode_attention(q, k, v, mask, last, block_s=16, splits=2)
    assert not (plain[1] == 0).all()
    k[1], v[1] = float("nan"), float("nan")  # row 1 is dead: never read
    got = da.decode_attention(q, k, v, mask, last, rows, block_s=16, splits=2)
    assert torch.equal(got, torch.where(rows[:, None, None, None], plain, 0.0))
    assert (got[1] == 0).all() and torch.isfinite(got).all()
    ref = da.decode_attention_reference(q, k, v, mask, last, rows=rows)
    assert (ref[1] == 0).all() and torch.equal(ref[0], da.decode_attention_reference(q, k, v, mask, last)[0])
    with pytest.raises(ValueError, match="rows must be a bool"):
        da.decode_attention(q, k, v, mask, last, rows[:3])
    with pytest.raises(ValueError, match="rows must be a bool"):
        da.decode_attention(q, k, v, mask, last, rows.long())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_one_split_finished_in_the_split_kernel_is_the_two_launches_bit_for_bit(dtype):
    """With one split the split kernel does the combine's arithmetic and writes the output (``finish_one_split``,
    the default): the same bits as the split kernel + combine, dead rows, a row with no visible key and a value
    column of negative zeros included."""
    q, k, v, mask = _case(4, 2, 3, 40, 32, dtype=dtype, pad=[0, 5, 0, 2])
    mask[2] = False  # no visible key
    v[:, :, :, 3] = -0.0
    last = torch.tensor([30], device=DEV)
    rows = torch.tensor([True, True, True, False], device=DEV)
    for r in (None, rows):
        one = da.decode_attention(q, k, v, mask, last, r, block_s=16, splits=1)
        two = da.decode_attention(q, k, v, mask, last, r, block_s=16, splits=1, finish_one_split=False)
        assert torch.equal(one.view(-1).view(torch.uint8), two.view(-1).view(torch.uint8))
        assert (one[2] == 0).all() and (r is None or (one[3] == 0).all())
    if dtype != torch.float32:
        _within_one_rounding(one[:2], da.decode_attention_reference(q, k, v, mask, last)[:2], "one split")


def test_decode_attention_rejects_bad_shapes():
    q, k, v, mask = _case(2, 2, 2, 16, 32)
    n = torch.tensor([15], device=DEV)
    with pytest.raises(ValueError, match="key_mask"):
        da.decode_attention(q, k, v, mask[:, :8], n)
    with pytest.raises(ValueError, match="disagree"):
        da.decode_attention(q[:1], k, v, mask, n)
    with pytest.raises(ValueError, match="last must be one integer"):
        da.decode_attention(q, k, v, mask, torch.tensor([1.0, 2.0], device=DEV))
    with pytest.raises(ValueError, match="powers of two"):
        da.decode_attention(q, k, v, mask, n, block_s=24)


def test_splits_keep_four_blocks_and_stop_at_four_programs_per_sm():
    assert da.splits_for(512, 128, 32) == 1  # 1b at 64 new tokens: 512 (row, head) pairs, 4 blocks
    assert da.splits_for(512, 4096, 32) == 2  # 512 programs < 4 x 132: one doubling
    assert da.splits_for(8, 4096, 32) == 32  # few rows, a long cache: 32 splits of 4 blocks
    assert da.splits_for(8, 64, 32) == 1
    assert math.log2(da.splits_for(3, 10_000, 32)).is_integer()


@pytest.mark.skipif(DEV != "cuda", reason="real sizes need a CUDA GPU")
@pytest.mark.parametrize("s,n", [(128, 80), (544, 544), (4096, 1500)])
def test_gpu_decode_attention_1b_shapes(s, n):
    q, k, v, mask = _case(128, 4, 4, s, 64, pad=[i % 9 for i in range(128)])
    last = torch.tensor([n - 1], device=DEV)
    got = da.decode_attention(q, k, v, mask, last)
    _within_one_rounding(got, da.decode_attention_reference(q, k, v, mask, last), f"1b S={s}")
    op = torch.compile(lambda *a: da.decode_attention_op(*a), fullgraph=True)
    assert torch.equal(op(q, k, v, mask, last), got)
    rows = torch.arange(128, device=DEV) % 5 != 0
    assert torch.equal(op(q, k, v, mask, last, rows), torch.where(rows[:, None, None, None], got, 0.0))
