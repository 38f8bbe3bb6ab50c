"""The MoE layer's routing slots sorted by expert, in one Triton kernel.

``quads.model.moe.static_routes`` sorts the ``N = T * k`` slots of ``top_k_index`` by expert on the device (a
counting sort: a compare against every expert id, a scan, a scatter). Compiled by Inductor that is five or six
kernels a layer, one of them an ATen fallback (Inductor does not lower a scatter of an int64 source on CUDA),
~15 us of GPU time and as many kernel boundaries in every decode step. Here it is one launch of ``E + 1``
programs:

- ``expert_routes(top_k_index [T, k] in [0, E], n_experts=E) -> (order, slot_pos, expert, pos, offsets, ends,
  token_slots)``: the fields of ``StaticRoutes`` (``order`` / ``slot_pos`` / ``expert`` / ``pos`` ``[N]``
  long, ``offsets`` ``[E+1]`` long, ``ends`` ``[E]`` int32, ``token_slots`` ``[T, k]`` long: each token's
  sorted rows in ascending expert id, equal ids by slot, i.e. ``slot_pos`` gathered by ``expert_slots``).
  Program ``e`` (``E``: the masked slots) counts the slots of experts before ``e`` (its start), then walks
  the slots in blocks, ranks its own by an inclusive scan (token order: the sort is stable) and writes each
  one's sorted position and the inverse permutation; then it reads its own sorted rows back (a few per expert
  at decode) and places each among its token's k slots by k compares (``expert_rank``). Integers only: the
  same values as the reference, bit for bit, on any device.
- ``expert_routes_reference``: ``static_routes``' torch operations, what the kernel is tested against;
  ``expert_rank`` / ``expert_slots``: a slot's place among its token's slots in expert order, and its inverse.
- ``quads::expert_routes``: the launcher as one custom op, opaque to ``torch.compile``.
"""

from __future__ import annotations

import torch

from quads.kernels._common import HAS_TRITON

# the kernel's slots at most where the engine takes it: each program walks every slot twice, so it is 2.5x faster
# than Inductor's compiled reference at a decode step's 1,024 slots and 0.69x at a prefill's 16,384 (run 49)
MAX_SLOTS = 4096
Routes = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def expert_rank(top_k_index: torch.Tensor) -> torch.Tensor:
    """``[T, k]``: each slot's place among its token's k slots in ascending expert id, equal ids (masked slots)
    by slot index: the inverse permutation of a stable argsort, by k x k compares (pointwise, no sort kernel)."""
    k = top_k_index.shape[-1]
    e, j = top_k_index, torch.arange(k, device=top_k_index.device)
    before = (e[:, None, :] < e[:, :, None]) | ((e[:, None, :] == e[:, :, None]) & (j[None, :] < j[:, None]))
    return before.sum(-1)  # [t, j]: the slots j' of token t that come before j


def expert_slots(top_k_index: torch.Tensor) -> torch.Tensor:
    """``[T, k]``: each token's slots in ascending expert id, equal ids by slot index (a stable argsort of each
    row): the inverse of ``expert_rank``, by k x k compares (pointwise, no sort kernel)."""
    k = top_k_index.shape[-1]
    j = torch.arange(k, device=top_k_index.device)
    return ((expert_rank(top_k_index)[:, None, :] == j[None, :, None]) * j[None, None, :]).sum(-1)


def expert_routes_reference(top_k_index: torch.Tensor, n_experts: int) -> Routes:
    """``expert_routes`` by torch operations (a counting sort: one compare, one cumsum along the contiguous dim,
    one scatter; ``expert_slots`` by compares); the same arguments and results."""
    _check(top_k_index, n_experts)
    t, k = top_k_index.shape
    n = t * k
    flat = top_k_index.reshape(-1).long()
    hits = (torch.arange(n_experts + 1, device=flat.device)[:, None] == flat[None, :]).long()  # [E+1, N]
    before = hits.cumsum(1)  # slots of each expert up to and including this one
    counts = before[:, -1] if n else hits.sum(1)
    offsets = torch.cumsum(counts, 0) - counts  # [E+1] starts; offsets[E] = valid slots
    pos_of_slot = before.gather(0, flat[None, :]).squeeze(0) - 1  # rank of each slot within its expert
    dest = offsets[flat] + pos_of_slot  # sorted position of each slot
    # an int32 source: Inductor lowers its scatter (an int64 one is an ATen fallback on CUDA)
    order = torch.empty(n, dtype=torch.int32, device=flat.device).scatter_(
        0, dest, torch.arange(n, dtype=torch.int32, device=flat.device)).long()
    token_slots = dest.view(t, k).gather(1, expert_slots(top_k_index))
    return order, dest, flat[order], pos_of_slot[order], offsets, offsets[1:].to(torch.int32), token_slots


