"""``quads export``: a trained policy -> a Hugging Face folder that vLLM / SGLang load (transformers: see below).

Formats (see docs/EXPORT.md): ``compressed-tensors`` (nvfp4-pack-quantized), ``modelopt`` (NVFP4 unified
HF checkpoint), ``bf16``. The NVFP4 formats hold, for every targeted linear, exactly the codes, E4M3 block
scales and FP32 global scale the rollout engine computed (``quads.quant.ops.nvfp4_quantize(w.to(compute
dtype), mode=recipe mode, tile=recipe tile)``), re-expressed in the format's conventions; every other tensor is BF16.
transformers loads the ``bf16`` format; its compressed-tensors loader drops the global scale of per-expert NVFP4
weights, so a compressed-tensors export with NVFP4 experts is refused unless ``engines_only`` says it is meant for
vLLM / SGLang only (``compressed_tensors.check_transformers_loadable``); it has no ModelOpt loader (it refuses those).

The output is written into a temp folder beside ``--out`` and renamed into place at the end, so a
failure leaves no half-written folder. ``--out`` must be new or empty; ``--force`` replaces only an earlier
export (marked by its ``quads_export.json``), never a run folder, a policy or the source itself. ``load_exported`` (in ``importer``) reads any of these back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from quads.export import bf16, compressed_tensors, modelopt
from quads.export.plan import ExportPlan, QuantSpec, build_plan
from quads.export.source import ExportSource, load_source
from quads.export.writer import MARKER_FILE, check_out, staging_dir, write_files, write_json, write_shards

FORMATS: dict[str, ModuleType] = {"compressed-tensors": compressed_tensors, "modelopt": modelopt, "bf16": bf16}
ACTIVATIONS = ("bf16", "nvfp4")  # W4A16 (weights only) or W4A4 (static activation global scale)
METADATA_FILE = MARKER_FILE


@dataclass
class ExportConfig:
    checkpoint: str  # a training run folder (its final/latest checkpoint) or a checkpoint folder
    out: str  # destination folder (written atomically)
    format: str = "compressed-tensors"  # compressed-tensors | modelopt | bf16
    recipe: str | None = None  # recipe whose rollout bits to export; default: the run's, else "quads"
    targets: tuple[str, ...] | None = None  # fnmatch globs on linear names; default: the recipe's (routed experts)
    nvfp4_mode: str | None = None  # override the recipe's NVFP4 mode (re-quantizes: bits differ from the rollout)
    tile: tuple[int, int] | None = None  # override the recipe's weight tile
    activations: str = "bf16"  # bf16: W4A16 scheme; nvfp4: W4A4 with calibrated static input global scales
    calib_data: str | None = None  # text file, one prompt per line (W4A4 calibration); default random ids
    calib_tokens: int = 512  # random calibration tokens when no calib_data
    qdq: bool = False  # bf16 format only: write the NVFP4-dequantized weights of the targets
    max_shard_mb: float = 4096.0  # safetensors shard size (MiB)
    force: bool = False  # replace an earlier quads export at --out (nothing else is ever replaced)
    seed: int = 0
    engines_only: bool = False  # compressed-tensors: allow NVFP4 experts, which transformers mis-decodes (vLLM/SGLang only)
    threads: int = 0  # torch CPU threads; 0 = torch default

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown --format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"unknown --activations {self.activations!r}; choose bf16 (W4A16) or nvfp4 (W4A4)")
        if self.format == "bf16" and self.activations != "bf16":
            raise ValueError("--format bf16 has no activation quantization; drop --activations nvfp4")
        if self.qdq and self.format != "bf16":
            raise ValueError("--qdq applies to --format bf16 only (the NVFP4 formats always hold the NVFP4 bits)")
        if self.max_shard_mb <= 0 or self.calib_tokens <= 0:
            raise ValueError("--max-shard-mb and --calib-tokens must be > 0")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0 = torch default); got {self.threads}")


@dataclass
class ExportResult:
    out: Path
    format: str
    spec: QuantSpec | None  # None for a plain BF16 export
    n_quantized: int  # exported NVFP4 linears
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # mode mismatches and other things the user should know


def recipe_spec(recipe: Any, notes: list[str] | None = None, **overrides: Any) -> QuantSpec:
    """The rollout's NVFP4 weight quantization of a recipe (a name, a ``Recipe`` or its dict).

    A recipe whose rollout does not use NVFP4 weights (bf16, fp8) gets the canonical ``te`` mode and 1x16
    tiles (post-training quantization; a note says so).
    """
    from quads.quant.recipe import Recipe, get_recipe

    r = Recipe.from_dict(recipe) if isinstance(recipe, dict) else get_recipe(recipe, **overrides)
    side = r.rollout
    if side.weight != "nvfp4":
        if notes is not None:
            notes.append(f"recipe {r.name!r} rolls out with {side.weight} weights, not NVFP4: this export is "
                         "post-training quantization (mode te, 1x16 tiles), not the rollout's bits")
        return QuantSpec(targets=tuple(r.targets), compute_dtype=r.torch_weight_dtype)
    return QuantSpec(mode=side.nvfp4_mode, tile=tuple(side.weight_tile), targets=tuple(r.targets),
                     compute_dtype=r.torch_weight_dtype)


def _resolve_spec(cfg: ExportConfig, src: ExportSource, notes: list[str]) -> QuantSpec:
    if src.recipe and cfg.recipe and cfg.recipe != src.recipe:
        notes.append(f"--recipe {cfg.recipe} overrides the run's recipe {src.recipe}: the bits may differ "
                     "from the rollout's")
    if cfg.recipe is None and src.recipe_dict is not None:
        spec = recipe_spec(src.recipe_dict, notes)
    else:
        over = src.recipe_overrides if cfg.recipe is None else {}
        spec = recipe_spec(cfg.recipe or src.recipe or "quads", notes, **over)
    over: dict[str, Any] = {}
    if cfg.targets:
        over["targets"] = tuple(cfg.targets)
    if cfg.tile:
        over["tile"] = tuple(cfg.tile)
    if cfg.nvfp4_mode:
        if cfg.nvfp4_mode != spec.mode:
            notes.append(f"--nvfp4-mode {cfg.nvfp4_mode} re-quantizes weights the rollout quantized with "
                         f"mode {spec.mode}: codes/scales may differ from what the rollout used")
        over["mode"] = cfg.nvfp4_mode
    spec = dataclasses.replace(spec, **over)
    native = FORMATS[cfg.format].NATIVE_MODE
    if native and native != spec.mode:
        notes.append(f"the rollout quantized with NVFP4 mode {spec.mode!r}, {cfg.format}'s own quantizer is "
                     f"{native!r}: the exported bits are the rollout's (engines decode them identically); "
                     "only activations quantized by the engine at serve time follow the engine's rounding")
    return spec


def _linear_names(sd: dict[str, torch.Tensor], plan: ExportPlan) -> list[str]:
    """Every Linear module of the exported model (2-D ``.weight`` tensors except embeddings), per expert."""
    names = [q.name for q in plan.quantized]
    for k, t in plan.dense.items():
        if k.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in k:
            names.append(k.removesuffix(".weight"))
    return sorted(set(names))


def export(cfg: ExportConfig) -> ExportResult:
    check_out(Path(cfg.out), cfg.force, Path(cfg.checkpoint))  # before the expensive work
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    src = load_source(cfg.checkpoint)
    notes: list[str] = []
    fmt = FORMATS[cfg.format]
    quantize = cfg.format != "bf16" or cfg.qdq
    spec = _resolve_spec(cfg, src, notes) if quantize else None
    plan = build_plan(src.state_dict, spec or QuantSpec(targets=("<none>",)))
    if quantize and not plan.quantized:
        raise ValueError(f"--targets {list(spec.targets)} selects no quantizable linear; e.g. '*.mlp.experts'")
    if plan.protected:
        notes.append(f"{len(plan.protected)} matched modules stay BF16 (router/embeddings/lm_head), as in the "
                     f"rollout: {plan.protected[:3]}")
    if cfg.format == "compressed-tensors" and not cfg.engines_only:
        compressed_tensors.check_transformers_loadable(plan)
    w4a4 = cfg.activations == "nvfp4"
    if w4a4:
        from quads.export import calibrate as cal

        ids = cal.calibration_ids(src.hf_config, Path(cfg.calib_data) if cfg.calib_data else None,
                                  cfg.calib_tokens, cfg.seed, src.tokenizer_files)
        cal.calibrate(plan, src.state_dict, src.hf_config, ids)
    tensors: dict[str, torch.Tensor] = {}
    for q in plan.quantized:
        tensors.update(fmt.linear_tensors(q, w4a4))
    tensors.update(plan.dense)
    linear_names = _linear_names(src.state_dict, plan)
    config = dict(src.hf_config)
    config["dtype"] = "bfloat16"
    qc = fmt.quantization_config(plan, w4a4, linear_names)
    if qc is not None:
        config["quantization_config"] = qc
    meta = {
        "producer": "quads", "format": cfg.format, "source": str(src.checkpoint_dir), "recipe": src.recipe,
        "activations": "nvfp4" if w4a4 else "bf16", "qdq": cfg.qdq,
        "nvfp4": None if spec is None else {"mode": spec.mode, "tile": list(spec.tile),
                                            "targets": list(spec.targets),
                                            "compute_dtype": str(spec.compute_dtype).removeprefix("torch.")},
        "quantized_tensors": sorted(plan.sources), "notes": notes, "engines_only": cfg.engines_only,
    }
    with staging_dir(Path(cfg.out), cfg.force, src.checkpoint_dir) as tmp:
        write_shards(tmp, tensors, int(cfg.max_shard_mb * 2**20))
        write_json(tmp / "config.json", config)
        for name, obj in fmt.extra_files(plan, w4a4, linear_names).items():
            write_json(tmp / name, obj)
        write_json(tmp / METADATA_FILE, meta)
        write_files(src.tokenizer_files, tmp)
        files = sorted(p.name for p in tmp.iterdir())
    return ExportResult(Path(cfg.out), cfg.format, spec, len(plan.quantized), files, notes)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="training run folder or checkpoint folder")
    parser.add_argument("--format", required=True, choices=list(FORMATS))
    parser.add_argument("--out", required=True, help="destination folder (written atomically)")
    parser.add_argument("--recipe", default=None, help="recipe whose rollout bits to export (default: the run's)")
    parser.add_argument("--targets", default=None,
                        help="comma-separated fnmatch globs on linear names (default: routed experts)")
    parser.add_argument("--nvfp4-mode", default=None, help="re-quantize with this NVFP4 mode instead of the recipe's")
    parser.add_argument("--tile", default=None, choices=["1x16", "16x16"], help="override the recipe's weight tile")
    parser.add_argument("--activations", default="bf16", choices=list(ACTIVATIONS),
                        help="bf16: W4A16 scheme (default); nvfp4: W4A4 with calibrated input global scales")
    parser.add_argument("--calib-data", default=None, help="W4A4 calibration prompts, one per line")
    parser.add_argument("--calib-tokens", type=int, default=512, help="random calibration tokens without --calib-data")
    parser.add_argument("--qdq", action="store_true", help="bf16 format: write NVFP4-dequantized target weights")
    parser.add_argument("--max-shard-mb", type=float, default=4096.0, help="safetensors shard size (MiB)")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier quads export at --out (a run folder, a policy or any other "
                             "non-empty folder is never replaced)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines-only", action="store_true",
                        help="compressed-tensors: write NVFP4 experts for vLLM / SGLang although transformers "
                             "loads them with wrong scales (refused otherwise)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")


def config_from_args(args: argparse.Namespace) -> ExportConfig:
    return ExportConfig(
        checkpoint=args.checkpoint, out=args.out, format=args.format, recipe=args.recipe,
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()) if args.targets else None,
        nvfp4_mode=args.nvfp4_mode,
        tile=tuple(int(x) for x in args.tile.split("x")) if args.tile else None,
        activations=args.activations, calib_data=args.calib_data, calib_tokens=args.calib_tokens,
        qdq=args.qdq, max_shard_mb=args.max_shard_mb, force=args.force, seed=args.seed, threads=args.threads,
        engines_only=args.engines_only,
    )


def run(args: argparse.Namespace) -> int:
    try:
        res = export(config_from_args(args))
    except ValueError as e:
        print(f"quads export: error: {e}", file=sys.stderr)
        return 2
    for n in res.notes:
        print(f"note: {n}", file=sys.stderr)
    spec = "" if res.spec is None else f" (NVFP4 mode {res.spec.mode}, tile {res.spec.tile})"
    print(f"wrote {res.format} export to {res.out}: {res.n_quantized} NVFP4 linears{spec}; files: "
          + ", ".join(res.files))
    print(json.dumps({"out": str(res.out), "format": res.format, "n_quantized": res.n_quantized}))
    return 0


def load_exported(folder: str | Path, **kwargs: Any):
    """See ``quads.export.importer.load_exported``."""
    from quads.export.importer import load_exported as _load

    return _load(folder, **kwargs)
