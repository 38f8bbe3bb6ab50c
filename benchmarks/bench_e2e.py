"""End-to-end benchmarks: rollout tokens/s per recipe, and the cost of a W4A16-QAT trainer step.

    python benchmarks/bench_e2e.py [--suites rollout,trainer] [--preset 100m] [--device cuda] [--json F]
    quads bench e2e ...                                   (the same)

rollout: the rollout engine (``quads.rollout.RolloutEngine``) on one MoE preset (random weights: the
  speed does not depend on them, and ``ignore_eos`` fixes every response at ``--new-tokens``), one
  model per rollout precision: BF16, FP8 W8A8, NVFP4 W4A16 (weights only), NVFP4 W4A4, NVFP4 W4A4 +
  RAC 50%. ``--prompts`` x ``--n`` samples of ``--prompt-len`` tokens each; the median of ``--reps``
  generations after one warm-up; tokens/s counts response tokens over prefill + decode. ``--experts
  grouped,loop`` times both expert paths of the rollout side (``quads.quant.grouped`` vs the loop).
  On Hopper every NVFP4 GEMM is emulated (dequantized operands, fp32 GEMM: no FP4 tensor cores), so
  these are the costs of this implementation, not the speed of FP4 hardware.
trainer: one GRPO-shaped trainer step on a fixed batch (``--batch`` sequences of ``--seq-len``
  tokens): full-sequence forward of the response log-probs under BF16 autocast over fp32 master
  weights, a policy-gradient loss, backward, grad clip, AdamW step; BF16 against W4A16-QAT
  (``QDQ(W)`` in the forward, straight-through backward, the QDQ cached per step), medians of
  ``--reps`` steps after warm-up, ratio in the same run.
Prints a table and one JSON line at the end (hardware and versions included).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quads.model import ModelConfig, MoEForCausalLM  # noqa: E402
from quads.model.tokenizer import CharTokenizer  # noqa: E402
from quads.quant import quantize_model  # noqa: E402
from quads.quant.recipe import LinearSpec, Recipe  # noqa: E402
from quads.rl.logprobs import SequenceBatch, forward_logprobs  # noqa: E402
from quads.rollout.engine import RolloutEngine, SamplingParams  # noqa: E402

ROLLOUT_RECIPES = {
    "bf16": LinearSpec(),
    "fp8": LinearSpec(weight="fp8", act="fp8"),
    "w4a16": LinearSpec(weight="nvfp4"),
    "w4a4": LinearSpec(weight="nvfp4", act="nvfp4"),
    "w4a4+rac50": LinearSpec(weight="nvfp4", act="nvfp4", rac_ratio=0.5),
}


def env_info(device: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    else:
        info.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _model(preset: str, device: str, dtype: str, seed: int = 0) -> MoEForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset(preset, vocab_size=CharTokenizer().vocab_size, dtype=dtype)
    return MoEForCausalLM(cfg).to(device)


def _set_experts_path(model: torch.nn.Module, path: str) -> None:
    """Rollout expert path: "grouped" (batched, the CUDA default) or "loop" (one GEMM pair per expert)."""
    from quads.quant.layers import QuantizedExperts

    for m in model.modules():
        if isinstance(m, QuantizedExperts):
            m.grouped = path == "grouped"


def bench_rollout(args, rows: list) -> None:
    tok = CharTokenizer()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, tok.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    sp = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0, record_routing=True)
    paths = [p.strip() for p in args.experts.split(",") if p.strip()]
    for path in paths:
        for name, spec in ROLLOUT_RECIPES.items():
            model = _model(args.preset, args.device, "bfloat16").requires_grad_(False)
            quantize_model(model, Recipe(f"bench-{name}", rollout=spec), side="rollout", verbose=False)
            _set_experts_path(model, path)
            eng = RolloutEngine(model, tok, device=args.device)
            eng.generate(prompts[: max(1, len(prompts) // 4)], sp)  # warm-up (kernels, allocator)
            tps, dec = [], []
            for _ in range(args.reps):
                b = eng.generate(prompts, sp)
                tps.append(b.stats.tokens_per_s)
                dec.append(b.stats.decode_s / max(b.stats.decode_steps, 1) * 1e3)
            rows.append({"suite": "rollout", "recipe": name, "experts": path, "spec": spec.describe(),
                         "tokens_per_s": statistics.median(tps), "decode_ms_per_step": statistics.median(dec),
                         "samples": len(prompts) * args.n, "new_tokens": args.new_tokens})
            del eng, model
    for path in paths:
        mine = [r for r in rows if r["suite"] == "rollout" and r["experts"] == path]
        base = next(r["tokens_per_s"] for r in mine if r["recipe"] == "bf16")
        for r in mine:
            r["vs_bf16"] = r["tokens_per_s"] / base
            if path != paths[0]:
                first = next(q for q in rows if q["suite"] == "rollout" and q["experts"] == paths[0]
                             and q["recipe"] == r["recipe"])
                r[f"vs_{paths[0]}"] = r["tokens_per_s"] / first["tokens_per_s"]


def _time_trainer_step(args, spec: LinearSpec, batch: SequenceBatch, adv: torch.Tensor) -> tuple[float, int]:
    """Median seconds of one trainer step with the trainer side under ``spec``; parameter count."""
    model = _model(args.preset, args.device, "float32")
    quantize_model(model, Recipe("bench", trainer=spec), side="trainer", verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step():
        with torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16):
            res = forward_logprobs(model, batch, None, 1.0)
        loss = -(res.logprobs * adv).sum() / batch.response_mask.sum() + res.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(2):
        step()
    ts = []
    for _ in range(args.reps):
        _sync(args.device)
        t0 = time.perf_counter()
        step()
        _sync(args.device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), sum(p.numel() for p in model.parameters())


def bench_trainer(args, rows: list) -> None:
    tok = CharTokenizer()
    B, S, P = args.batch, args.seq_len, args.seq_len // 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, tok.vocab_size, (B, S), generator=g).to(args.device)
    batch = SequenceBatch(ids, torch.ones(B, S, dtype=torch.bool, device=args.device), P,
                          torch.ones(B, S - P, dtype=torch.bool, device=args.device))
    adv = torch.randn(B, 1, generator=g).to(args.device)
    times = {}
    for name, spec in (("bf16", LinearSpec()), ("w4a16-qat", LinearSpec(weight="nvfp4"))):
        times[name], n_params = _time_trainer_step(args, spec, batch, adv)
        rows.append({"suite": "trainer", "recipe": name, "step_ms": times[name] * 1e3, "batch": B, "seq_len": S,
                     "params": n_params})
    rows[-1]["vs_bf16"] = times["w4a16-qat"] / times["bf16"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", default="rollout,trainer", help="comma list: rollout, trainer")
    ap.add_argument("--preset", default="100m", help="model preset (quads.model.PRESETS)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16, help="rollout: prompts per generation")
    ap.add_argument("--n", type=int, default=8, help="rollout: samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=16, help="rollout: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="rollout: response tokens (eos ignored)")
    ap.add_argument("--experts", default="grouped",
                    help="rollout expert paths to time, comma list: grouped (batched), loop (one GEMM pair per expert)")
    ap.add_argument("--batch", type=int, default=64, help="trainer: sequences per step")
    ap.add_argument("--seq-len", type=int, default=128, help="trainer: tokens per sequence")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    bad = set(suites) - {"rollout", "trainer"}
    if bad:
        ap.error(f"unknown suite(s) {sorted(bad)}; valid: rollout, trainer")
    rows: list = []
    info = env_info(args.device)
    print("# " + json.dumps(info))
    if "rollout" in suites:
        bench_rollout(args, rows)
    if "trainer" in suites:
        bench_trainer(args, rows)
    for r in rows:
        if r["suite"] == "rollout":
            extra = "".join(f"  {v:.2f}x {k[3:]}" for k, v in r.items() if k.startswith("vs_") and k != "vs_bf16")
            print(f"rollout {r['recipe']:>11} ({r['experts']}): {r['tokens_per_s']:9.0f} tok/s  "
                  f"{r['decode_ms_per_step']:7.2f} ms/decode step  {r['vs_bf16']:.2f}x bf16{extra}")
        else:
            extra = f"  {r['vs_bf16']:.3f}x bf16" if "vs_bf16" in r else ""
            print(f"trainer {r['recipe']:>11}: {r['step_ms']:9.1f} ms/step ({r['batch']}x{r['seq_len']} tokens){extra}")
    out = {"info": info, "args": vars(args), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
