"""Quantized modules that replace a model's linear and expert layers in place (``quantize_model``).

They hold the *same* ``nn.Parameter`` objects as the module they replace (no weight copy; state-dict
names unchanged) and keep the original module to restore it (``dequantize_model``).

Weight operands (``WeightStore``):
- trainer side: ``QDQ(W)`` is cached and recomputed only when the parameter changes, detected by
  its version counter (bumped by every in-place update: optimizer steps, ``load_state_dict``,
  ``copy_``) plus its data pointer, device and dtype; so the forward and backward of one step
  quantize each weight once. Writes through ``param.data`` bypass the counter: call ``refresh()``.
  The stores of one model are peers (``link_stores``, by ``quantize_model``): the first one found stale
  in a step refreshes every stale one (``refresh_stores``: ``ops.qat_weights``, on a Triton device two
  kernel launches per weight shape for all layers), and a compiled forward refreshes them all before
  its region (``refresh_stale``). Only the dequantized operand is kept (no codes: the trainer's GEMMs
  read ``QDQ(W)``, the rollout's weight sync quantizes its own).
- rollout side: the quantized weight (the ``NVFP4Tensor`` codes/scales and its dequantized copy in
  the recipe's ``weight_dtype``) is produced at sync time (``refresh()``) and used as is by every
  forward; it is only recomputed if the parameter moves to another device. W4A16 and W4A4(+RAC)
  (canonical NVFP4, BF16 weights) on a Triton device keep no dequantized copy: the GEMMs read the
  packed 4-bit weight (``quads.kernels.w4a16``; W4A4 as the weight operand of the factored GEMM,
  ``quads.quant.factored``), its layout built at sync time, in place on re-sync, and ``get()`` decodes
  the operand from those bytes when asked (weight-sync fingerprints, static RAC priors, diagnostics).
  FP8 W8A8 (``fp8_scaled.supports``) on a GPU with FP8 tensor cores keeps only the E4M3 codes and FP32
  scales (``fp8.FP8Tensor``), which ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` read
  (``quads.quant.fp8_scaled``), likewise in place on re-sync, ``get()`` their dequantized operand.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from quads.formats import fp8
from quads.kernels import dispatch, w4a16
from quads.kernels.expert_routes import expert_rank
from quads.model import moe
from quads.quant import factored, fp8_scaled, grouped, ops, qat
from quads.quant.amplify import amplify_weight
from quads.quant.linear import spec_linear
from quads.quant.rac import StaticChannelSelector, rac_channels
from quads.quant.recipe import LinearSpec

SIDES = ("trainer", "rollout")


def reads_packed_weight(spec: LinearSpec, weight_dtype: torch.dtype) -> bool:
    """Whether rollout GEMMs under ``spec`` can read the packed 4-bit weight (``quads.kernels.w4a16``) instead of
    its dequantized operand: NVFP4 weights in the canonical mode with BF16 weights, unquantized (W4A16) or NVFP4
    (W4A4, +RAC: the factored GEMM's weight operand) activations, no mismatch amplifier (its GEMM forms the
    amplified weight from ``QDQ(W)``). The stores here and vLLM's (``quads.rollout.vllm.experts``) both ask it."""
    return (spec.act in ("none", "nvfp4") and spec.weight == "nvfp4" and spec.nvfp4_mode == "te"
            and spec.error_scale == 1.0 and weight_dtype == torch.bfloat16)


