"""vLLM's quads experts, one layer in eager mode (as vLLM runs the quads method: ``enforce_eager``): the loop
against the sorted grouped path (``quads.rollout.vllm.experts``), per recipe and batch size.

    python benchmarks/bench_vllm_experts.py [--preset 1b] [--recipes w4a16,nvfp4,quads] [--tokens 128,2048]
                                            [--device cuda] [--warmup 3] [--reps 20] [--json out.json]

One expert stack of the preset (``n_experts`` x [2I, H] and [H, I], BF16 masters) held as vLLM's quads method holds
it with packed storage (``RolloutWeight``: NVFP4 codes, E4M3 block scales, FP32 global scales), random routes
(``top_k`` distinct experts per token, softmax weights), BF16 activations. Per (recipe, tokens): the median,
IQR and min milliseconds of each path (CUDA events on CUDA, ``perf_counter`` elsewhere) and their ratio, one
counted call of each (``bench_sync.counted``: ATen compute ops, quads' Triton launches, host syncs), and
whether the two paths' outputs agree within the bound of ``tests/test_vllm_experts.py`` (relative Frobenius
distance; the same quantized operands, the GEMMs' accumulation order aside). The last line is the JSON record.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_qat_refresh import _count_triton, env_info  # noqa: E402
from bench_sync import counted  # noqa: E402

from quads.bench import add_run_args, run_args, timer  # noqa: E402
from quads.model.config import PRESETS as MODEL_PRESETS  # noqa: E402
from quads.quant.recipe import get_recipe  # noqa: E402
from quads.rollout.vllm.experts import VllmExpertOperands, experts_forward, sorted_experts_forward  # noqa: E402
from quads.rollout.vllm.weights import RolloutWeight, expert_units  # noqa: E402


def _layer(e: int, h: int, inter: int, device: str, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    layer = nn.Module()
    layer.w13_weight = nn.Parameter((0.05 * torch.randn(e, 2 * inter, h, generator=g)).bfloat16().to(device),
                                    requires_grad=False)
    layer.w2_weight = nn.Parameter((0.05 * torch.randn(e, h, inter, generator=g)).bfloat16().to(device),
                                   requires_grad=False)
    return layer


def _weights(layer: nn.Module, spec, storage: str = "packed") -> tuple[RolloutWeight, RolloutWeight]:
    out = []
    for pname in ("w13_weight", "w2_weight"):
        units = expert_units("experts", pname, tuple(getattr(layer, pname).shape))
        with torch.device(layer.w13_weight.device):  # where RolloutWeight allocates its codes
            rw = RolloutWeight(layer, pname, units, spec, torch.bfloat16, storage)
        rw.quantize_all()
        out.append(rw)
    return out[0], out[1]


def _stats(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "iqr_ms": q[2] - q[0], "min_ms": min(ms)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b", help="model preset whose expert shapes to use (quads.model.config)")
    ap.add_argument("--recipes", default="w4a16,nvfp4,quads", help="comma-separated recipe names")
    ap.add_argument("--tokens", default="128,2048", help="comma-separated batch sizes (tokens per layer call)")
    ap.add_argument("--seed", type=int, default=0)
    add_run_args(ap, warmup=3, reps=20, warmup_help="untimed calls per path first", reps_help="timed calls per path")
    args = ap.parse_args(argv)
    run_args(ap, args)
    if args.preset not in MODEL_PRESETS:
        ap.error(f"unknown preset {args.preset!r}; valid: {', '.join(MODEL_PRESETS)}")
    cfg = MODEL_PRESETS[args.preset]
    e, h, inter, k = cfg["n_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["top_k"]
    tokens = [int(t) for t in args.tokens.split(",")]
    timed = timer(args.device)
    triton_n, inside = collections.Counter(), [False]
    _count_triton(triton_n, inside)
    layer = _layer(e, h, inter, args.device, args.seed)
    rows = []
    for name in args.recipes.split(","):
        spec = get_recipe(name).rollout
        w13, w2 = _weights(layer, spec)
        operands = {"gate_up_proj": VllmExpertOperands(w13), "down_proj": VllmExpertOperands(w2)}
        act = torch.nn.functional.silu
        for t in tokens:
            g = torch.Generator().manual_seed(args.seed + t)
            x = torch.randn(t, h, generator=g).bfloat16().to(args.device)
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(args.device)
            wts = torch.randn(t, k, generator=g).softmax(-1).bfloat16().to(args.device)
            paths = {
                "loop": functools.partial(experts_forward, x, ids, wts, n_experts=e, gate_up=w13.gemm_weights,
                                          down=w2.gemm_weights, spec=spec, act_fn=act, selectors={}),
                "sorted": functools.partial(sorted_experts_forward, x, ids, wts, n_experts=e, operands=operands,
                                            spec=spec, act_fn=act, selectors={}),
            }
            row = {"recipe": name, "tokens": t}
            outs = {}
            with torch.no_grad():
                for path, fn in paths.items():
                    for _ in range(args.warmup):
                        outs[path] = fn()
                    row[path] = _stats([timed(fn) for _ in range(args.reps)])
                    c = counted(fn, inside, triton_n)
                    row[path] |= {k: c[k] for k in ("host_syncs", "compute_ops", "triton_launches")}
            a, b = outs["sorted"].double(), outs["loop"].double()
            row["rel_diff"] = float((a - b).norm() / b.norm())
            row["speedup"] = row["loop"]["median_ms"] / row["sorted"]["median_ms"]
            rows.append(row)
            print(f"{name:8s} T={t:5d}  loop {row['loop']['median_ms']:8.3f} ms  sorted "
                  f"{row['sorted']['median_ms']:8.3f} ms  {row['speedup']:6.2f}x  rel diff {row['rel_diff']:.2e}  "
                  "ops / Triton launches / host syncs: loop "
                  + " / ".join(str(row["loop"][k]) for k in ("compute_ops", "triton_launches", "host_syncs"))
                  + ", sorted " + " / ".join(str(row["sorted"][k]) for k in ("compute_ops", "triton_launches", "host_syncs")),
                  flush=True)
    record = {"bench": "vllm_experts", "preset": args.preset, "experts": e, "hidden": h, "intermediate": inter,
              "top_k": k, "warmup": args.warmup, "reps": args.reps, "env": env_info(args.device), "rows": rows}
    line = json.dumps(record)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
