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
| `w4a16`     | QDQ(W) x X, STE            | NVFP4 W4A16 (weights only)       |

``w4a16`` is the weight-only pair: the rollout computes what the QAT trainer's forward computes (no weight
or activation error, only the engine's drift), and on Hopper, which has no FP4 tensor cores, it is the 4-bit
rollout that is faster than BF16 (docs/PERF.md); W4A4 there is emulated and slower.

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


def _ratio(what: str, r: Any) -> float:
    if isinstance(r, bool) or not isinstance(r, int | float) or not (0.0 <= float(r) <= 1.0):
        raise ValueError(f"{what} must be a number in [0, 1], got {r!r}")
    return float(r)


# ---------------------------------------------------------------------------------- operand configs
# One config class per (operand, format), in the spirit of torchao's QAT ``FakeQuantizeConfig``s: a setting
# lives in the config of the operand it quantizes, so a setting without its operand cannot be built
# (a RAC ratio without NVFP4 activations, a weight tile on FP8 weights).


@dataclass(frozen=True)
class NVFP4WeightConfig:
    """NVFP4 weights ``QDQ(w)`` (DESIGN.md section 3): 1x16 blocks or 16x16 tiles, one arithmetic mode."""

    tile: tuple[int, int] = (1, 16)  # NVFP4 weight block: 1x16 or 16x16 tiles
    mode: str = "te"  # NVFP4 arithmetic: te (canonical) | torchao | vllm | modelopt | compressed_tensors

    def __post_init__(self) -> None:
        tile = tuple(int(t) for t in self.tile) if isinstance(self.tile, list | tuple) else self.tile
        _choice("weight tile", tile, NVFP4_TILES)
        object.__setattr__(self, "tile", tile)
        _choice("NVFP4 mode", self.mode, NVFP4_MODES)


@dataclass(frozen=True)
class FP8WeightConfig:
    """FP8 (E4M3) weights; ``scheme`` names the weight and activation scales together: tensor, row
    (per-channel W, per-token X) or block (128x128 W, 1x128 X)."""

    scheme: str = "row"

    def __post_init__(self) -> None:
        _choice("FP8 scheme", self.scheme, FP8_SCHEMES)


@dataclass(frozen=True)
class NVFP4ActConfig:
    """NVFP4 activations ``QDQ(x)`` and their Residual Activation Compensation (DESIGN.md section 4,
    ``quads.quant.w4a4``): RAC exists only here, so it always comes with NVFP4 activations."""

    scale: str = "tensor"  # activation global scale: one per tensor, or one per token
    mode: str = "te"  # NVFP4 arithmetic (equal to the weights' mode when they are NVFP4 too)
    rac_ratio: float = 0.0  # fraction of K re-quantized as residual channels, in [0, 1]; 0 = plain W4A4
    rac_selection: str = "dynamic"  # dynamic: top residual norm per batch; static: calibrated order

    def __post_init__(self) -> None:
        _choice("activation scale", self.scale, ACT_SCALES)
        _choice("NVFP4 mode", self.mode, NVFP4_MODES)
        object.__setattr__(self, "rac_ratio", _ratio("rac_ratio", self.rac_ratio))
        _choice("RAC selection", self.rac_selection, SELECTIONS)


@dataclass(frozen=True)
class FP8ActConfig:
    """FP8 (E4M3) activations with the scales of ``scheme`` (see ``FP8WeightConfig``)."""

    scheme: str = "row"

    def __post_init__(self) -> None:
        _choice("FP8 scheme", self.scheme, FP8_SCHEMES)


WeightConfig = NVFP4WeightConfig | FP8WeightConfig
ActConfig = NVFP4ActConfig | FP8ActConfig

# The flat form of a ``LinearSpec`` (YAML, ``to_dict``, ``get_recipe`` overrides): field -> default.
# The flat fields other than weight / act / error_scale belong to an operand config (``_OWNER``).
FLAT_DEFAULTS: dict[str, Any] = {
    "weight": "none", "act": "none", "rac_ratio": 0.0, "rac_selection": "dynamic", "act_scale": "tensor",
    "weight_tile": (1, 16), "nvfp4_mode": "te", "fp8_scheme": "row", "error_scale": 1.0,
}
# flat field -> (format, operands that may carry it, its field in that operand's config)
_OWNER = {
    "rac_ratio": ("nvfp4", ("act",), "rac_ratio"), "rac_selection": ("nvfp4", ("act",), "rac_selection"),
    "act_scale": ("nvfp4", ("act",), "scale"), "weight_tile": ("nvfp4", ("weight",), "tile"),
    "nvfp4_mode": ("nvfp4", ("weight", "act"), "mode"), "fp8_scheme": ("fp8", ("weight", "act"), "scheme"),
}
_CONFIGS = {("weight", "nvfp4"): NVFP4WeightConfig, ("weight", "fp8"): FP8WeightConfig,
            ("act", "nvfp4"): NVFP4ActConfig, ("act", "fp8"): FP8ActConfig}