class WeightStore:
    """The weight operand of one parameter under one spec (see the module docstring)."""

    def __init__(self, owner: nn.Module, name: str, spec: LinearSpec, dtype: torch.dtype, side: str) -> None:
        self.owner, self.name, self.spec, self.dtype, self.side = owner, name, spec, dtype, side
        self.w_q: torch.Tensor | None = None  # dequantized operand, [N, K] or [E, N, K]
        self.w_q32: torch.Tensor | None = None  # its fp32 copy for fp32 GEMMs (``get_f32``; rollout side)
        self.w_amp: torch.Tensor | None = None  # the amplified fp32 operand (``get_amplified``; rollout side)
        self.packed = None  # NVFP4Tensor for NVFP4 weights (codes, scales, global scales), beside w_q
        self.kernel: w4a16.W4A16Weight | None = None  # rollout packed GEMMs: the weight (no w_q, no packed)
        self.fp8: fp8.FP8Tensor | None = None  # rollout FP8 tensor-core GEMMs: codes and scales (no w_q)
        self.key: tuple | None = None
        self.n_quantize = 0  # how many times this weight was quantized (tests, benchmarks)
        # trainer side: the stores refreshed together when this one is found stale (``link_stores``)
        self.peers: list[WeightStore] = [self]

    @property
    def param(self) -> torch.Tensor:
        """The owner's parameter *now* (looked up each time: FSDP2 or a user may swap the object)."""
        return getattr(self.owner, self.name)

    def _key(self) -> tuple:
        p = self.param
        return (p._version, p.data_ptr(), p.device, p.dtype)

    def stale(self) -> bool:
        """Trainer side: whether the parameter changed since the cache was made (or there is none)."""
        return self.w_q is None or self._key() != self.key

    def _set(self, w_q: torch.Tensor) -> None:
        """Trainer side: cache the operand ``w_q`` of the parameter as it is now."""
        self.w_q, self.packed, self.kernel, self.w_q32, self.w_amp, self.fp8 = w_q, None, None, None, None, None
        self.key = self._key()
        self.n_quantize += 1

    def refresh(self) -> torch.Tensor:
        """Quantize the current parameter now.

        Trainer side: the operand only (``ops.qat_weights``; ``refresh_stores`` does many at once). On the
        rollout side the new operand is copied into the existing tensors when their shapes
        match, so a CUDA graph that captured them (the engine's decode step) reads the synced weights
        with no re-capture. Returns the operand; None when only the packed weight is kept.
        """
        if self.packed_gemm():
            new = w4a16.pack(ops.nvfp4_weight(self.param, self.spec, self.dtype))
            if self.kernel is None or not self.kernel.copy_(new):
                self.kernel = new
            self.packed, self.w_q, self.w_q32, self.w_amp, self.fp8 = None, None, None, None, None  # unpack: codes
            self.key = self._key()
            self.n_quantize += 1
            return None
        if self.fp8_gemm():
            new8, old = fp8_scaled.quantize_weight(self.param, self.spec, self.dtype), self.fp8
            if (old is not None and old.granularity == new8.granularity and _same_layout(old.data, new8.data)
                    and _same_layout(old.scale, new8.scale)):
                old.data.copy_(new8.data)  # in place: a captured step keeps reading them
                old.scale.copy_(new8.scale)
            else:
                self.fp8 = new8
            self.packed, self.kernel, self.w_q, self.w_q32, self.w_amp = None, None, None, None, None
            self.key = self._key()
            self.n_quantize += 1
            return None
        self.fp8 = None
        if self.side == "trainer":
            self._set(ops.qat_weights([self.param], self.spec, self.dtype)[0])
            return self.w_q
        self.kernel = None
        w_q, packed = ops.quantize_weight(self.param, self.spec, self.dtype)
        if self.side == "rollout" and _same_layout(self.w_q, w_q) and (packed is None) == (self.packed is None):
            self.w_q.copy_(w_q)
            if packed is not None:
                for name in ("codes", "scales", "global_scale"):
                    old, new = getattr(self.packed, name), getattr(packed, name)
                    if _same_layout(old, new):
                        old.copy_(new)
                    else:
                        setattr(self.packed, name, new)
        else:
            self.w_q, self.packed = w_q, packed
        # the fp32 operands kept beside w_q, in place too (a captured step reads them), or dropped
        for name, value in (("w_q32", lambda: self.w_q), ("w_amp", lambda: amplify_weight(self.param, self.w_q, self.spec))):
            kept = getattr(self, name)
            if kept is not None and kept.shape == self.w_q.shape and kept.device == self.w_q.device:
                kept.copy_(value())
            else:
                setattr(self, name, None)
        self.key = self._key()
        self.n_quantize += 1
        return self.w_q

    def get_f32(self) -> torch.Tensor:
        """The operand in fp32, kept beside it (same values; refreshed in place with it), so the
        emulated fp32 GEMMs of the captured decode step do not convert the weights at every step."""
        w = self.get()
        if w.dtype == torch.float32 or self.spec.weight == "none":  # unquantized: the live parameter
            return w.float()
        if self.w_q32 is None or self.w_q32.shape != w.shape or self.w_q32.device != w.device:
            self.w_q32 = w.float()
        return self.w_q32

    def get_amplified(self) -> torch.Tensor:
        """The mismatch amplifier's weight operand ``W + alpha (QDQ(W) - W)`` in fp32
        (``quads.quant.amplify.amplify_weight``; ``spec.error_scale`` = alpha), kept beside the operand and
        refreshed in place with it, so the captured decode step neither forms it per step nor re-captures."""
        w = self.get()
        if self.w_amp is None or self.w_amp.shape != w.shape or self.w_amp.device != w.device:
            self.w_amp = amplify_weight(self.param, w, self.spec)
        return self.w_amp

    def packed_gemm(self) -> bool:
        """Whether this weight's GEMMs read the packed 4-bit weight: rollout side, a spec and weight dtype
        ``reads_packed_weight`` allows, a BF16 parameter, Triton kernels on its device."""
        p = self.param
        return (self.side == "rollout" and reads_packed_weight(self.spec, self.dtype) and p.dtype == torch.bfloat16
                and dispatch.use_triton(p))  # fmt: skip

    def fp8_gemm(self) -> bool:
        """Whether this weight's GEMMs read its FP8 codes and scales on FP8 tensor cores (``fp8_scaled``): rollout
        side, a spec ``fp8_scaled.supports``, a BF16 parameter (BF16 activations), a GPU that has them."""
        p = self.param
        return (self.side == "rollout" and fp8_scaled.supports(self.spec, p.dim()) and p.dtype == torch.bfloat16
                and fp8_scaled.on_tensor_cores(p, p.dim()))

    def use_fp8(self, x: torch.Tensor) -> bool:
        """Whether a GEMM of activations ``x`` runs ``fp8_scaled`` (FP8 codes kept, BF16 ``x`` on their device)."""
        return (self.fp8 is not None and x.dtype == torch.bfloat16 and x.device == self.fp8.data.device
                and fp8_scaled.on_tensor_cores(x, self.fp8.data.dim()))

    def get_fp8(self) -> fp8.FP8Tensor:
        """The FP8 codes and scales (refreshed first if the parameter moved device)."""
        if self.fp8 is None or self.fp8.data.device != self.param.device:
            self.refresh()
        return self.fp8

    def use_packed(self, x: torch.Tensor) -> bool:
        """Whether a GEMM of activations ``x`` reads the packed weight (a packed weight is kept, x is
        BF16, and the kernel backend runs Triton on x)."""
        return self.kernel is not None and w4a16.supports(x) and dispatch.use_triton(x)

    def get_packed(self) -> w4a16.W4A16Weight:
        """The packed W4A16 weight (refreshed first if the parameter moved device)."""
        if self.kernel is None or self.kernel.device != self.param.device:
            self.refresh()
        return self.kernel

    def get(self) -> torch.Tensor:
        if self.spec.weight == "none":
            return self.param.detach()
        if self.side == "trainer":
            if torch.compiler.is_compiling() and self.w_q is not None:
                return self.w_q  # traced: the cache, checked eagerly before the call (``refresh_stale``)
            if self.stale():  # with every stale peer, at once
                refresh_stores([s for s in self.peers if s is self or (s.stale() and _local(s.param))])
            return self.w_q
        if self.kernel is not None:  # the operand, decoded from the bytes the packed GEMM reads
            return _decode(self.get_packed())
        if self.fp8 is not None:  # ops.quantize_weight's operand, from the codes and scales the FP8 GEMM reads
            return fp8.dequantize(self.get_fp8(), self.dtype)
        if self.w_q is None:
            w_q = self.refresh()
            return w_q if w_q is not None else self.get()  # None: the packed or FP8 codes kept, decoded above
        if self.w_q.device != self.param.device:
            return self.refresh()
        return self.w_q


