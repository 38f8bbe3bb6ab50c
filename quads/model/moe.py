"""The sparse MoE block: top-k softmax router, routed SwiGLU experts, optional shared expert.

Legend: ``T`` tokens (B*L flattened), ``H`` hidden, ``E`` experts, ``k`` experts per token,
``I`` expert intermediate size.

Routing (Qwen3-MoE / OLMoE / Mixtral): ``p = softmax(gate(x))`` in at least fp32, the experts are the
top-k of ``p``, their weights ``p[top-k]`` (renormalised to sum 1 when ``norm_topk_prob``), cast to the
compute dtype. Routing replay forces the expert ids; the weights are still the router's own softmax
probabilities of the forced experts, so gradients reach the router as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quads.kernels._common import HAS_TRITON
from quads.kernels.expert_routes import MAX_SLOTS, expert_routes_op, expert_routes_reference
from quads.model import gemm
from quads.model.config import ModelConfig


class MoEExperts(nn.Module):
    """E SwiGLU experts stored fused, exactly as transformers 5 ``Qwen3MoeExperts``.

    ``gate_up_proj`` [E, 2I, H] (rows [:I] gate, [I:] up), ``down_proj`` [E, H, I]. ``quads.quant`` swaps
    this class for a quantized one with the same ``forward`` signature.
    """

    def __init__(self, n_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = n_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, intermediate))

    grouped: bool | None = None  # sorted grouped GEMMs (``sorted_expert_mlp``) or the loop; None = on CUDA

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, k] long, top_k_weights [T, k] -> [T, H].

        out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = index[t, j]. Tokens are
        grouped by expert, then the k weighted outputs of each token are summed in slot order (for k = 2
        this equals transformers' expert-order ``index_add_`` exactly). The experts run as two grouped
        GEMMs over the sorted slots (``sorted_expert_mlp``, no host sync) when ``use_sorted`` allows it
        (``grouped``; None = CUDA tensors only), else as one GEMM pair per expert hit (the reference loop,
        which syncs once to read the counts). The two differ only in the GEMMs' fp32 accumulation order.
        """
        T, k = top_k_index.shape
        if T == 0:
            return torch.zeros_like(hidden_states)
        if use_sorted(self.grouped, hidden_states, self.gate_up_proj, self.down_proj):
            dt = compute_dtype(hidden_states)
            y = sorted_expert_mlp(hidden_states, top_k_index, self.gate_up_proj.to(dt), self.down_proj.to(dt), F.silu)
            return _weighted_slot_sum(y, top_k_weights, hidden_states.dtype)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order kept inside
        counts = torch.bincount(flat, minlength=self.num_experts + 1).tolist()[:self.num_experts]
        x_sorted = hidden_states[order // k]  # [T*k, H]
        ys = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate, up = gemm.linear(x_sorted[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
            ys.append(gemm.linear(F.silu(gate) * up, self.down_proj[e]))  # [n, H]
            start += n
        if not ys:
            return torch.zeros_like(hidden_states)
        y = torch.zeros((T * k, hidden_states.shape[1]), dtype=ys[0].dtype, device=hidden_states.device)
        y[order[:start]] = torch.cat(ys)  # masked slots (id E, sorted last) stay zero
        return _weighted_slot_sum(y, top_k_weights, hidden_states.dtype)

    def forward_static(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
        """``forward`` without a host sync or a data-dependent shape (CUDA-graph capturable).

        The slots are sorted by expert on the device (``static_routes``) and each projection is one
        grouped GEMM with device-side offsets (``grouped_mm``); the k outputs of a token are summed
        as in ``forward``. Same result as ``forward`` up to the GEMM's fp32 accumulation order.
        """
        T, k = top_k_index.shape
        routes = static_routes(top_k_index, self.num_experts)
        xs = hidden_states[routes.order // k]  # [T*k, H] sorted by expert, masked slots last
        gate, up = grouped_mm(xs, self.gate_up_proj, routes).chunk(2, dim=-1)
        ys = grouped_mm(F.silu(gate) * up, self.down_proj, routes)  # [T*k, H], zero rows at masked slots
        y = ys.index_select(0, routes.slot_pos)  # back to slot order [T*k, H]: a gather, fused into the sum
        return _weighted_slot_sum(y, top_k_weights, hidden_states.dtype)


def _weighted_slot_sum(y: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` [T*k, H] in slot order -> sum over each token's k slots of ``w * y``, cast to ``dtype``."""
    T, k = top_k_weights.shape
    y = y.view(T, k, -1) * top_k_weights[..., None].to(y.dtype)
    return y.sum(1).to(dtype)


@dataclass
class StaticRoutes:
    """The ``T * k`` routing slots of ``top_k_index`` [T, k] sorted by expert on the device (no sync).

    ``order`` [T*k]: flat slot at each sorted position (stable: token order within an expert; masked
    slots, expert id ``E``, last); ``slot_pos`` [T*k]: the sorted position of each flat slot (the inverse
    permutation of ``order``); ``expert`` [T*k]: the expert of each sorted position (E = masked);
    ``offsets`` [E+1] long: start of each expert's rows, ``offsets[E]`` = valid slots; ``pos`` [T*k]:
    row of each sorted position inside its expert's group; ``capacity``: rows per expert of a padded
    layout, T (a token visits an expert at most once), fixed by the batch shape alone; ``token_slots``
    [T, k]: each token's sorted positions in ascending expert id, equal ids by slot (``slot_pos`` gathered
    by ``expert_routes.expert_slots``), the rows its outputs are summed from in expert order.
    """

    order: torch.Tensor
    slot_pos: torch.Tensor
    expert: torch.Tensor
    offsets: torch.Tensor
    pos: torch.Tensor
    capacity: int
    n_experts: int
    ends: torch.Tensor  # [E] int32 cumulative ends of experts 0..E-1 (``torch._grouped_mm``'s offsets)
    token_slots: torch.Tensor  # [T, k] long

    @property
    def valid(self) -> torch.Tensor:
        return self.expert < self.n_experts

    def pad(self, xs: torch.Tensor) -> torch.Tensor:
        """Sorted rows ``xs`` [T*k, K] -> ``X_pad`` [E, C, K], zero rows past each expert's count."""
        E, C = self.n_experts, self.capacity
        dest = torch.where(self.valid, self.expert * C + self.pos, E * C)  # masked slots: a spare row
        out = xs.new_zeros(E * C + 1, xs.shape[-1]).index_put_((dest,), xs)
        return out[:E * C].view(E, C, -1)

    def unpad(self, y_pad: torch.Tensor) -> torch.Tensor:
        """``y_pad`` [E, C, N] -> sorted rows [T*k, N]; masked slots get zero rows."""
        E, C, N = y_pad.shape
        flat = torch.cat([y_pad.reshape(E * C, N), y_pad.new_zeros(1, N)])
        return flat[torch.where(self.valid, self.expert * C + self.pos, E * C)]


def static_routes(top_k_index: torch.Tensor, n_experts: int) -> StaticRoutes:
    """Sort the slots of ``top_k_index`` [T, k] (ids in [0, E], E = masked) by expert, on the device: a counting
    sort (``quads.kernels.expert_routes``), one Triton launch on CUDA up to ``expert_routes.MAX_SLOTS`` slots (a
    decode step), torch operations elsewhere (the same integers)."""
    kernel = top_k_index.is_cuda and HAS_TRITON and top_k_index.numel() <= MAX_SLOTS
    routes = expert_routes_op if kernel else expert_routes_reference
    order, slot_pos, expert, pos, offsets, ends, token_slots = routes(top_k_index, n_experts)
    return StaticRoutes(order=order, slot_pos=slot_pos, expert=expert, offsets=offsets, pos=pos,
                        capacity=top_k_index.shape[0], n_experts=n_experts, ends=ends, token_slots=token_slots)


def native_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs ``dtype`` on ``device`` with device-side offsets: BF16 on CUDA
    (CUTLASS on Hopper; other CUDA dtypes copy the offsets to the host), fp32/fp16/bf16 on the CPU."""
    if device.type == "cuda":
        return dtype == torch.bfloat16
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM of ``x`` runs in: the autocast dtype when autocast is on for ``x``'s device
    (it casts every floating operand but fp64, as ``F.linear`` under autocast does), else ``x.dtype``."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return x.dtype


def use_sorted(setting: bool | None, x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the experts of ``x`` [T, H] and ``weights`` [E, N, K] take ``sorted_expert_mlp``.

    ``setting`` (``Recipe.expert_path``): True = grouped, False = the loop, None = auto (grouped on CUDA
    tensors; on the CPU the loop, as fast there). Either way only where ``torch._grouped_mm`` runs the
    compute dtype without a host sync and every operand row is 16-byte aligned (its requirement).
    """
    if not (x.is_cuda if setting is None else setting):
        return False
    dt = compute_dtype(x)
    align = 128 // torch.finfo(dt).bits  # elements per 16 bytes
    return native_grouped_mm(x.device, dt) and all(w.shape[-1] % align == 0 and w.shape[-2] % align == 0
                                                    for w in weights)


def sorted_expert_mlp(x: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      act) -> torch.Tensor:
    """The routed SwiGLU experts as two grouped GEMMs over the slots sorted by expert, differentiable,
    without a host sync: x [T, H], top_k_index [T, k] (ids in [0, E], E = masked), ``gate_up`` [E, 2I, H]
    and ``down`` [E, H, I] weight operands in the compute dtype (autograd flows through them: the master
    weights, or QAT's straight-through operand) -> ``y`` [T*k, H] in slot order, zero rows at masked
    slots (the caller weights and sums each token's k rows).

    ``torch._grouped_mm`` leaves rows past the last offset unwritten, in its output and in the input
    gradient of its backward: ``torch.where`` on the valid rows after each GEMM and on the gathered
    input keeps those rows (masked slots) out of every value and gradient. The gather and scatter are
    permutations (``index_select`` / ``index_copy``), so their backward adds nothing twice; the input is
    cast to the compute dtype after the gather, so the k slot gradients of a token are summed in
    ``x.dtype``, as the loop's indexing backward does.
    """
    T, k = top_k_index.shape
    H, dt = x.shape[-1], gate_up.dtype
    routes = static_routes(top_k_index, gate_up.shape[0])
    valid = routes.valid[:, None]
    slots = x[:, None].expand(T, k, H).reshape(T * k, H)  # slot order; backward sums each token's k rows
    xs = torch.where(valid, slots.index_select(0, routes.order).to(dt), 0.0)  # [T*k, H] sorted by expert
    h = torch.where(valid, torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=routes.ends), 0.0)
    gate, up = h.chunk(2, dim=-1)
    ys = torch.where(valid, torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=routes.ends), 0.0)
    return torch.empty_like(ys).index_copy_(0, routes.order, ys)  # back to slot order [T*k, H]


def grouped_mm(xs: torch.Tensor, w: torch.Tensor, routes: StaticRoutes) -> torch.Tensor:
    """Sorted rows ``xs`` [T*k, K] times each row's expert weight ``w`` [E, N, K] -> [T*k, N] in
    ``xs.dtype``, zero rows at masked slots; no host sync.

    ``torch._grouped_mm`` with device offsets (CUTLASS on Hopper for BF16; fp32/fp16/bf16 on the CPU);
    other cases (CUDA tensors of other dtypes, whose ``_grouped_mm`` copies the offsets to the host;
    fp64) go through the padded layout (``StaticRoutes.pad``) and one ``bmm``.
    """
    w = w.to(xs.dtype)
    if native_grouped_mm(xs.device, xs.dtype):
        y = torch._grouped_mm(xs, w.transpose(-2, -1), offs=routes.ends)
        return torch.where(routes.valid[:, None], y, 0.0)  # rows past the last offset are not written
    return routes.unpad(torch.bmm(routes.pad(xs), w.mT))


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (the shared expert): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = gemm.Linear(hidden, intermediate, bias=False)
        self.up_proj = gemm.Linear(hidden, intermediate, bias=False)
        self.down_proj = gemm.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def top_experts(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest router probabilities of each row of ``probs`` [T, E] and their experts, largest first:
    ``torch.topk``. Under ``torch.compile`` the same result as ``k`` rounds of (max, first index of the max,
    mask it out), which Inductor fuses with the softmax into one kernel, where ``aten.topk`` stays a fallback of
    three CUDA kernels (a radix select, a sort of the k and a gather: ~17 us a call at a decode step's 128 x
    64, ~8% of the 1b's step, run 41). The two agree except on exactly equal probabilities, where ``topk``'s
    choice is unspecified and the rounds take the lower expert id."""
    if not torch.compiler.is_compiling():
        return torch.topk(probs, k, dim=-1)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    vals, idxs, q = [], [], probs
    for _ in range(k):
        v, i = q.max(dim=-1, keepdim=True)
        vals.append(v)
        idxs.append(i)
        q = torch.where(ids == i, -1.0, q)  # probabilities are >= 0: a taken expert is never the max again
    return torch.cat(vals, dim=-1), torch.cat(idxs, dim=-1)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, forced: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (probs [T, E] in >= fp32, top_k_index [T, k] long, top_k_weights [T, k]).

    ``forced`` [T, k] long replays recorded expert ids; rows whose ids are negative (-1: not recorded,
    e.g. padding) fall back to the router's own top-k.
    """
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top_w, top_i = top_experts(probs, top_k)
    if forced is not None:
        forced = forced.to(device=top_i.device, dtype=torch.long)
        if forced.shape != top_i.shape:
            raise ValueError(f"routing replay: expected expert ids of shape {tuple(top_i.shape)} per layer, "
                             f"got {tuple(forced.shape)}")
        keep = (forced >= 0).all(dim=-1, keepdim=True)
        top_i = torch.where(keep, forced, top_i)
        top_w = probs.gather(1, top_i)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return probs, top_i, top_w.to(logits.dtype)


def load_balance_loss(probs: torch.Tensor, top_k_index: torch.Tensor, valid: torch.Tensor | None
                      ) -> torch.Tensor:
    """Switch-Transformer balance loss E * sum_e f_e * P_e over valid tokens (1.0 when uniform).

    f_e: fraction of the T*k routing slots sent to expert e; P_e: mean router probability of e.
    """
    E = probs.shape[-1]
    w = torch.ones(probs.shape[0], device=probs.device, dtype=probs.dtype) if valid is None else valid.to(probs.dtype)
    n = w.sum().clamp_min(1.0)
    hits = F.one_hot(top_k_index, E).to(probs.dtype).sum(1)  # [T, E]
    f = (hits * w[:, None]).sum(0) / (n * top_k_index.shape[1])
    p = (probs * w[:, None]).sum(0) / n
    return E * (f * p).sum()


class MoEBlock(nn.Module):
    """Router (``gate``, nn.Linear(H, E)) + routed ``experts`` (+ ``shared_expert``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = gemm.Linear(cfg.hidden_size, cfg.n_experts, bias=False)
        self.experts = MoEExperts(cfg.n_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = gemm.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                device_dispatch: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (out [T, H], top_k_index [T, k], router probs [T, E]).

        ``rows`` [T] bool (fixed-slot decode): tokens that are False are routed to no expert (their
        slots get the masked id E, so they join no expert's activation scale). ``device_dispatch``:
        the experts' capturable path (``forward_static``) instead of their host-synced one.
        """
        probs, top_i, top_w = route(self.gate(x), self.top_k, self.norm_topk_prob, forced)
        idx = top_i if rows is None else torch.where(rows[:, None], top_i, probs.shape[-1])
        out = self.experts.forward_static(x, idx, top_w) if device_dispatch else self.experts(x, idx, top_w)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out, top_i, probs
