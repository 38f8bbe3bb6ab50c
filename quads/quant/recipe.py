"""Precision recipes: what the trainer's forward and the rollout engine's forward compute per layer.

A ``Recipe`` holds two ``LinearSpec``s (``trainer`` and ``rollout``) and the name patterns of the
modules they apply to. Presets follow DESIGN.md section 4:

| recipe      | trainer forward            | rollout forward                  |
|-------------|----------------------------|----------------------------------|
| `bf16`      | BF16                       | BF16                             |
| `fp8`       | BF16                       | FP8 W8A8 (per-channel W, per-token X) |
| `nvfp4`     | BF16                       | NVFP4 W4A4 (naive)               |
| `w4a16-qat` | QDQ(W) x X, STE            | NVFP4 W4A4                       |
| `w4a4-qat`  | QDQ(W) x QDQ(X), STE       | NVFP4 W4A4                       |
| `quads`     | QDQ(W) x X, STE            | NVFP4 W4A4 + RAC (ratio 0.5)     |

Only the modules matched by ``targets`` (fnmatch patterns on module names, default the routed
experts ``*.mlp.experts``) are quantized. The router (``*.gate`` / ``*.router``), the embeddings,
``lm_head`` and the norms always stay in the model's dtype, even when a pattern matches them: they
are tiny, numerically sensitive (routing decisions, logits), and no serving engine quantizes them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from quads.formats.nvfp4 import MODES as NVFP4_MODES
from quads.formats.nvfp4 import TILES as NVFP4_TILES

FORMATS = ("none", "nvfp4", "fp8")
SELECTIONS = ("dynamic", "static")
ACT_SCALES = ("tensor", "token")
FP8_SCHEMES = ("tensor", "row", "block")
WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_TARGETS = ("*.mlp.experts",)


def _choice(what: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(map(str, valid))}")


@dataclass(frozen=True)
class LinearSpec:
    """What one side computes for each quantized GEMM ``y = x @ w.T``.

    The weight operand is ``QDQ(w)`` when ``weight != "none"``, the activation operand is ``QDQ(x)``
    when ``act != "none"``; gradients pass straight through both quantizers (STE). With
    ``act == "nvfp4"`` and ``rac_ratio > 0`` the GEMM adds Residual Activation Compensation
    (DESIGN.md section 4, ``quads.quant.w4a4``).
    """

    weight: str = "none"  # weight format: none | nvfp4 | fp8
    act: str = "none"  # activation format: none | nvfp4 | fp8
    rac_ratio: float = 0.0  # fraction of K re-quantized as residual channels (act nvfp4 only), in [0, 1]
    rac_selection: str = "dynamic"  # dynamic: top residual norm per batch; static: calibrated order
    act_scale: str = "tensor"  # NVFP4 activation global scale: one per tensor, or one per token
    weight_tile: tuple[int, int] = (1, 16)  # NVFP4 weight block: 1x16 or 16x16 tiles
    nvfp4_mode: str = (
        "te"  # NVFP4 arithmetic: te (canonical) | torchao | vllm | modelopt | compressed_tensors
    )
    fp8_scheme: str = (
        "row"  # FP8 scales: tensor | row (per-channel W, per-token X) | block (128x128 W, 1x128 X)
    )
    # diagnostic: every quantized operand x becomes x + error_scale * (Q(x) - x) (quads.quant.amplify);
    # 1 = the format itself; not part of the weight key (the synced operand stays QDQ(W))
    error_scale: float = 1.0

    def __post_init__(self) -> None:
        _choice("weight format", self.weight, FORMATS)
        _choice("activation format", self.act, FORMATS)
        _choice("RAC selection", self.rac_selection, SELECTIONS)
        _choice("activation scale", self.act_scale, ACT_SCALES)
        _choice("NVFP4 mode", self.nvfp4_mode, NVFP4_MODES)
        _choice("FP8 scheme", self.fp8_scheme, FP8_SCHEMES)
        tile = tuple(int(t) for t in self.weight_tile)
        _choice("weight tile", tile, NVFP4_TILES)
        object.__setattr__(self, "weight_tile", tile)
        r = self.rac_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not (0.0 <= float(r) <= 1.0):
            raise ValueError(f"rac_ratio must be a number in [0, 1], got {r!r}")
        object.__setattr__(self, "rac_ratio", float(r))
        a = self.error_scale
        if isinstance(a, bool) or not isinstance(a, int | float) or not (0.0 <= float(a) < float("inf")):
            raise ValueError(f"error_scale (the mismatch amplifier alpha) must be a finite number >= 0, got {a!r}; "
                             "1 keeps the format's own error, 0 removes it, 4 makes it four times larger")
        object.__setattr__(self, "error_scale", float(a))
        if self.rac_ratio > 0 and self.act != "nvfp4":
            raise ValueError(
                f"rac_ratio={self.rac_ratio} needs NVFP4 activations (act='nvfp4'), got act={self.act!r}; "
                "set rac_ratio=0 or act='nvfp4'"
            )

    @property
    def is_identity(self) -> bool:
        """True when this side computes the plain, unquantized GEMM."""
        return self.weight == "none" and self.act == "none"

    def weight_key(self) -> tuple:
        """What determines ``QDQ(w)``: two specs with equal keys produce bit-identical weights."""
        if self.weight == "nvfp4":
            return ("nvfp4", self.weight_tile, self.nvfp4_mode)
        if self.weight == "fp8":
            return ("fp8", self.fp8_scheme)
        return ("none",)

    def describe(self) -> str:
        """Short human-readable form, e.g. ``W4A4+RAC0.5`` or ``W16A16``."""
        bits = {"none": "16", "nvfp4": "4", "fp8": "8"}
        s = f"W{bits[self.weight]}A{bits[self.act]}"
        if self.rac_ratio > 0:
            s += f"+RAC{self.rac_ratio:g}({self.rac_selection})"
        if self.error_scale != 1.0 and not self.is_identity:
            s += f" x{self.error_scale:g} error"
        return s


EXPERT_PATHS = ("auto", "grouped", "loop")


@dataclass(frozen=True)
class Recipe:
    """A named pair of ``LinearSpec``s (trainer, rollout) and the modules they apply to."""

    name: str  # preset name or a user label
    trainer: LinearSpec = field(default_factory=LinearSpec)  # the trainer's forward (log-probs, gradients)
    rollout: LinearSpec = field(default_factory=LinearSpec)  # the rollout engine's forward
    targets: tuple[str, ...] = DEFAULT_TARGETS  # fnmatch patterns of module names to quantize
    # dtype the master weights are cast to before quantization, on both sides (the weight-sync wire
    # dtype); the dequantized weights are held in this dtype too. Unquantized weights are not cast.
    weight_dtype: str = "bfloat16"
    # the routed experts as batched GEMMs ("grouped") or the per-expert loop ("loop", the reference), or
    # "auto" (grouped on CUDA, where launches and host syncs dominate; the loop on the CPU). Rollout side,
    # eager decode: one padded batched GEMM per projection (quads.quant.grouped). Trainer side, specs
    # with unquantized activations: torch._grouped_mm over the slots sorted by expert, differentiable,
    # no host sync (quads.model.moe.sorted_expert_mlp). Same operands; the GEMM accumulation order differs.
    expert_path: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"recipe name must be a non-empty string, got {self.name!r}")
        for side in ("trainer", "rollout"):
            spec = getattr(self, side)
            if isinstance(spec, dict):
                object.__setattr__(self, side, LinearSpec(**spec))
            elif not isinstance(spec, LinearSpec):
                raise ValueError(
                    f"recipe.{side} must be a LinearSpec or a dict of its fields, got {type(spec).__name__}"
                )
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"targets must be a non-empty list of module-name patterns, got {self.targets!r}"
            )
        object.__setattr__(self, "targets", targets)
        _choice("weight_dtype", self.weight_dtype, tuple(WEIGHT_DTYPES))
        _choice("expert_path", self.expert_path, EXPERT_PATHS)
        if self.rollout.error_scale != 1.0 and not self.rollout.is_identity:
            # the amplifier (quads.quant.amplify) exists on the experts loop only
            if self.expert_path == "grouped":
                raise ValueError(f"recipe {self.name!r}: expert_path='grouped' has no amplified rollout GEMM "
                                 f"(rollout error_scale={self.rollout.error_scale:g}); use expert_path 'auto' or 'loop'")
            object.__setattr__(self, "expert_path", "loop")
        t, r = self.trainer, self.rollout
        if t.weight != "none" and r.weight != "none" and t.weight_key() != r.weight_key():
            raise ValueError(
                f"recipe {self.name!r}: the trainer quantizes weights as {t.weight_key()} but the rollout as "
                f"{r.weight_key()}; weight sync needs the rollout's dequantized weights to equal the trainer's "
                "QDQ(W) bit for bit, so use the same weight format, weight_tile, nvfp4_mode and fp8_scheme"
            )

    def spec(self, side: str) -> LinearSpec:
        """The ``LinearSpec`` of ``side`` ("trainer" or "rollout")."""
        _choice("side", side, ("trainer", "rollout"))
        return getattr(self, side)

    @property
    def torch_weight_dtype(self) -> torch.dtype:
        return WEIGHT_DTYPES[self.weight_dtype]

    def to_dict(self) -> dict:
        """Plain JSON/YAML-safe dict (tuples become lists); ``Recipe.from_dict`` inverts it."""
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        for side in ("trainer", "rollout"):
            d[side]["weight_tile"] = list(d[side]["weight_tile"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Recipe:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown recipe keys {sorted(unknown)}; valid: {sorted(known)}")
        d = dict(d)
        for side in ("trainer", "rollout"):
            if side in d and isinstance(d[side], dict):
                spec_fields = {f.name for f in dataclasses.fields(LinearSpec)}
                bad = set(d[side]) - spec_fields
                if bad:
                    raise ValueError(f"unknown {side} spec keys {sorted(bad)}; valid: {sorted(spec_fields)}")
                d[side] = LinearSpec(**d[side])
        return cls(**d)


_W4A4 = LinearSpec(weight="nvfp4", act="nvfp4")
PRESETS: dict[str, Recipe] = {
    "bf16": Recipe("bf16"),
    "fp8": Recipe("fp8", rollout=LinearSpec(weight="fp8", act="fp8")),
    "nvfp4": Recipe("nvfp4", rollout=_W4A4),
    "w4a16-qat": Recipe("w4a16-qat", trainer=LinearSpec(weight="nvfp4"), rollout=_W4A4),
    "w4a4-qat": Recipe("w4a4-qat", trainer=_W4A4, rollout=_W4A4),
    "quads": Recipe(
        "quads",
        trainer=LinearSpec(weight="nvfp4"),
        rollout=LinearSpec(weight="nvfp4", act="nvfp4", rac_ratio=0.5),
    ),
}

# Unprefixed overrides of these fields go to the rollout side only (RAC is a rollout technique);
# every other LinearSpec field goes to both sides. ``trainer_<field>`` / ``rollout_<field>`` target one.
_ROLLOUT_ONLY = ("rac_ratio", "rac_selection", "error_scale")


def get_recipe(name: str, **overrides: Any) -> Recipe:
    """A preset by name, with fields overridden.

    Overrides: Recipe fields (``targets``, ``weight_dtype``, ``name``); ``trainer_<f>`` / ``rollout_<f>``
    for a LinearSpec field ``f`` of one side; an unprefixed LinearSpec field applies to both sides,
    except ``rac_ratio`` / ``rac_selection`` / ``error_scale`` which apply to the rollout side.
    Example: ``get_recipe("quads", rac_ratio=0.25, act_scale="token")``.
    """
    if isinstance(name, Recipe):
        base = name
    elif name not in PRESETS:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(PRESETS)}")
    else:
        base = PRESETS[name]
    spec_fields = {f.name for f in dataclasses.fields(LinearSpec)}
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)} - {"trainer", "rollout"}
    side_over: dict[str, dict[str, Any]] = {"trainer": {}, "rollout": {}}
    top: dict[str, Any] = {}
    for key, value in overrides.items():
        side, _, f = key.partition("_")
        if side in side_over and f in spec_fields:
            side_over[side][f] = value
        elif key in spec_fields:
            for s in ("rollout",) if key in _ROLLOUT_ONLY else ("trainer", "rollout"):
                side_over[s].setdefault(key, value)
        elif key in recipe_fields:
            top[key] = value
        else:
            valid = sorted(recipe_fields | spec_fields | {f"{s}_{f}" for s in side_over for f in spec_fields})
            raise ValueError(f"unknown recipe override {key!r}; valid: {', '.join(valid)}")
    return dataclasses.replace(
        base,
        trainer=dataclasses.replace(base.trainer, **side_over["trainer"]),
        rollout=dataclasses.replace(base.rollout, **side_over["rollout"]),
        **top,
    )
