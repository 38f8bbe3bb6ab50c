"""Smoke run of the vLLM backend on a tiny random Qwen3-MoE (CPU, about a minute).

Saves a tiny built-in MoE as a Hugging Face folder, starts one vLLM engine with the ``"quads"``
quantization method, and for every recipe prints the per-token log-prob gap between vLLM and quads'
own forward on the same token sequences, then pushes weights (fingerprint check) and samples.

    .venv-vllm/bin/python scripts/vllm_smoke.py [--dtype bfloat16|float32] [--seqs 4] [--len 24]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=24)
    ap.add_argument("--recipes", default="bf16,fp8,nvfp4,w4a16-qat,quads")
    args = ap.parse_args()

    import torch

    from quads.model.config import ModelConfig
    from quads.model.hf import load_hf_model, save_hf_model
    from quads.model.tokenizer import CharTokenizer
    from quads.model.transformer import MoEForCausalLM
    from quads.quant import get_recipe, quantize_model
    from quads.rollout.engine import SamplingParams
    from quads.vllm.compare import logprob_gap, quads_prompt_logprobs
    from quads.vllm.engine import VLLMEngineConfig, VLLMRolloutEngine

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", n_layers=2, dtype=args.dtype, vocab_size=128)
    policy = MoEForCausalLM(cfg)
    tok = CharTokenizer()
    folder = tempfile.mkdtemp(prefix="quads-vllm-smoke-") + "/policy"
    save_hf_model(policy, tok, folder)
    g = torch.Generator().manual_seed(1)
    seqs = [[tok.bos_id] + torch.randint(4, tok.vocab_size, (args.len - 1,), generator=g).tolist() for _ in range(args.seqs)]

    t0 = time.perf_counter()
    eng = VLLMRolloutEngine(folder, tok, "quads", VLLMEngineConfig(dtype=args.dtype, native_bf16=False))
    start_s = time.perf_counter() - t0
    gaps = {}
    for name in args.recipes.split(","):
        recipe = get_recipe(name)
        eng.set_recipe(recipe)
        ref_model, _ = load_hf_model(folder, dtype=args.dtype)
        quantize_model(ref_model, recipe, side="rollout", verbose=False)
        v = eng.prompt_logprobs(seqs, one_at_a_time=True)
        q = quads_prompt_logprobs(ref_model, seqs)
        gaps[name] = logprob_gap(v, q)
        print(f"{name:>10}: vLLM vs quads forward  max |dlogp| {gaps[name]['max']:.3e}  mean {gaps[name]['mean']:.3e}")
    eng.set_recipe("quads")
    trainer, _ = load_hf_model(folder, dtype="float32")
    quantize_model(trainer, get_recipe("quads"), side="trainer", verbose=False)
    rep = eng.push_weights(trainer)
    print(f"push: {rep.n_tensors} tensors, {rep.n_checked} operands fingerprinted, ok={rep.ok}, {rep.seconds:.2f}s")
    batch = eng.generate(["12+3="] * 2, SamplingParams(n=2, max_new_tokens=8, seed=0))
    print("sample:", batch.texts, batch.logprobs[0].tolist())
    print(json.dumps({"engine_start_s": round(start_s, 1), "dtype": args.dtype, "gaps": gaps, "push_ok": rep.ok}))


if __name__ == "__main__":
    main()
