"""The MoE layer's routing slots sorted by expert, in one Triton kernel.

``quads.model.moe.static_routes`` sorts the ``N = T * k`` slots of ``top_k_index`` by expert on the device (a
counting sort: a compare against every expert id, a scan, a scatter). Compiled by Inductor that is five or six
kernels a layer, one of them an ATen fallback (Inductor does not lower a scatter of an int64 source on CUDA),
~15 us of GPU time and as many kernel boundaries in every decode step. Here it is one launch of ``E + 1``
programs:

- ``expert_routes(ids [N] long in [0, E], n_experts=E) -> (order, slot_pos, expert, pos, offsets, ends)``: the
  fields of ``StaticRoutes`` (``order`` / ``slot_pos`` / ``expert`` / ``pos`` ``[N]`` long, ``offsets``
  ``[E+1]`` long, ``ends`` ``[E]`` int32). Program ``e`` (``E``: the masked slots) counts the slots of experts
  before ``e`` (its start), then walks the slots in blocks, ranks its own by an inclusive scan (token order:
  the sort is stable) and writes each one's sorted position and the inverse permutation. Integers only:
  the same values as the reference, bit for bit, on any device.
- ``expert_routes_reference``: ``static_routes``' torch operations, what the kernel is tested against.
- ``quads::expert_routes``: the launcher as one custom op, opaque to ``torch.compile``.
"""

from __future__ import annotations

import torch

from quads.kernels._common import HAS_TRITON

Routes = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def expert_routes_reference(ids: torch.Tensor, n_experts: int) -> Routes:
    """``expert_routes`` by torch operations (a counting sort: one compare, one cumsum along the contiguous dim,
    one scatter); the same arguments and results."""
    n = ids.shape[0]
    flat = ids.long()
    hits = (torch.arange(n_experts + 1, device=flat.device)[:, None] == flat[None, :]).long()  # [E+1, N]
    before = hits.cumsum(1)  # slots of each expert up to and including this one
    counts = before[:, -1] if n else hits.sum(1)
    offsets = torch.cumsum(counts, 0) - counts  # [E+1] starts; offsets[E] = valid slots
    pos_of_slot = before.gather(0, flat[None, :]).squeeze(0) - 1  # rank of each slot within its expert
    dest = offsets[flat] + pos_of_slot  # sorted position of each slot
    # an int32 source: Inductor lowers its scatter (an int64 one is an ATen fallback on CUDA)
    order = torch.empty(n, dtype=torch.int32, device=flat.device).scatter_(
        0, dest, torch.arange(n, dtype=torch.int32, device=flat.device)).long()
    return order, dest, flat[order], pos_of_slot[order], offsets, offsets[1:].to(torch.int32)


def _check(ids: torch.Tensor, n_experts: int) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_routes: ids must be a 1-d int32/int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    if n_experts < 1:
        raise ValueError(f"expert_routes: n_experts must be >= 1, got {n_experts}")


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_routes_kernel(ids_ptr, order_ptr, slot_pos_ptr, expert_ptr, pos_ptr, offsets_ptr, ends_ptr, N, E,
                              BLOCK: tl.constexpr):  # fmt: skip
        """Program e in [0, E] (E: the masked slots): its start = #slots of experts < e, then each of its slots'
        rank (an inclusive scan over the slots in order), sorted position, and the inverse permutation."""
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


def expert_routes(ids: torch.Tensor, n_experts: int, *, block: int = 1024, num_warps: int = 4) -> Routes:
    """The sorted slots (module docstring) in one launch of ``n_experts + 1`` programs; ``ids`` [N] in
    [0, n_experts] (``n_experts``: a masked slot), contiguous."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use expert_routes_reference")
    _check(ids, n_experts)
    ids = ids.contiguous()
    n, dev = ids.shape[0], ids.device
    order, slot_pos, expert, pos = (torch.empty(n, dtype=torch.long, device=dev) for _ in range(4))
    offsets = torch.empty(n_experts + 1, dtype=torch.long, device=dev)
    ends = torch.empty(n_experts, dtype=torch.int32, device=dev)
    bl = max(16, min(block, triton.next_power_of_2(max(n, 1))))
    _expert_routes_kernel[(n_experts + 1,)](ids, order, slot_pos, expert, pos, offsets, ends, n, n_experts,
                                            BLOCK=bl, num_warps=num_warps)  # fmt: skip
    return order, slot_pos, expert, pos, offsets, ends


@torch.library.custom_op("quads::expert_routes", mutates_args=())
def _expert_routes_op(ids: torch.Tensor, n_experts: int) -> Routes:
    return expert_routes(ids, n_experts)


@_expert_routes_op.register_fake
def _(ids, n_experts):
    n = ids.shape[0]
    long = dict(dtype=torch.long, device=ids.device)
    return (*(ids.new_empty(n, **long) for _ in range(4)), ids.new_empty(n_experts + 1, **long),
            ids.new_empty(n_experts, dtype=torch.int32, device=ids.device))


def expert_routes_op(ids: torch.Tensor, n_experts: int) -> Routes:
    """``expert_routes`` as the custom op ``quads::expert_routes`` (opaque to ``torch.compile``)."""
    return torch.ops.quads.expert_routes(ids, n_experts)