def _flat_value(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


@dataclass(frozen=True)
class LinearSpec:
    """What one side computes for each quantized GEMM ``y = x @ w.T``.

    The weight operand is ``QDQ(w)`` under ``weight_config``, the activation operand ``QDQ(x)`` under
    ``act_config`` (None: that operand stays in the model's dtype); gradients pass straight through both
    quantizers (STE). NVFP4 activations with ``rac_ratio > 0`` add Residual Activation Compensation
    (DESIGN.md section 4, ``quads.quant.w4a4``). Built typed
    (``LinearSpec(NVFP4WeightConfig(), NVFP4ActConfig(rac_ratio=0.5))``) or from the flat form of YAML
    files and overrides (``LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5)``); the flat names
    (``weight``, ``act``, ``rac_ratio``, ``act_scale``, ``weight_tile``, ``nvfp4_mode``, ``fp8_scheme``,
    ``rac_selection``) read back as properties, with their defaults where the operand is absent.
    """

    weight_config: WeightConfig | None = None  # the weight operand's format and settings; None = unquantized
    act_config: ActConfig | None = None  # the activation operand's format and settings; None = unquantized
    # diagnostic: every quantized operand x becomes x + error_scale * (Q(x) - x) (quads.quant.amplify);
    # 1 = the format itself; not part of the weight key (the synced operand stays QDQ(W))
    error_scale: float = 1.0

    def __post_init__(self) -> None:
        for what, cfg, types in (("weight_config", self.weight_config, WeightConfig),
                                 ("act_config", self.act_config, ActConfig)):
            if cfg is not None and not isinstance(cfg, types):
                valid = " | ".join(t.__name__ for t in types.__args__)
                raise ValueError(f"LinearSpec.{what} must be {valid} or None, got {cfg!r}; "
                                 "for the flat form (weight='nvfp4', ...) use LinearSpec.of(...)")
        a = self.error_scale
        if isinstance(a, bool) or not isinstance(a, int | float) or not (0.0 <= float(a) < float("inf")):
            raise ValueError(f"error_scale (the mismatch amplifier alpha) must be a finite number >= 0, got {a!r}; "
                             "1 keeps the format's own error, 0 removes it, 4 makes it four times larger")
        object.__setattr__(self, "error_scale", float(a))
        w, x = self.weight_config, self.act_config
        for fmt, key, field_ in (("nvfp4", "nvfp4_mode", "mode"), ("fp8", "fp8_scheme", "scheme")):
            if self.weight == fmt and self.act == fmt and getattr(w, field_) != getattr(x, field_):
                raise ValueError(f"{key}: the weights use {getattr(w, field_)!r} but the activations "
                                 f"{getattr(x, field_)!r}; one side computes one {fmt.upper()} {field_}, set both "
                                 "to the same")

    # ------------------------------------------------------------------------- the flat form
    @classmethod
    def of(cls, **flat: Any) -> LinearSpec:
        """A spec from its flat fields (``FLAT_DEFAULTS``). A setting whose operand is absent must keep its
        default (``rac_ratio=0.5`` with ``act='none'`` raises), so every spec the flat form names is valid."""
        unknown = set(flat) - set(FLAT_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown LinearSpec field(s) {sorted(unknown)}; valid spec fields: {list(FLAT_DEFAULTS)}")
        f = {**FLAT_DEFAULTS, **{k: _flat_value(v) for k, v in flat.items()}}
        fmt = {op: f[op] for op in ("weight", "act")}
        for op in fmt:
            _choice(f"{'weight' if op == 'weight' else 'activation'} format", fmt[op], FORMATS)
        for key, (form, ops, _) in _OWNER.items():
            v = f[key]
            if all(fmt[op] != form for op in ops) and v != FLAT_DEFAULTS[key] and not (
                    key == "rac_ratio" and _ratio("rac_ratio", v) == 0.0):
                where = " or ".join(f"{op}={form!r}" for op in ops)
                got = ", ".join(f"{op}={fmt[op]!r}" for op in ops)
                if key == "rac_ratio":
                    raise ValueError(f"rac_ratio={v} needs NVFP4 activations (act='nvfp4'), got {got}; set "
                                     "rac_ratio=0 or act='nvfp4'")
                raise ValueError(f"{key}={v!r} is a setting of {form.upper()} operands ({where}), got {got}; "
                                 f"drop {key} or quantize an operand with {form}")
        configs = {}
        for op in ("weight", "act"):
            make = _CONFIGS.get((op, fmt[op]))
            configs[op] = make and make(**{field_: f[key] for key, (form, ops, field_) in _OWNER.items()
                                           if form == fmt[op] and op in ops})
        return cls(configs["weight"], configs["act"], f["error_scale"])

    def to_dict(self) -> dict:
        """The flat form (JSON/YAML-safe, every field of ``FLAT_DEFAULTS`` in its order); ``of`` inverts it."""
        d = {"weight": self.weight, "act": self.act, "rac_ratio": self.rac_ratio, "rac_selection": self.rac_selection,
             "act_scale": self.act_scale, "weight_tile": list(self.weight_tile), "nvfp4_mode": self.nvfp4_mode,
             "fp8_scheme": self.fp8_scheme, "error_scale": self.error_scale}
        assert list(d) == list(FLAT_DEFAULTS)
        return d

    def replace(self, **flat: Any) -> LinearSpec:
        """This spec with flat fields changed (``spec.replace(rac_ratio=0.25)``), validated as ``of``."""
        return LinearSpec.of(**{**self.to_dict(), **flat})

    def _setting(self, key: str) -> Any:
        form, ops, field_ = _OWNER[key]
        for op in ops:
            cfg = self.weight_config if op == "weight" else self.act_config
            if getattr(self, op) == form:
                return getattr(cfg, field_)
        return FLAT_DEFAULTS[key]

    @property
    def weight(self) -> str:
        """The weight format: none | nvfp4 | fp8."""
        return {NVFP4WeightConfig: "nvfp4", FP8WeightConfig: "fp8"}.get(type(self.weight_config), "none")

    @property
    def act(self) -> str:
        """The activation format: none | nvfp4 | fp8."""
        return {NVFP4ActConfig: "nvfp4", FP8ActConfig: "fp8"}.get(type(self.act_config), "none")

    @property
    def rac_ratio(self) -> float:
        """RAC ratio of the NVFP4 activations (0 without them)."""
        return self._setting("rac_ratio")

    @property
    def rac_selection(self) -> str:
        return self._setting("rac_selection")

    @property
    def static_rac(self) -> bool:
        """Whether the spec runs RAC with a calibrated channel order (``StaticChannelSelector``)."""
        return self.act == "nvfp4" and self.rac_ratio > 0 and self.rac_selection == "static"

    @property
    def act_scale(self) -> str:
        """NVFP4 activation global scale: tensor | token ("tensor" without NVFP4 activations)."""
        return self._setting("act_scale")

    @property
    def weight_tile(self) -> tuple[int, int]:
        return self._setting("weight_tile")

    @property
    def nvfp4_mode(self) -> str:
        """The side's NVFP4 arithmetic mode ("te" without NVFP4 operands)."""
        return self._setting("nvfp4_mode")

    @property
    def fp8_scheme(self) -> str:
        return self._setting("fp8_scheme")

    # ------------------------------------------------------------------------- derived
    @property
    def is_identity(self) -> bool:
        """True when this side computes the plain, unquantized GEMM."""
        return self.weight_config is None and self.act_config is None

    @property
    def amplified(self) -> bool:
        """True when the mismatch amplifier is on: ``error_scale != 1`` on a side that quantizes something."""
        return self.error_scale != 1.0 and not self.is_identity

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
        if self.amplified:
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
                object.__setattr__(self, side, _side_spec(self.name, side, spec))
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
        """Plain JSON/YAML-safe dict, the specs in their flat form (``LinearSpec.to_dict``);
        ``Recipe.from_dict`` inverts it."""
        return {"name": self.name, "trainer": self.trainer.to_dict(), "rollout": self.rollout.to_dict(),
                "targets": list(self.targets), "weight_dtype": self.weight_dtype, "expert_path": self.expert_path}

    @classmethod
    def from_dict(cls, d: dict) -> Recipe:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown recipe keys {sorted(unknown)}; valid: {sorted(known)}")
        d = dict(d)
        for side in ("trainer", "rollout"):
            if side in d and isinstance(d[side], dict):
                bad = set(d[side]) - set(FLAT_DEFAULTS)
                if bad:
                    raise ValueError(f"unknown {side} spec keys {sorted(bad)}; valid: {sorted(FLAT_DEFAULTS)}")
                d[side] = _side_spec(d.get("name", "?"), side, d[side])
        return cls(**d)


def _side_spec(recipe: str, side: str, flat: dict) -> LinearSpec:
    """``LinearSpec.of(**flat)`` with the recipe and side named in its error."""
    try:
        return LinearSpec.of(**flat)
    except ValueError as e:
        raise ValueError(f"recipe {recipe!r}, {side} side: {e}") from None


_W4A4 = LinearSpec(NVFP4WeightConfig(), NVFP4ActConfig())
PRESETS: dict[str, Recipe] = {
    "bf16": Recipe("bf16"),
    "fp8": Recipe("fp8", rollout=LinearSpec(FP8WeightConfig(), FP8ActConfig())),
    "nvfp4": Recipe("nvfp4", rollout=_W4A4),
    "w4a16-qat": Recipe("w4a16-qat", trainer=LinearSpec(NVFP4WeightConfig()), rollout=_W4A4),
    "w4a4-qat": Recipe("w4a4-qat", trainer=_W4A4, rollout=_W4A4),
    "quads": Recipe(
        "quads",
        trainer=LinearSpec(NVFP4WeightConfig()),
        rollout=LinearSpec(NVFP4WeightConfig(), NVFP4ActConfig(rac_ratio=0.5)),
    ),
    "w4a16": Recipe("w4a16", trainer=LinearSpec(NVFP4WeightConfig()), rollout=LinearSpec(NVFP4WeightConfig())),
}

# Unprefixed overrides of these fields go to the rollout side only (RAC is a rollout technique);
# every other LinearSpec field goes to both sides. ``trainer_<field>`` / ``rollout_<field>`` target one.
_ROLLOUT_ONLY = ("rac_ratio", "rac_selection", "error_scale")


def _carries(flat: dict, key: str) -> bool:
    """Whether a spec of flat fields ``flat`` has the operand that carries the setting ``key``."""
    if key not in _OWNER:
        return True
    form, ops, _ = _OWNER[key]
    return any(flat[op] == form for op in ops)


def get_recipe(name: str, **overrides: Any) -> Recipe:
    """A preset by name, with fields overridden.

    Overrides: Recipe fields (``targets``, ``weight_dtype``, ``name``); ``trainer_<f>`` / ``rollout_<f>``
    for a flat LinearSpec field ``f`` of one side (``FLAT_DEFAULTS``; an operand setting needs its operand:
    ``trainer_act_scale`` on a trainer without NVFP4 activations raises); an unprefixed field applies to both
    sides, except ``rac_ratio`` / ``rac_selection`` / ``error_scale`` which apply to the rollout side, and an
    unprefixed operand setting goes to the sides that have its operand (``act_scale="token"`` sets the NVFP4
    activations of either side, and a recipe without them is unchanged), except a nonzero ``rac_ratio``,
    which needs NVFP4 rollout activations.
    Example: ``get_recipe("quads", rac_ratio=0.25, act_scale="token")``.
    """
    if isinstance(name, Recipe):
        base = name
    elif name not in PRESETS:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(PRESETS)}")
    else:
        base = PRESETS[name]
    spec_fields = set(FLAT_DEFAULTS)
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)} - {"trainer", "rollout"}
    side_over: dict[str, dict[str, Any]] = {"trainer": {}, "rollout": {}}
    both: dict[str, Any] = {}
    top: dict[str, Any] = {}
    for key, value in overrides.items():
        side, _, f = key.partition("_")
        if side in side_over and f in spec_fields:
            side_over[side][f] = value
        elif key in spec_fields:
            both[key] = value
        elif key in recipe_fields:
            top[key] = value
        else:
            valid = sorted(recipe_fields | spec_fields | {f"{s}_{f}" for s in side_over for f in spec_fields})
            raise ValueError(f"unknown recipe override {key!r}; valid: {', '.join(valid)}")
    for key, value in both.items():  # a value is checked even where no operand carries it
        if key in _OWNER:
            form, ops, field_ = _OWNER[key]
            _CONFIGS[(ops[0], form)](**{field_: _flat_value(value)})
    specs = {}
    for side in ("trainer", "rollout"):
        flat = {**getattr(base, side).to_dict(), **side_over[side]}
        for key, value in both.items():
            if key in side_over[side] or (key in _ROLLOUT_ONLY and side != "rollout"):
                continue
            if _carries(flat, key) or (key == "rac_ratio" and value != 0):
                flat[key] = value
        specs[side] = _side_spec(top.get("name", base.name), side, flat)
    return dataclasses.replace(base, trainer=specs["trainer"], rollout=specs["rollout"], **top)
