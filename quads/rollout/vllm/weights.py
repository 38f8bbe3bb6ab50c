"""``RolloutWeight``: one weight parameter of a quads layer in vLLM, held as the rollout computes from it.

Storage (``QuadsQuantConfig.weight_storage``, a typed field of the method's config):

- ``packed`` (default): the NVFP4 codes (uint8, two per byte), the E4M3 block scales and the FP32
  global scales that ``quads.quant.ops.quantize_weight`` produces, i.e. the exact bits of the
  trainer's QDQ(W), and nothing else. They are attributes of this object, not buffers of the layer,
  so vLLM's layerwise reload (which swaps a layer's parameters and buffers for fresh ones while it
  loads, then copies them back) never replaces them: they are updated in place. vLLM's parameter itself
  (``weight``, ``w13_weight``, ``w2_weight``) stays registered with its name, shape, dtype and weight
  loader, so every loading path of vLLM finds it, but it lives on the meta device (no memory); loads
  into it go to a staging copy of that one parameter (``_target``), freed as soon as no unit is half
  loaded. ``operand(u)`` dequantizes unit ``u`` on the fly with
  ``ops.nvfp4_dequantize`` (the reference on CPU, quads' Triton kernel on CUDA: ``quads.kernels.dispatch``),
  the same function ``quantize_weight`` returns its operand with, so it is the trainer's QDQ(W) bit for bit.
  Layout (``layout``): an expert stack of canonical NVFP4 (1x16 tiles, K a multiple of 64: every real MoE) is
  stored in the layout quads' grouped W4A16 kernels read (``"w4a16"``: ``w4a16.pack`` of each expert's
  ``NVFP4Tensor``, the same bytes rearranged, ``kernel()``), so vLLM's sorted expert path
  (``quads.rollout.vllm.experts``) multiplies the stored weight itself, with no second copy; ``packed()``
  decodes the canonical codes from it (``w4a16.unpack``, byte for byte). Other weights keep the canonical
  ``NVFP4Tensor`` tensors (``"nvfp4"``).
- ``master`` (debugging, and switching among weight formats with ``set_recipe``): vLLM's master
  parameter in the model dtype plus the rollout operand of every unit (``quantize_weight``'s first
  result), as quads' own rollout layers hold them. Any weight format.

Units: what one NVFP4 global scale covers, quantized on its own as quads quantizes it: each shard of
a fused linear (``q_proj``, ``k_proj``, ``v_proj`` of ``qkv_proj``; rows ``bounds[i]``), each expert of an
expert stack (``[gate; up]`` of one expert, or its ``down``). A unit may arrive in parts (vLLM loads
``gate_proj`` and ``up_proj`` of an expert in two calls): ``parts`` are its row ranges.

Updates (every path vLLM and the RL frameworks use, see docs/VLLM.md): the parameter's weight loader
is wrapped (``wrap_loader``). Each call loads into the master (``master``), the staging copy
(``packed``) or, during vLLM's layerwise reload, vLLM's materialized copy of the layer, with vLLM's own
loader, records which rows it wrote, and re-quantizes every unit whose
parts have all arrived since its last quantization, right there. So the rollout operand is current
after any sequence of ``load_weights`` calls, whether or not ``process_weights_after_loading`` runs
afterwards; a unit that received only some of its parts is ``pending`` and the layer refuses to
compute (``check_complete``) rather than compute from stale or half-new weights.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import nn

from quads.formats import nvfp4
from quads.formats.constants import F8E4M3_DTYPE, NVFP4_BLOCK
from quads.kernels import w4a16
from quads.quant import ops
from quads.quant.recipe import LinearSpec

STORAGES = ("packed", "master")


def kernel_layout(spec: LinearSpec, shape: tuple[int, ...]) -> bool:
    """Whether a packed weight of ``shape`` is stored in the grouped kernels' layout (module docstring): an expert
    stack ``[E, N, K]`` of canonical NVFP4 (``te`` mode, 1x16 tiles) with ``K`` a multiple of the layout's
    64-element tile, so the layout holds exactly the canonical bytes (no padding)."""
    return (len(shape) == 3 and spec.weight == "nvfp4" and spec.nvfp4_mode == "te"
            and tuple(spec.weight_tile) == (1, 16) and shape[-1] % w4a16.LAYOUT_K == 0)


@dataclasses.dataclass(frozen=True)
class Unit:
    """Rows ``[lo, hi)`` of expert ``expert`` (None: a 2-D weight), arriving as ``parts`` (row ranges)."""

    name: str  # what error messages call it, e.g. "model.layers.0.mlp.experts expert 3 gate_up_proj"
    expert: int | None
    lo: int
    hi: int
    parts: tuple[tuple[int, int], ...]


class RolloutWeight:
    """The rollout weight of one vLLM parameter of ``layer`` (see the module docstring)."""

    def __init__(self, layer: nn.Module, param_name: str, units: list[Unit], spec: LinearSpec,
                 weight_dtype: torch.dtype, storage: str) -> None:
        if storage not in STORAGES:
            raise ValueError(f"unknown weight_storage {storage!r}; valid: {', '.join(STORAGES)}")
        if storage == "packed" and spec.weight != "nvfp4":
            raise ValueError(
                f"weight_storage='packed' holds NVFP4 codes, but the recipe's rollout weight format is "
                f"{spec.weight!r}; use weight_storage='master' for it (quantization config of the 'quads' method)"
            )
        if storage == "packed" and spec.error_scale != 1.0:
            raise ValueError(
                f"weight_storage='packed' keeps no master weight, but the mismatch amplifier (error_scale="
                f"{spec.error_scale}) forms W + alpha (QDQ(W) - W) from it; use weight_storage='master'"
            )
        self.layer, self.param_name, self.units = layer, param_name, units
        self.spec, self.weight_dtype, self.storage = spec, weight_dtype, storage
        self._written: list[set[int]] = [set() for _ in units]
        self.store: dict[str, torch.Tensor] = {}  # packed: codes, scales, global_scale; master: operand
        self.version = 0  # bumped whenever a unit is re-quantized
        self._staging: torch.Tensor | None = None  # packed: the real copy loads go to (module docstring)
        self._source: torch.Tensor | None = None  # the tensor the half-loaded units' rows were written to
        self.layout: str | None = None  # packed: "nvfp4" (canonical codes) or "w4a16" (the kernels'; module docstring)
        p = self.param
        if storage == "packed":
            lead, (n, k) = tuple(p.shape[:-2]), tuple(p.shape[-2:])
            ops.check_k(k, units[0].name)
            dev = torch.empty(0).device  # the device vLLM builds the model on (p may be on meta)
            self.layout = "w4a16" if kernel_layout(spec, tuple(p.shape)) else "nvfp4"
            if self.layout == "w4a16":  # the grouped kernels' layout (w4a16.W4A16Weight), same bytes
                (e,), kt = lead, k // w4a16.LAYOUT_K
                self._set("codes", torch.zeros(e, kt, n, 8, dtype=torch.int32, device=dev))
                self._set("scales", torch.zeros(e, kt, n, dtype=torch.int32, device=dev))
                self._set("global_scale", torch.zeros(e, dtype=torch.float32, device=dev))
            else:
                self._set("codes", torch.zeros(*lead, n, k // 2, dtype=torch.uint8, device=dev))
                self._set("scales", torch.zeros(*lead, n, k // NVFP4_BLOCK, dtype=F8E4M3_DTYPE, device=dev))
                self._set("global_scale", torch.zeros(*lead, 1, 1, dtype=torch.float32, device=dev)
                          if lead else torch.zeros(len(units), dtype=torch.float32, device=dev))
            self._device = dev

    # --------------------------------------------------------------------------------- storage

    @property
    def param(self) -> nn.Parameter:
        return getattr(self.layer, self.param_name)

    def _set(self, what: str, t: torch.Tensor) -> None:
        self.store[what] = t

    def _get(self, what: str) -> torch.Tensor:
        return self.store[what]

    def nbytes(self) -> int:
        """Bytes this weight holds: its own tensors, a staging copy while one exists, and vLLM's parameter
        unless it is on the meta device."""
        own = sum(t.numel() * t.element_size() for t in self.store.values())
        return own + sum(0 if t is None or t.device.type == "meta" else t.numel() * t.element_size()
                         for t in (self.param, self._staging))

    def _target(self, param: torch.Tensor) -> torch.Tensor:
        """Where a load into ``param`` goes: the packed placeholder (meta) loads into a staging copy of it (same
        class and attributes, real storage; one per parameter, kept while a unit is half loaded)."""
        if param.device.type != "meta":
            return param  # master storage, or vLLM's materialized copy of the layer during its layerwise reload
        if self._staging is None:
            t = torch.empty(tuple(param.shape), dtype=param.dtype, device=self._device)
            t.__class__ = param.__class__  # as vLLM materializes its meta tensors: its loaders read the attributes
            t.__dict__ = param.__dict__.copy()
            self._staging = t
        return self._staging

    # ---------------------------------------------------------------------------------- units

    def _slice(self, t: torch.Tensor, u: Unit) -> torch.Tensor:
        t = t if u.expert is None else t[u.expert]
        return t[u.lo:u.hi]

    def quantize_unit(self, i: int, source: torch.Tensor | None = None) -> None:
        """Re-derive unit ``i`` from its rows in ``source`` (default: the parameter) with ``quantize_weight``,
        the trainer's QDQ."""
        u = self.units[i]
        master = self._slice((self.param if source is None else source).detach(), u)
        w_q, q = ops.quantize_weight(master, self.spec, self.weight_dtype)
        if self.storage == "master":
            if self.spec.weight != "none":  # unquantized: the operand is the master itself
                full = self.store.get("operand")
                if full is None or full.dtype != w_q.dtype:
                    full = torch.zeros(self.param.shape, dtype=w_q.dtype, device=w_q.device)
                    self._set("operand", full)
                self._slice(full, u).copy_(w_q)
        elif self.layout == "w4a16":  # a unit is one expert's whole [N, K]
            new = w4a16.pack(q)
            self._get("codes")[u.expert].copy_(new.codes)
            self._get("scales")[u.expert].copy_(new.scales)
            self._get("global_scale")[u.expert].copy_(new.global_scale[0])
        else:
            self._slice(self._get("codes"), u).copy_(q.codes)
            self._slice(self._get("scales"), u).copy_(q.scales)
            gs = self._get("global_scale")
            (gs[u.expert] if u.expert is not None else gs[i]).copy_(q.global_scale.reshape(gs[0].shape))
        self._written[i].clear()
        self.version += 1

    def quantize_all(self) -> None:
        """Re-derive every unit from the parameter (``master``: the set_recipe path)."""
        for i in range(len(self.units)):
            self.quantize_unit(i)

    def operand(self, i: int) -> torch.Tensor:
        """Unit ``i``'s rollout weight operand, ``[hi - lo, K]`` in the recipe's ``weight_dtype`` for quantized
        weights (packed: dequantized now)."""
        u = self.units[i]
        if self.storage == "master":
            if self.spec.weight == "none":
                return self._slice(self.param.detach(), u)
            return self._slice(self._get("operand"), u)
        return ops.nvfp4_dequantize(self.packed(i), self.weight_dtype)

    def gemm_weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(master, operand)`` of unit ``i`` for ``spec_linear``. Packed storage keeps no master: the operand
        stands in for it, which ``spec_linear`` reads only for its shape when the weight is quantized."""
        w_q = self.operand(i)
        return (self._slice(self.param.detach(), self.units[i]) if self.storage == "master" else w_q), w_q

    def full_operand(self) -> torch.Tensor:
        """The whole parameter's rollout operand ``[..., N, K]`` (what the fingerprint check compares; master
        storage: the tensor the forward reads, packed: dequantized now)."""
        if self.units[0].expert is None:
            return torch.cat([self.operand(i) for i in range(len(self.units))])
        if self.storage == "packed":
            return ops.nvfp4_dequantize(self.packed(), self.weight_dtype)
        return self.param.detach() if self.spec.weight == "none" else self._get("operand")

    def kernel(self, i: int | None = None) -> w4a16.W4A16Weight:
        """The ``"w4a16"`` layout's tensors as the grouped kernels read them: the whole expert stack (views of the
        stored tensors, which loads update in place), or expert ``i`` alone."""
        if self.layout != "w4a16":
            raise ValueError(f"{self.units[0].name}: stored in the {self.layout!r} layout, not the kernels'")
        codes, scales, gs = self._get("codes"), self._get("scales"), self._get("global_scale")
        n, k = self.param.shape[-2:]
        if i is not None:
            e = self.units[i].expert
            codes, scales, gs, experts = codes[e], scales[e], gs[e:e + 1], None
        else:
            experts = codes.shape[0]
        return w4a16.W4A16Weight(codes=codes, scales=scales, global_scale=gs, n=n, k=k, experts=experts,
                                 dtype=self.weight_dtype, tile=tuple(self.spec.weight_tile), mode=self.spec.nvfp4_mode)

    def packed(self, i: int | None = None) -> nvfp4.NVFP4Tensor:
        """Unit ``i``'s NVFP4 codes, scales and global scale (packed storage; views of the buffers in the
        ``"nvfp4"`` layout, decoded from the kernels' layout in the ``"w4a16"`` one), or with ``i=None`` a whole
        expert stack's (global scales ``[E, 1, 1]``)."""
        if self.storage != "packed":
            raise ValueError(f"{self.units[0].name}: weight_storage={self.storage!r} holds no NVFP4 codes")
        if self.layout == "w4a16":
            return w4a16.unpack(self.kernel(i))
        codes, scales, gs = self._get("codes"), self._get("scales"), self._get("global_scale")
        if i is None:
            if self.units[0].expert is None:
                raise ValueError(f"{self.units[0].name}: the shards of a fused linear have one global scale each; "
                                 "take them one unit at a time")
            shape, g = self.param.shape, gs
        else:
            u = self.units[i]
            codes, scales = self._slice(codes, u), self._slice(scales, u)
            shape, g = torch.Size((u.hi - u.lo, self.param.shape[-1])), gs[u.expert if u.expert is not None else i]
        return nvfp4.NVFP4Tensor(codes=codes, scales=scales, global_scale=g, shape=shape, dtype=self.weight_dtype,
                                 tile=self.spec.weight_tile, mode=self.spec.nvfp4_mode)

    # -------------------------------------------------------------------------------- loading

    def mark(self, source: torch.Tensor, expert: int | None, lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` of ``expert`` were just written to ``source``: re-quantize the units now complete."""
        if self._source is not None and self._source is not source and self.pending():
            raise ValueError(f"{self.units[0].name}: parts of one quantization unit were loaded into two different "
                             "tensors (a reload started while another load was half done); load all parts again")
        self._source = source
        hit = False
        for i, u in enumerate(self.units):
            if u.expert != expert or hi <= u.lo or lo >= u.hi:
                continue
            for j, (a, b) in enumerate(u.parts):
                if lo <= a and b <= hi:
                    self._written[i].add(j)
                    hit = True
                elif a < hi and lo < b:
                    raise ValueError(f"{u.name}: a load wrote rows [{lo}, {hi}), part of rows [{a}, {b}); quads "
                                     "tracks whole shards only (tensor parallelism is not supported)")
            if len(self._written[i]) == len(u.parts):
                self.quantize_unit(i, source)
        if not hit:
            raise ValueError(f"{self.units[0].name}: a load wrote rows [{lo}, {hi}) of expert {expert}, which no "
                             "quads unit covers")

    def release_staging(self) -> None:
        """Free the staging copy once no unit is half loaded (its rows are all quantized)."""
        if not self.pending():
            self._staging = self._source = None

    def pending(self) -> list[str]:
        """Units that received some of their parts since their last quantization (their operand is old)."""
        return [f"{u.name} (got rows {[u.parts[j] for j in sorted(w)]} of {list(u.parts)})"
                for u, w in zip(self.units, self._written) if w]

    def wrap_loader(self, loader: Callable, rows: Callable[..., tuple[int | None, int, int]]) -> Callable:
        """vLLM's weight loader of the parameter, re-quantizing what each call completes (module docstring).

        ``rows(*args, **kwargs)`` maps the loader's arguments (after ``param, loaded_weight``) to the rows
        ``(expert, lo, hi)`` the call writes.
        """

        def load(param, loaded_weight, *args, **kwargs):
            if _vllm_counting(self.layer, param):
                return loader(param, loaded_weight, *args, **kwargs)
            where = rows(*args, **kwargs)
            target = self._target(param)
            out = loader(target, loaded_weight, *args, **kwargs)
            if out is False:  # a fused-MoE loader declining an expert that is not local
                return out
            self.mark(target, *where)
            self.release_staging()
            return out

        load.__signature__ = inspect.signature(loader)  # vLLM's layerwise reload binds the loader's arguments
        return load


def _vllm_counting(layer: nn.Module, param: torch.Tensor) -> bool:
    """Whether vLLM's layerwise reload is calling the loader on its meta-device copy of the layer only to count
    the elements a call loads (``reload.layerwise``: it buffers the call and replays it on a materialized layer
    once all of the layer's weights have arrived): nothing to load or quantize then."""
    if param.device.type != "meta":
        return False
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    return info is not None and info.can_load()


def expert_units(name: str, qname: str, shape: tuple[int, ...],
                 parts: tuple[tuple[int, int], ...] | None = None) -> list[Unit]:
    """The units of an expert stack ``[E, N, K]`` (one per expert, all N rows), named ``"{name} expert {e} {qname}"``;
    ``parts``: the row ranges a unit arrives in (default: all N rows at once)."""
    e, n = shape[0], shape[1]
    return [Unit(f"{name} expert {i} {qname}", i, 0, n, parts or ((0, n),)) for i in range(e)]


def check_complete(weights: list[RolloutWeight], what: str) -> None:
    """Refuse to compute (``WeightSyncError``) while a unit holds half-new weights (module docstring)."""
    from quads.quant.sync import WeightSyncError

    pending = [p for w in weights for p in w.pending()]
    if pending:
        raise WeightSyncError(
            f"{what}: new weights were loaded for only part of {len(pending)} quantization units, first "
            f"{pending[0]}; quads quantizes each unit as a whole (one NVFP4 global scale), so load all of its "
            "parts (e.g. gate_proj and up_proj of every expert) before rolling out"
        )


def memory(model: nn.Module) -> dict[str, int]:
    """Bytes held by a model's parameters and buffers (meta tensors hold none), by dtype."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta" or id(t) in seen:
            continue
        seen.add(id(t))
        out[str(t.dtype)] = out.get(str(t.dtype), 0) + t.numel() * t.element_size()
    return out
