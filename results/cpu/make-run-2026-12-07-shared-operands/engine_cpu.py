"""The CPU rollout engine (eager decode, the experts loop) with the W4A4 operands per expert
(share_operands=False, the reference) and once per layer call (True, the default): tiny preset, random
weights, 64 prompts x 8 samples, 16-token prompts, 32 new tokens, ignore_eos, median of 3 generations after a
warm-up. Run from the repo root: PYTHONPATH=. .venv/bin/python results/cpu/make-run-2026-12-07-shared-operands/engine_cpu.py"""
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_e2e as B

from quads.quant.layers import QuantizedExperts
from quads.rollout.engine import RolloutEngine, SamplingParams

tok = B.CharTokenizer()
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(4, tok.vocab_size, (16,), generator=g).tolist() for _ in range(64)]
for name in ["w4a4", "w4a4+rac50"]:
    outs = {}
    for share in [False, True]:
        QuantizedExperts.share_operands = share
        model = B._model("tiny", "cpu", "bfloat16").requires_grad_(False)
        B._quantized(model, name, B.ROLLOUT_RECIPES[name], prompts, "cpu")
        B._set_experts_path(model, "loop")
        eng = RolloutEngine(model, tok, device="cpu")
        sp = SamplingParams(n=8, max_new_tokens=32, ignore_eos=True, seed=0)
        eng.generate(prompts, sp)
        runs = []
        for _ in range(3):
            b = eng.generate(prompts, sp)
            runs.append((b.stats.decode_s / b.stats.decode_steps * 1e3, b.stats.prefill_s * 1e3, b.stats.tokens_per_s))
        runs.sort()
        outs[share] = b
        print(json.dumps({"recipe": name, "share_operands": share, "decode_ms_per_step": round(runs[1][0], 2),
                          "prefill_ms": round(runs[1][1], 1), "tokens_per_s": round(runs[1][2])}), flush=True)
    same = (outs[False].response_ids == outs[True].response_ids and torch.equal(outs[False].logprobs, outs[True].logprobs))
    print(json.dumps({"recipe": name, "same_tokens_and_logprobs": same}), flush=True)
