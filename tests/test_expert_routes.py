"""quads.kernels.expert_routes (the MoE slots sorted by expert in one launch) against its torch reference
(``moe.static_routes``' counting sort) and torch's stable argsort, integer for integer (CPU: Triton's interpreter;
CUDA: also the decode step's size)."""

import pytest
import torch

from quads.kernels import expert_routes as er
from quads.kernels._common import interpreter_on

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreter_on(), reason="needs TRITON_INTERPRET=1 on CPU")
NAMES = ("order", "slot_pos", "expert", "pos", "offsets", "ends", "token_slots")


def _ids(t, k, e, masked_rows=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if k <= e else \
        torch.randint(0, e, (t, k), generator=gen)
    ids[:masked_rows] = e  # finished rows of the fixed-slot decode: every slot masked (id E)
    if t > 3:
        ids[3, k // 2:] = e  # a row that keeps some of its experts
    return ids.to(DEV)


def _check_against_the_stable_sort(got, top_k_index, e):
    order, slot_pos, expert, pos, offsets, ends, token_slots = got
    t, k = top_k_index.shape
    ids, n = top_k_index.reshape(-1), t * k
    assert torch.equal(order, torch.argsort(ids, stable=True))
    assert torch.equal(expert, ids[order])
    assert torch.equal(slot_pos[order], torch.arange(n, device=ids.device))  # the inverse permutation
    counts = torch.bincount(ids, minlength=e + 1)
    assert torch.equal(offsets, torch.cumsum(counts, 0) - counts)
    assert torch.equal(ends, (torch.cumsum(counts, 0)[:e]).to(torch.int32))
    assert torch.equal(pos, torch.arange(n, device=ids.device) - offsets[expert])
    # each token's sorted rows in expert order: its slots' sorted positions, ascending (the sort is stable)
    assert torch.equal(token_slots, torch.sort(slot_pos.view(t, k), dim=1).values)


@pytest.mark.parametrize("t,k,e,masked,block,block_e", [(16, 4, 8, 2, 1024, 64), (37, 8, 64, 5, 1024, 64),
                                                        (37, 8, 64, 5, 64, 16), (5, 2, 1, 1, 16, 2),
                                                        (128, 8, 64, 20, 256, 64), (1, 1, 3, 0, 16, 16),
                                                        (40, 6, 4, 7, 32, 8)], ids=str)  # fmt: skip
def test_expert_routes_are_the_reference_and_the_stable_sort(t, k, e, masked, block, block_e):
    """Also with an expert's rows over several passes (block_e below its count) and k no power of two."""
    ids = _ids(t, k, e, masked)
    got = er.expert_routes(ids, e, block=block, block_e=block_e)
    ref = er.expert_routes_reference(ids, e)
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    _check_against_the_stable_sort(got, ids, e)


def test_expert_routes_of_no_slots_and_of_int32_ids():
    got = er.expert_routes(torch.empty(0, 8, dtype=torch.long, device=DEV), 4)
    assert [x.numel() for x in got] == [0, 0, 0, 0, 5, 4, 0] and (got[4] == 0).all() and (got[5] == 0).all()
    ids = _ids(9, 3, 6, 1)
    for a, b in zip(er.expert_routes(ids.int(), 6), er.expert_routes_reference(ids, 6)):
        assert torch.equal(a, b)


def test_expert_routes_refuses_bad_operands():
    with pytest.raises(ValueError, match="2-d int32/int64"):
        er.expert_routes(torch.zeros(6, dtype=torch.long, device=DEV), 4)
    with pytest.raises(ValueError, match="2-d int32/int64"):
        er.expert_routes(torch.zeros(4, 2, device=DEV), 4)
    with pytest.raises(ValueError, match="n_experts must be >= 1"):
        er.expert_routes(torch.zeros(4, 2, dtype=torch.long, device=DEV), 0)


def test_expert_routes_op_compiles_without_a_graph_break():
    ids = _ids(12, 4, 8, 2)
    op = torch.compile(lambda x: er.expert_routes_op(x, 8), fullgraph=True)
    for a, b in zip(op(ids), er.expert_routes_reference(ids, 8)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