def _decode(w: w4a16.W4A16Weight) -> torch.Tensor:
    """The BF16 operand of a packed weight: the GEMMs' own decode on a Triton device (one launch,
    ``w4a16.dequantize_bf16``), else its PyTorch twin ``w4a16.dequantize`` (the same bits)."""
    return w4a16.dequantize_bf16(w) if dispatch.use_triton(w.codes) else w4a16.dequantize(w)


def _same_layout(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (a is not None and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and a.data_ptr() != b.data_ptr())


def _local(p: torch.Tensor) -> bool:
    """Whether ``p`` holds its whole value here: not an FSDP2 shard (a ``DTensor``, which a module's
    parameter is outside its own forward; quantizing it would gather it or read one shard)."""
    if not torch.distributed.is_available():
        return True
    from torch.distributed.tensor import DTensor

    return not isinstance(p, DTensor)


def refresh_stores(stores: list[WeightStore]) -> None:
    """Re-quantize the trainer-side ``stores`` now, the weights of one spec and operand dtype in one
    ``ops.qat_weights`` call (Triton: two launches per weight shape; the same bits as one ``refresh`` each).
    Their old operands are dropped first, so the new ones can take their memory."""
    groups: dict[tuple, list[WeightStore]] = {}
    for s in stores:
        if s.side != "trainer":
            raise ValueError(f"refresh_stores refreshes the trainer's QAT cache; {s.name} is on the {s.side} side, "
                             "call its refresh()")
        groups.setdefault((s.spec, s.dtype), []).append(s)
    for (spec, dtype), group in groups.items():
        for s in group:
            s.w_q = None
        for s, w_q in zip(group, ops.qat_weights([s.param for s in group], spec, dtype), strict=True):
            s._set(w_q)


def trainer_stores(model: nn.Module) -> list[WeightStore]:
    """The quantized trainer-side weight stores of ``model`` (module order)."""
    return [s for m in model.modules() if isinstance(m, _QuantizedBase) and m.side == "trainer"
            for s in m.stores.values() if s.spec.weight != "none"]


def link_stores(model: nn.Module) -> int:
    """Make the trainer-side weight stores of ``model`` peers: the first one found stale in a step
    (``WeightStore.get``: after an optimizer step, the first quantized layer of the forward) refreshes
    every stale one at once (``refresh_stores``). Returns the number of stores linked."""
    stores = trainer_stores(model)
    for s in stores:
        s.peers = stores
    return len(stores)


def refresh_stale(model: nn.Module) -> None:
    """Re-quantize every trainer-side weight of ``model`` whose parameter changed since its cache was
    made (``WeightStore.get``'s check, run eagerly), all at once (``refresh_stores``). A compiled forward
    calls this first: inside the traced region ``get`` returns the cache as it is (its check reads
    ``data_ptr`` and the version counter, which a graph cannot); the trainer benchmark times it as the
    step's refresh phase."""
    refresh_stores([s for s in trainer_stores(model) if s.stale() and _local(s.param)])


class _QuantizedBase(nn.Module):
    """Shared bookkeeping: spec, side, weight stores, static RAC selectors, the original module."""

    def _setup(
        self, original: nn.Module, spec: LinearSpec, side: str, weight_dtype: torch.dtype, groups: int
    ) -> None:
        if side not in SIDES:
            raise ValueError(f"unknown side {side!r}; valid: {', '.join(SIDES)}")
        self.spec, self.side, self.weight_dtype = spec, side, weight_dtype
        self._original = (original,)  # a tuple hides it from nn.Module registration
        self.stores: dict[str, WeightStore] = {}
        self.selectors = nn.ModuleDict()
        static = spec.static_rac
        for name in self.weight_names:
            p = getattr(self, name)
            if "nvfp4" in (spec.act, spec.weight):
                ops.check_k(p.shape[-1], f"{type(original).__name__}.{name}")
            self.stores[name] = WeightStore(self, name, spec, weight_dtype, side)
            if static:
                self.selectors[name] = StaticChannelSelector(groups, p.shape[-1])
        if side == "rollout":
            self.refresh()

    @property
    def original(self) -> nn.Module:
        return self._original[0]

    def refresh(self) -> None:
        """Re-quantize every weight now and refresh the static RAC orders (weight sync calls this)."""
        if self.spec.weight != "none" and self.side == "trainer":
            refresh_stores(list(self.stores.values()))
        elif self.spec.weight != "none":
            for store in self.stores.values():
                store.refresh()
        self.refresh_static()

    def refresh_static(self) -> int:
        """Re-sort the static RAC orders from the statistics since the last refresh; returns groups updated.

        Groups without statistics take the column norms of the weight operand as a prior.
        """
        n = 0
        for name, sel in self.selectors.items():
            w_q = self.stores[name].get()
            n += sel.refresh(prior=w_q.float().square().sum(dim=-2))  # [groups, K] weight column norms
        return n

    def weight_operands(self) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
        """``{param_name: (master parameter, weight operand)}``, all operands at once (tests; weight sync
        fingerprints the stores' operands one at a time, ``ReplicaTarget.verify``)."""
        return {name: (getattr(self, name), store.get()) for name, store in self.stores.items()}

    def _gemm(
        self, name: str, group: int | None, x: torch.Tensor, w_q: factored.Weight, w: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One GEMM of ``x`` with weight ``name`` (expert ``group`` of a stack); ``w``: that master slice;
        ``w_q``: the operand (a packed ``w4a16.W4A16Weight`` only for a whole weight, ``group`` None)."""
        if w is None:
            p = getattr(self, name)
            w = p if group is None else p[group]
        wq = w_q if group is None else w_q[group]
        static = observe = None
        sel = self.selectors[name] if name in self.selectors else None
        if sel is not None:
            g = 0 if group is None else group
            static = sel.channels(g, rac_channels(w.shape[-1], self.spec.rac_ratio))
            observe = functools.partial(sel.observe, g)
        bias = getattr(self, "bias", None) if group is None else None
        return spec_linear(x, w, self.spec, w_q=wq, bias=bias, static_channels=static, observe=observe)

    def extra_repr(self) -> str:
        return f"side={self.side}, spec={self.spec.describe()}"


class QuantizedLinear(_QuantizedBase):
    """Drop-in for ``nn.Linear``: ``y = x @ W.T + b`` computed under a ``LinearSpec``."""

    weight_names = ("weight",)

    def __init__(self, linear: nn.Linear, spec: LinearSpec, *, side: str, weight_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter
        self.bias = linear.bias
        self._setup(linear, spec, side, weight_dtype, groups=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = self.stores["weight"]
        if store.use_fp8(x):  # FP8 W8A8 on FP8 tensor cores
            return fp8_scaled.linear(x, store.get_fp8(), self.bias)
        if not store.use_packed(x):
            return self._gemm("weight", None, x, store.get())
        if self.spec.act == "nvfp4":  # W4A4(+RAC): the factored GEMM reads the packed weight
            return self._gemm("weight", None, x, store.get_packed())
        y = w4a16.linear_op(x.reshape(-1, x.shape[-1]), store.get_packed()).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def expert_groups(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_experts: int,
                  slots: grouped.SlotOrder | None = None):
    """Yield ``(e, idx [c], w_route [c])`` for every expert ``e`` hit by ``top_k_index`` [T, k].

    Slots are grouped by expert with a stable sort (``grouped.sort_slots``, or ``slots`` when the
    caller already sorted them), so ``idx`` (token rows routed to ``e``) is in token order and unique
    within one expert; ``w_route`` are their router weights. Shared by every experts loop (quads'
    layers and the vLLM fused-MoE method) so they visit tokens identically.
    """
    slots = slots if slots is not None else grouped.sort_slots(top_k_index, n_experts)
    tok = slots.order // slots.k  # [T*k] token of each slot
    wts = top_k_weights.reshape(-1)[slots.order]
    start = 0
    for e, c in enumerate(slots.counts.tolist()):
        if c == 0:
            continue
        yield e, tok[start : start + c], wts[start : start + c]
        start += c


def scatter_expert_output(out: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, w_route: torch.Tensor) -> None:
    """``out[idx] += y * w_route`` in place. ``idx`` is unique within one expert, so this equals
    ``index_add_`` bit for bit, and ``index_put_(accumulate=True)`` is ~100x faster in BF16 on CPU."""
    out.index_put_((idx,), (y * w_route[:, None]).to(out.dtype), accumulate=True)


def shares_operands(spec: LinearSpec, x: torch.Tensor) -> bool:
    """Whether an experts loop over ``x`` may build its activation operands once per layer call
    (``shared_operand_experts``): canonical NVFP4 activations with dynamic RAC or none, on the CPU with the
    reference kernels (not Triton's interpreter), no gradients."""
    return (spec.act == "nvfp4" and spec.nvfp4_mode == "te" and spec.error_scale == 1.0 and not spec.static_rac
            and x.device.type == "cpu" and not dispatch.use_triton(x) and not torch.is_grad_enabled())


def shared_operand_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, n_experts: int,
                           spec: LinearSpec, act_fn, gate_up, down, slots: grouped.SlotOrder | None = None,
                           ) -> torch.Tensor:  # fmt: skip
    """The experts loop (``x`` [T, H] -> [T, H], as ``QuantizedExperts.forward``) with its W4A4 (+RAC) operands
    built once for all experts' rows (where ``shares_operands``): the rows sorted by expert as
    ``factored.Segments`` (each expert's amax, RAC norms and channels in the order of its rows alone:
    ``factored.operands(counts=)``), then each expert's GEMMs and sum as in the loop. Each expert gets the
    per-expert loop's operands, products and outputs bit for bit from ~1/E of its quantize calls (the loop's cost
    on the CPU at decode). ``gate_up(e)`` / ``down(e)``: expert ``e``'s weight operand (a tensor)."""
    out = torch.zeros_like(x)
    slots = slots if slots is not None else grouped.sort_slots(top_k_index, n_experts)
    groups = list(expert_groups(top_k_index, top_k_weights, n_experts, slots))
    if not groups:
        return out
    counts = slots.counts.tolist()  # the rows of each expert, as expert_groups visits them
    segs = factored.Segments.of(torch.repeat_interleave(torch.arange(n_experts, device=x.device), slots.counts),
                                n_experts)

    def products(a: torch.Tensor, operand) -> list[torch.Tensor]:
        """Each expert's ``spec_linear`` of its rows of ``a`` (sorted by expert), from one ``operands`` call."""
        first = operand(groups[0][0])  # fetched one expert at a time, as the loop does (a packed stack decodes each)
        op = factored.operands(a, segs, n=rac_channels(a.shape[-1], spec.rac_ratio), dtype=factored.gemm_dtype(first),
                               counts=counts, per_token=spec.act_scale == "token")
        ys, start = [], 0
        for i, (e, idx, _) in enumerate(groups):
            end = start + idx.numel()  # the expert's rows in fresh tensors, as the loop has them
            w_q = first if i == 0 else operand(e)
            ys.append(factored.product(op.u[start:end].clone(), op.g[start:end], w_q).to(a.dtype))
            start = end
        return ys

    gate_up_y = products(x[torch.cat([idx for _, idx, _ in groups])], gate_up)
    h = torch.cat([act_fn(gate) * up for gate, up in (y.chunk(2, dim=-1) for y in gate_up_y)])
    for (_, idx, w_route), y in zip(groups, products(h, down), strict=True):
        scatter_expert_output(out, idx, y, w_route)
    return out


def _sum_parts(parts: torch.Tensor) -> torch.Tensor:
    """``parts`` ``[T, k, H]`` summed over k, one add at a time in that order, as the experts loop accumulates."""
    out = torch.zeros_like(parts[:, 0])
    for j in range(parts.shape[1]):
        out = out + parts[:, j]
    return out


def _sum_in_expert_order(per_slot: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: each token's k weighted expert outputs ``per_slot`` ``[T, k, H]`` (slot order) summed in
    ascending expert id, one add at a time, as the experts loop accumulates them."""
    T, k, H = per_slot.shape
    rank = expert_rank(top_k_index)
    return _sum_parts(torch.empty_like(per_slot).scatter_(1, rank[..., None].expand(T, k, H), per_slot))


class ExpertOperands(Protocol):
    """What ``sorted_experts`` reads of one expert stack's weight ``[E, N, K]``: ``WeightStore`` on quads' rollout
    side, ``quads.rollout.vllm.experts.VllmExpertOperands`` inside vLLM."""

    @property
    def param(self) -> torch.Tensor: ...  # the master weight (the padded path's FP8 / amplified GEMMs)

    def use_packed(self, x: torch.Tensor) -> bool: ...  # GEMMs of ``x`` read ``get_packed()``

    def get_packed(self) -> w4a16.W4A16Weight: ...

    def use_fp8(self, x: torch.Tensor) -> bool: ...  # GEMMs of ``x`` read ``get_fp8()`` (``fp8_scaled``)

    def get_fp8(self) -> fp8.FP8Tensor: ...

    def get(self) -> torch.Tensor: ...  # the dequantized operand QDQ(W)

    def get_f32(self) -> torch.Tensor: ...

    def get_amplified(self) -> torch.Tensor: ...


def sorted_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                   spec: LinearSpec, stores: Mapping[str, ExpertOperands],
                   selectors: Mapping[str, StaticChannelSelector], act_fn, num_experts: int) -> torch.Tensor:
    """The rollout experts ``[T, H]`` without a host sync or a data-dependent shape (quads' captured decode step,
    and vLLM's quads method): ``stores["gate_up_proj"]`` ``[E, 2I, H]`` and ``stores["down_proj"]`` ``[E, H, I]``
    under ``spec`` (``grouped.supports(spec)``), static RAC orders in ``selectors`` (same keys) when ``spec`` has
    them.

    The slots are sorted on the device (``quads.model.moe.static_routes``). Unquantized
    activations: one grouped GEMM per projection over the sorted rows (``moe.grouped_mm``, the
    same ``x @ Wop.T`` in ``x.dtype``; W4A16 with a packed weight: ``w4a16.grouped_gemm``, the same
    product read from the 4-bit weight). NVFP4 activations (canonical mode): ``grouped.sorted_linear``
    on the sorted rows (per-expert global scales and RAC channel sets by masked reductions, one
    grouped GEMM of the exact NVFP4 values per projection, fp32 global scales on its output; the
    quantized operands are the loop's bit for bit, see ``quads.quant.factored``; a packed weight is
    read by the grouped W4A16 kernel). FP8 W8A8 with the weight's codes kept (``use_fp8``: FP8 tensor cores):
    ``fp8_scaled.grouped`` over the sorted rows (``torch._scaled_grouped_mm``). Other FP8 activations, and any
    spec under the mismatch amplifier
    (``error_scale != 1``: the operands of ``quads.quant.amplify``, the weight's kept amplified by its
    store): the padded layout of ``quads.quant.grouped`` at the fixed capacity C = T (zero rows change
    no amax) and ``grouped_linear``. Outputs summed per token in ascending expert order, as the loop does.
    """
    T, k = top_k_index.shape
    routes = moe.static_routes(top_k_index, num_experts)
    tokens = routes.order // k  # [T*k] the token of each sorted row (masked slots last)

    amplified = spec.amplified
    sorted_rows = spec.act == "nvfp4" and spec.nvfp4_mode == "te" and not amplified
    segs = factored.Segments.of(routes.expert, num_experts, routes.offsets) if sorted_rows else None
    stacked = grouped.stacked_routes(routes, 2 if spec.rac_ratio > 0 else 1) if sorted_rows else None

    def gemm(name: str, a: torch.Tensor, rows: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> torch.Tensor:
        """The sorted rows ``a`` (``rows`` given: ``a[rows]``) times the expert weights ``name``; ``scale``
        ``[T*k]``: each output row times it, eager ``y * scale[:, None].to(y.dtype)``'s bits (the grouped W4A16
        kernel in its epilogue: no ``[T*k, N]`` pass of its own)."""
        store = stores[name]
        if spec.act == "none" and not amplified and store.use_packed(a):  # the kernel gathers the rows itself
            return w4a16.grouped_op(a, store.get_packed(), routes.ends, rows,
                                    None if scale is None else scale.to(a.dtype))
        if store.use_fp8(a):  # FP8 W8A8 on FP8 tensor cores, the sorted rows as they are
            y = fp8_scaled.grouped(a if rows is None else a[rows], store.get_fp8(), routes)
        else:
            y = product(name, a, rows)
        return y if scale is None else y * scale[:, None].to(y.dtype)

    def product(name: str, a: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``gemm`` without the packed W4A16 kernel."""
        store = stores[name]
        if spec.act == "none" and not amplified:
            return moe.grouped_mm(a if rows is None else a[rows], store.get(), routes)
        if rows is not None:
            a = a[rows]
        sel = selectors[name] if name in selectors else None
        if sorted_rows:
            if store.use_packed(a):
                w_q = store.get_packed()
            else:
                w = store.get()
                w_q = w if factored.gemm_dtype(w) == w.dtype else store.get_f32()
            order = observe = None
            if sel is not None:
                order = sel.order
                observe = lambda r, norms: sel.observe_norms(norms, segs.counts())  # noqa: E731
            return grouped.sorted_linear(a, routes, w_q, spec, segs=segs, stacked=stacked,
                                         static_order=order, observe=observe)
        order = observe = None
        if sel is not None:
            order = sel.order
            counts = routes.offsets[1:] - routes.offsets[:-1]
            observe = lambda r: sel.observe_all(r, counts)  # noqa: E731
        y = grouped.grouped_linear(routes.pad(a), store.param, store.get_f32(), spec,
                                   static_order=order, observe=observe,
                                   w_amp=store.get_amplified() if amplified else None)
        return routes.unpad(y)

    gate, up = gemm("gate_up_proj", hidden_states, tokens).chunk(2, dim=-1)  # the tokens' rows sorted by expert
    # [T*k, H] sorted, weighted by the routes, zero rows at masked slots
    contrib = gemm("down_proj", act_fn(gate) * up, scale=top_k_weights.reshape(-1)[routes.order])
    contrib = contrib.to(hidden_states.dtype)
    # each token's sorted rows gathered in ascending expert id (no scatter, no sort): Inductor fuses the gather
    # into the sum
    return _sum_parts(contrib[routes.token_slots.reshape(-1)].view(T, k, -1))


class QuantizedExperts(_QuantizedBase):
    """Drop-in for 3-D expert stacks (transformers 5 ``Qwen3MoeExperts`` / ``OlmoeExperts`` /
    ``MixtralExperts``, ``quads.model.MoEExperts``): ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I].

    ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``: per expert e,
    ``y_e = act(x @ Wg_e.T) * (x @ Wu_e.T) @ Wd_e.T`` with each GEMM under the side's spec (NVFP4
    global scales per expert; activation scales over the expert's tokens), weighted by the routing
    weights and summed per token in ascending expert order (as the transformers loop does).
    Index ``E`` in ``top_k_index`` (a masked slot) contributes nothing.

    On the rollout side (no gradients) all experts run at once in a padded batched layout
    (``quads.quant.grouped``: same quantized operands, ~30x fewer kernel launches per layer at decode)
    when ``grouped`` allows it (set from ``Recipe.expert_path``; None = auto: on CUDA tensors only, where
    launches dominate; on the CPU the padding costs more than the loop) and the padding stays under
    ``pad_limit`` times the real rows. On the trainer side, for specs with unquantized activations,
    ``grouped`` likewise picks two grouped GEMMs over the slots sorted by expert (``_forward_sorted``,
    differentiable, no host sync; where ``moe.use_sorted`` allows). Otherwise the experts loop runs (the
    reference: same operands, the GEMMs' accumulation order aside); on the CPU's rollout side with NVFP4
    activations it builds the activation operands once per layer call for all experts
    (``shared_operand_experts``, ``share_operands``): the per-expert loop's outputs bit for bit, ~1/E of its
    quantize calls.
    """

    weight_names = ("gate_up_proj", "down_proj")

    def __init__(self, experts: nn.Module, spec: LinearSpec, *, side: str, weight_dtype: torch.dtype) -> None:
        super().__init__()
        own = dict(experts.named_parameters(recurse=False))
        extra = set(own) - set(self.weight_names)
        if extra or set(self.weight_names) - set(own):
            raise ValueError(
                f"{type(experts).__name__}: expected exactly the parameters gate_up_proj [E, 2I, H] and down_proj "
                f"[E, H, I], got {sorted(own)}; biased or other expert layouts are not supported, drop the module "
                "from the recipe's targets"
            )
        self.gate_up_proj, self.down_proj = own["gate_up_proj"], own["down_proj"]
        if self.gate_up_proj.dim() != 3 or self.down_proj.dim() != 3:
            raise ValueError(
                f"expert weights must be 3-D, got gate_up_proj {tuple(self.gate_up_proj.shape)}, "
                f"down_proj {tuple(self.down_proj.shape)}"
            )
        self.num_experts = self.gate_up_proj.shape[0]
        self.hidden_dim = self.gate_up_proj.shape[2]
        self.intermediate_dim = self.down_proj.shape[2]
        self.act_fn = getattr(experts, "act_fn", None) or nn.SiLU()
        self._setup(experts, spec, side, weight_dtype, groups=self.num_experts)

    grouped: bool | None = None  # batched expert GEMMs, either side (Recipe.expert_path); None = on CUDA only
    pad_limit: float = 8.0  # ... while E * C <= pad_limit * routed slots
    share_operands: bool = True  # the CPU loop's W4A4 operands once per layer call (False: per expert, the reference)

    def _use_grouped(self, hidden_states: torch.Tensor) -> bool:
        on = hidden_states.is_cuda if self.grouped is None else self.grouped
        return (on and self.side == "rollout" and grouped.supports(self.spec)
                and not (torch.is_grad_enabled() and (hidden_states.requires_grad or self.gate_up_proj.requires_grad)))

    def _use_sorted(self, hidden_states: torch.Tensor) -> bool:
        """Trainer side: the sorted grouped GEMMs (``_forward_sorted``) for specs whose activations stay
        unquantized (BF16, W4A16 QAT, FP8-weight QAT), as ``moe.use_sorted`` allows (``grouped``)."""
        return (self.side == "trainer" and self.spec.act == "none" and hidden_states.shape[0] > 0
                and moe.use_sorted(self.grouped, hidden_states, self.gate_up_proj, self.down_proj))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        gate_up = self.stores["gate_up_proj"]
        if gate_up.use_packed(hidden_states) or gate_up.use_fp8(hidden_states):
            return self.forward_static(hidden_states, top_k_index, top_k_weights)  # the packed / FP8 GEMMs
        if self._use_sorted(hidden_states):
            return self._forward_sorted(hidden_states, top_k_index, top_k_weights)
        slots = grouped.sort_slots(top_k_index, self.num_experts)  # read by both paths below
        if hidden_states.shape[0] and self._use_grouped(hidden_states):
            layout = grouped.expert_layout(top_k_index, top_k_weights, self.num_experts, slots)
            if grouped.worth_padding(layout, self.num_experts, self.pad_limit):
                return self._forward_grouped(hidden_states, layout)
        out = torch.zeros_like(hidden_states)
        gu_q, dn_q = self.stores["gate_up_proj"].get(), self.stores["down_proj"].get()
        if (self.share_operands and self.side == "rollout" and isinstance(gu_q, torch.Tensor)
                and shares_operands(self.spec, hidden_states)):
            return shared_operand_experts(hidden_states, top_k_index, top_k_weights, n_experts=self.num_experts,
                                          spec=self.spec, act_fn=self.act_fn, gate_up=gu_q.__getitem__,
                                          down=dn_q.__getitem__, slots=slots)
        # unbind once: its backward stacks the per-expert grads in one allocation, where indexing
        # p[e] per expert would allocate and add a full-size [E, N, K] gradient per expert hit
        gu_w, dn_w = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        for e, idx, w_route in expert_groups(top_k_index, top_k_weights, self.num_experts, slots):
            gate, up = self._gemm("gate_up_proj", e, hidden_states[idx], gu_q, gu_w[e]).chunk(2, dim=-1)
            y = self._gemm("down_proj", e, self.act_fn(gate) * up, dn_q, dn_w[e])
            scatter_expert_output(out, idx, y, w_route)
        return out

    def _forward_sorted(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """The trainer's experts without the loop or a host sync (``moe.sorted_expert_mlp``): each weight
        operand (the cached ``QDQ(W)`` of the whole stack, or W) enters both grouped GEMMs through
        ``qat.ste_operand``, so the backward is the loop's straight-through one; the weighted outputs
        are summed per token in ascending expert order, as the loop does. Same result as the loop up to
        the GEMMs' fp32 accumulation order."""
        dt = moe.compute_dtype(hidden_states)
        gu, dn = (qat.ste_operand(getattr(self, n), self.stores[n].get(), dt) for n in self.weight_names)
        y = moe.sorted_expert_mlp(hidden_states, top_k_index, gu, dn, self.act_fn)  # [T*k, H] slot order
        T, k = top_k_index.shape
        contrib = (y.view(T, k, -1) * top_k_weights[..., None]).to(hidden_states.dtype)
        return _sum_in_expert_order(contrib, top_k_index)

    def supports_static(self) -> bool:
        """Whether ``forward_static`` implements this spec (the batched layout's specs)."""
        return self.side == "rollout" and grouped.supports(self.spec)

    def forward_static(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
        """``forward`` without a host sync or a data-dependent shape (the engine's captured decode step):
        ``sorted_experts`` over this module's weight stores and static RAC selectors."""
        if not self.supports_static():
            raise ValueError(f"forward_static: spec {self.spec.describe()} on the {self.side} side has no "
                             "capturable expert path; decode with cuda_graphs=False")
        return sorted_experts(hidden_states, top_k_index, top_k_weights, spec=self.spec, stores=self.stores,
                              selectors=self.selectors, act_fn=self.act_fn, num_experts=self.num_experts)

    def _forward_grouped(self, hidden_states: torch.Tensor, layout: grouped.ExpertLayout) -> torch.Tensor:
        """The batched expert path (``quads.quant.grouped``); same result as the loop up to GEMM order."""
        E, T = self.num_experts, hidden_states.shape[0]
        if layout.capacity == 0:
            return torch.zeros_like(hidden_states)
        x = grouped.pad_rows(hidden_states, layout, E)  # [E, C, H]

        def gemm(name: str, a: torch.Tensor) -> torch.Tensor:
            store, sel = self.stores[name], self.selectors[name] if name in self.selectors else None
            order = observe = None
            if sel is not None:
                order = sel.order
                observe = lambda r: sel.observe_all(r, layout.counts)  # noqa: E731
            return grouped.grouped_linear(a, getattr(self, name), store.get(), self.spec,
                                          static_order=order, observe=observe)

        gate, up = gemm("gate_up_proj", x).chunk(2, dim=-1)
        y = gemm("down_proj", self.act_fn(gate) * up)  # [E, C, H]
        return grouped.combine(y, layout, T, hidden_states.dtype)
