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
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--diagnose", action="store_true", help="also the diagnose hook: gap vs the trainer per variant")
    args = ap.parse_args()

    import torch

    from quads.experiments.vllm_compare import logprob_gap, quads_prompt_logprobs
    from quads.model.config import ModelConfig
    from quads.model.hf import load_hf_model, save_hf_model
    from quads.model.tokenizer import CharTokenizer
    from quads.model.transformer import MoEForCausalLM
    from quads.quant import get_recipe, quantize_model
    from quads.rollout.types import SamplingParams
    from quads.rollout.vllm.engine import VLLMEngineConfig, VLLMRolloutEngine

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", n_layers=2, dtype=args.dtype, vocab_size=128, init_std=args.init_std)
    policy = MoEForCausalLM(cfg)
    tok = CharTokenizer()
    folder = tempfile.mkdtemp(prefix="quads-vllm-smoke-") + "/policy"
    save_hf_model(policy, tok, folder)
    g = torch.Generator().manual_seed(1)
    seqs = [[tok.bos_id] + torch.randint(4, tok.vocab_size, (args.len - 1,), generator=g).tolist() for _ in range(args.seqs)]

    t0 = time.perf_counter()
    eng = VLLMRolloutEngine(folder, tok, "quads", VLLMEngineConfig(dtype=args.dtype, native_bf16=False, weight_storage="master"))
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
    diag = diagnose(folder, tok, args.dtype) if args.diagnose else None
    print(json.dumps({"engine_start_s": round(start_s, 1), "dtype": args.dtype, "init_std": args.init_std,
                      "gaps": gaps, "push_ok": rep.ok, "diagnose": diag}))


def diagnose(folder: str, tok, dtype: str) -> dict:
    """vLLM rollout variants vs quads' trainer forward (BF16 and W4A16-QAT) on one sampled batch."""
    import copy

    import torch

    from quads.model.hf import load_hf_model
    from quads.quant import LinearSpec, Recipe, quantize_model
    from quads.rl.logprobs import forward_logprobs
    from quads.rollout import RolloutEngine, SamplingParams
    from quads.rollout.vllm.diagnose import vllm_rollout_logprobs

    policy, _ = load_hf_model(folder, dtype=dtype)
    batch = RolloutEngine(policy, tok).generate(["12+3=", "7*8=", "(4+5)*2=", "9-7="],
                                                SamplingParams(n=4, max_new_tokens=24, seed=0))
    specs = {"bf16": LinearSpec(), "w4a16": LinearSpec.of(weight="nvfp4"), "w16a4": LinearSpec.of(act="nvfp4"),
             "w4a4": LinearSpec.of(weight="nvfp4", act="nvfp4"),
             "w4a4+rac0.5": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5)}
    roll = vllm_rollout_logprobs(policy, tok, batch, specs, dtype=dtype)
    mask = batch.response_mask
    out = {}
    for tname, tspec in {"bf16": LinearSpec(), "w4a16-qat": LinearSpec.of(weight="nvfp4")}.items():
        trainer = copy.deepcopy(policy)
        quantize_model(trainer, Recipe(tname, trainer=tspec), side="trainer", verbose=False)
        with torch.no_grad():
            t = forward_logprobs(trainer, batch).logprobs.float()
        for rname, r in roll.items():
            d = (r - t).abs()[mask]
            out[f"{rname}|{tname}"] = {"max": float(d.max()), "mean": float(d.mean())}
            print(f"diagnose: vLLM {rname:<12} vs trainer {tname:<10} max {d.max():.3e} mean {d.mean():.3e}")
    return out


if __name__ == "__main__":
    main()
