"""What an export writes: which linears are NVFP4 and with which bits, everything else in BF16.

The quantized unit is the tensor the rollout engine quantizes: a fused expert tensor
(``...mlp.experts.gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I]) or a linear weight [N, K], cast to
the compute dtype and quantized in ``spec.mode`` with ``spec.tile`` (``quads.quant.ops``), so its codes,
E4M3 block scales and FP32 decode global scale are the ones the rollout used. The result is then split
per expert into the linears serving engines expect: ``experts.{e}.gate_proj`` = rows [:I] of the
expert's gate_up, ``up_proj`` = rows [I:], ``down_proj``; codes and scales split along N untouched,
every piece keeps the tensor's global scale (so gate and up share it, as vLLM's fused w13 requires).

Targets are ``fnmatch`` globs, as in ``quads.quant`` recipes: on module names (``*.mlp.experts``,
``*.self_attn.q_proj``; the default is the recipe's, the routed experts) or on the exported per-expert
linear names (``model.layers.0.mlp.experts.3.up_proj``). As in ``quads.quant.quantize_model``, the router
(``*.gate``/``*.router``), embeddings and ``lm_head`` stay BF16 even when a pattern matches them.

Global scales: ``quads.quant`` quantizes an expert stack with one FP32 global scale PER EXPERT (each expert is
its own linear), which is also what the formats store (one ``weight_global_scale`` per expert linear).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch

from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK

DEFAULT_TARGETS = ("*.mlp.experts",)
# quads.quant.apply.PROTECTED_NAMES: never quantized by the rollout, and engines build the router and
# lm_head without a quant method, so they stay BF16 even when a pattern matches them.
PROTECTED_NAMES = ("gate", "router", "lm_head", "embed_tokens")
# vLLM fuses these into one GEMM with ONE weight global scale (it takes the max): members must share it.
FUSED_GROUPS = ((r"\.self_attn\.", ("q_proj", "k_proj", "v_proj")),
                (r"\.shared_expert\.", ("gate_proj", "up_proj")),
                (r"\.experts\.\d+\.", ("gate_proj", "up_proj")))
_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass
class QuantSpec:
    mode: str = "te"  # nvfp4 mode the rollout quantized with (quads.formats.nvfp4.MODES)
    tile: tuple[int, int] = (1, 16)  # weight tile of the rollout: (1, 16) or (16, 16)
    targets: tuple[str, ...] = DEFAULT_TARGETS  # fnmatch globs on module names or exported linear names
    compute_dtype: torch.dtype = torch.bfloat16  # the rollout casts master weights to this before quantizing

    def __post_init__(self) -> None:
        if self.mode not in nvfp4.MODES:
            raise ValueError(f"unknown NVFP4 mode {self.mode!r}; valid: {', '.join(nvfp4.MODES)}")
        self.tile = tuple(self.tile)
        if self.tile not in nvfp4.TILES:
            raise ValueError(f"unknown tile {self.tile}; valid: (1, 16) or (16, 16)")
        if not self.targets:
            raise ValueError("targets is empty; pass at least one pattern, e.g. '*.mlp.experts'")


@dataclass
class QuantLinear:
    """One exported NVFP4 linear [N, K]: the rollout's bits in quads' own conventions."""

    name: str  # module name, e.g. model.layers.0.mlp.experts.3.gate_proj
    codes: torch.Tensor  # uint8 [N, K/2], element 2i in the low nibble
    scales: torch.Tensor  # float8_e4m3fn [N, K/16]
    global_scale: torch.Tensor  # float32 [] decode scale S_dec
    source: str  # the state-dict tensor it was cut from
    input_amax: torch.Tensor | None = None  # float32 [] calibrated activation amax (W4A4 exports)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        n, k2 = self.codes.shape
        q = nvfp4.NVFP4Tensor(self.codes, self.scales, self.global_scale, torch.Size((n, 2 * k2)), dtype)
        return nvfp4.dequantize(q, dtype)


@dataclass
class ExportPlan:
    quantized: list[QuantLinear]  # NVFP4 linears, in state-dict order
    dense: dict[str, torch.Tensor]  # every other tensor, BF16, per-expert names
    sources: dict[str, nvfp4.NVFP4Tensor] = field(default_factory=dict)  # fused name -> rollout's tensor
    protected: list[str] = field(default_factory=list)  # modules a pattern matched but that stay BF16


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def split_name(key: str, n_experts: int) -> list[tuple[str, slice | None, int | None]]:
    """A state-dict key -> [(exported linear name, row slice, expert)] (one entry for non-fused tensors)."""
    m = _FUSED.match(key)
    if m is None:
        return [(key.removesuffix(".weight"), None, None)]
    if m["kind"] == "down_proj":
        return [(f"{m['prefix']}.{e}.down_proj", None, e) for e in range(n_experts)]
    return [(f"{m['prefix']}.{e}.{part}_proj", half, e) for e in range(n_experts)
            for part, half in (("gate", "lo"), ("up", "hi"))]


def _rows(t: torch.Tensor, half: str | None) -> torch.Tensor:
    if half is None:
        return t
    n = t.shape[0] // 2
    return t[:n] if half == "lo" else t[n:]


def _piece_global(gs: torch.Tensor, e: int | None, name: str) -> torch.Tensor:
    gs = gs.float()
    if gs.dim() == 0:
        return gs.clone()
    if e is not None and gs.numel() == gs.shape[0]:  # per-expert [E, 1, 1]
        return gs.reshape(-1)[e].clone()
    raise ValueError(f"{name}: global scale of shape {tuple(gs.shape)} (per token/row) cannot be exported; "
                     "engines read one global scale per linear")


def module_name(key: str) -> str:
    """``a.b.weight`` -> ``a.b``; a fused ``...experts.gate_up_proj`` -> ``...experts``."""
    return key.rsplit(".", 1)[0]


def quantize_weight(w: torch.Tensor, spec: QuantSpec) -> nvfp4.NVFP4Tensor:
    """The rollout's weight quantizer: ``quads.quant.ops.quantize_weight`` (cast to the compute dtype, one
    global scale per expert of a stack)."""
    from quads.quant.ops import quantize_weight as rollout_quantize
    from quads.quant.recipe import LinearSpec, NVFP4WeightConfig

    _, q = rollout_quantize(w, LinearSpec(NVFP4WeightConfig(tile=spec.tile, mode=spec.mode)), spec.compute_dtype)
    return q


def _check_quantizable(key: str, w: torch.Tensor, names: list[str]) -> None:
    if w.dim() not in (2, 3) or not key.endswith(("weight", "gate_up_proj", "down_proj")):
        raise ValueError(f"--targets selects {key} of shape {tuple(w.shape)}, which is not a linear weight")
    if w.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"{key}: in-features K={w.shape[-1]} is not a multiple of {NVFP4_BLOCK}, so it cannot be "
                         "packed as NVFP4; exclude it from --targets")


def build_plan(sd: dict[str, torch.Tensor], spec: QuantSpec) -> ExportPlan:
    quantized: list[QuantLinear] = []
    dense: dict[str, torch.Tensor] = {}
    sources: dict[str, nvfp4.NVFP4Tensor] = {}
    protected: list[str] = []
    for key, w in sd.items():
        n_exp = w.shape[0] if _FUSED.match(key) else 0
        pieces = split_name(key, n_exp)
        names = [p[0] for p in pieces]
        mod = module_name(key)
        hit = [_matches(mod, spec.targets) or _matches(n, spec.targets) for n in names]
        if any(hit) and (mod.rsplit(".", 1)[-1] in PROTECTED_NAMES or w.dim() < 2):
            protected += [mod] if w.dim() >= 2 else []
            hit = [False] * len(names)
        if any(hit) and not all(hit):
            raise ValueError(f"--targets selects only some of the linears cut from {key} ({names[hit.index(True)]} "
                             "but not all); the rollout quantizes the fused tensor as one, so select all of them")
        if not any(hit):
            for n, half, e in pieces:
                t = w if e is None else w[e]
                dense[n + ".weight" if _FUSED.match(key) else key] = _rows(t, half).to(torch.bfloat16).contiguous()
            continue
        _check_quantizable(key, w, names)
        q = quantize_weight(w, spec)
        sources[key] = q
        for n, half, e in pieces:
            codes = q.codes if e is None else q.codes[e]
            scales = q.scales if e is None else q.scales[e]
            quantized.append(QuantLinear(n, _rows(codes, half).contiguous(), _rows(scales, half).contiguous(),
                                         _piece_global(q.global_scale, e, key), key))
    check_fused_groups(quantized)
    return ExportPlan(quantized, dense, sources, protected)


def check_fused_groups(quantized: list[QuantLinear]) -> None:
    """Raise if linears that vLLM fuses (q/k/v, gate/up) carry different global scales."""
    by_name = {q.name: q for q in quantized}
    for pat, members in FUSED_GROUPS:
        for q in quantized:
            if not re.search(pat, q.name) or not q.name.endswith("." + members[0]):
                continue
            base = q.name[: -len(members[0])]
            group = [by_name.get(base + m) for m in members]
            if any(g is None for g in group):
                continue
            gs = {float(g.global_scale) for g in group}
            if len(gs) > 1:
                raise ValueError(
                    f"{base}{{{','.join(members)}}} have different global scales {sorted(gs)}; vLLM fuses them into "
                    "one GEMM with one global scale, so it would serve different weights than the rollout. Quantize "
                    "them with a shared amax in the recipe, or leave them out of --targets"
                )