def _check(ids: torch.Tensor, n_experts: int) -> None:
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_routes: top_k_index must be a 2-d int32/int64 tensor [T, k], got "
                         f"{tuple(ids.shape)} {ids.dtype}")
    if n_experts < 1:
        raise ValueError(f"expert_routes: n_experts must be >= 1, got {n_experts}")


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_routes_kernel(ids_ptr, order_ptr, slot_pos_ptr, expert_ptr, pos_ptr, offsets_ptr, ends_ptr,
                              token_slots_ptr, N, E, K, BLOCK: tl.constexpr, KP: tl.constexpr,
                              BLOCK_E: tl.constexpr):  # fmt: skip
        """Program e in [0, E] (E: the masked slots): its start = #slots of experts < e, then each of its slots'
        rank (an inclusive scan over the slots in order), sorted position and the inverse permutation; then, over
        its own sorted rows only (read back from ``order``, BLOCK_E at a time), each slot's place among its
        token's K slots (KP: K padded to a power of two)."""
        e = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        below = tl.zeros((BLOCK,), tl.int32)
        for s in range(0, N, BLOCK):
            f = tl.load(ids_ptr + s + i, mask=s + i < N, other=E + 1).to(tl.int32)
            below += (f < e).to(tl.int32)
        start = tl.sum(below, axis=0)
        tl.store(offsets_ptr + e, start.to(tl.int64))
        seen = start * 0
        for s in range(0, N, BLOCK):
            f = tl.load(ids_ptr + s + i, mask=s + i < N, other=E + 1).to(tl.int32)
            hit = f == e
            h = hit.to(tl.int32)
            r = seen + tl.cumsum(h, axis=0) - 1  # rank within the expert, in slot order
            dest = start + r
            tl.store(slot_pos_ptr + s + i, dest.to(tl.int64), mask=hit)
            tl.store(order_ptr + dest, (s + i).to(tl.int64), mask=hit)
            tl.store(expert_ptr + dest, (dest * 0 + e).to(tl.int64), mask=hit)
            tl.store(pos_ptr + dest, r.to(tl.int64), mask=hit)
            seen += tl.sum(h, axis=0)
        if e < E:
            tl.store(ends_ptr + e, start + seen)
        # each of this expert's slots placed among its token's slots in expert order (expert_rank): the token's
        # slots of a lower expert, and of this one at a lower slot index. Over the expert's own rows (a few per
        # expert at decode), read back from ``order`` after a barrier (this program's stores, visible to its threads)
        tl.debug_barrier()
        jj = tl.arange(0, KP)
        c = tl.arange(0, BLOCK_E)
        for c0 in range(0, seen, BLOCK_E):
            cm = c0 + c < seen
            d = start + c0 + c
            slot = tl.load(order_ptr + d, mask=cm, other=0).to(tl.int32)
            tok = slot // K
            j = slot - tok * K
            other = tl.load(ids_ptr + tok[:, None] * K + jj[None, :], mask=cm[:, None] & (jj[None, :] < K),
                            other=E + 1).to(tl.int32)  # fmt: skip
            before = (other < e) | ((other == e) & (jj[None, :] < j[:, None]))
            place = tl.sum(before.to(tl.int32), axis=1)
            tl.store(token_slots_ptr + tok * K + place, d.to(tl.int64), mask=cm)


def expert_routes(top_k_index: torch.Tensor, n_experts: int, *, block: int = 1024, block_e: int = 64,
                  num_warps: int = 4) -> Routes:
    """The sorted slots (module docstring) in one launch of ``n_experts + 1`` programs; ``top_k_index`` [T, k]
    in [0, n_experts] (``n_experts``: a masked slot). ``block``: slots per pass of a program; ``block_e``: its
    own rows per pass when it places them among their tokens' slots (launch options: the same integers)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use expert_routes_reference")
    _check(top_k_index, n_experts)
    t, k = top_k_index.shape
    ids = top_k_index.contiguous()
    n, dev = t * k, ids.device
    order, slot_pos, expert, pos = (torch.empty(n, dtype=torch.long, device=dev) for _ in range(4))
    offsets = torch.empty(n_experts + 1, dtype=torch.long, device=dev)
    ends = torch.empty(n_experts, dtype=torch.int32, device=dev)
    token_slots = torch.empty(t, k, dtype=torch.long, device=dev)
    bl = max(16, min(block, triton.next_power_of_2(max(n, 1))))
    _expert_routes_kernel[(n_experts + 1,)](ids, order, slot_pos, expert, pos, offsets, ends, token_slots, n,
                                            n_experts, max(k, 1), BLOCK=bl, KP=triton.next_power_of_2(max(k, 1)),
                                            BLOCK_E=block_e, num_warps=num_warps)  # fmt: skip
    return order, slot_pos, expert, pos, offsets, ends, token_slots


@torch.library.custom_op("quads::expert_routes", mutates_args=())
def _expert_routes_op(ids: torch.Tensor, n_experts: int) -> Routes:
    return expert_routes(ids, n_experts)


@_expert_routes_op.register_fake
def _(ids, n_experts):
    t, k = ids.shape
    long = dict(dtype=torch.long, device=ids.device)
    return (*(ids.new_empty(t * k, **long) for _ in range(4)), ids.new_empty(n_experts + 1, **long),
            ids.new_empty(n_experts, dtype=torch.int32, device=ids.device), ids.new_empty(t, k, **long))


def expert_routes_op(ids: torch.Tensor, n_experts: int) -> Routes:
    """``expert_routes`` as the custom op ``quads::expert_routes`` (opaque to ``torch.compile``)."""
    return torch.ops.quads.expert_routes(ids, n_experts)
