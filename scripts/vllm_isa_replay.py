"""vLLM (quads method, fp32) vs quads' forward on the sequences of tests/test_vllm.py, with and without replaying
vLLM's quantize inputs (``quads.experiments.vllm_compare.replay_layer_inputs``); layer-0 experts inputs compared.

    .venv-vllm/bin/python scripts/vllm_isa_replay.py                          # this CPU's ISA
    .venv-vllm/bin/python scripts/force_avx2.py scripts/vllm_isa_replay.py    # as on an AVX2-only CPU
"""

import tempfile
from pathlib import Path

import torch

from quads.experiments.vllm_compare import logprob_gap, quads_prompt_logprobs, replay_layer_inputs
from quads.model.config import ModelConfig
from quads.model.hf import load_hf_model, save_hf_model
from quads.model.tokenizer import CharTokenizer
from quads.model.transformer import MoEForCausalLM
from quads.quant import get_recipe, quantize_model
from quads.rollout.vllm import worker
from quads.rollout.vllm.engine import VLLMEngineConfig, VLLMRolloutEngine


def _run(layer, x, ids, w):
    """The experts layer on (x, vLLM's routing); with the FP8 activation QDQ outputs of each GEMM call."""
    from quads.quant import ops  # fp8_linear calls ops.fp8_act_qdq

    seen: list[torch.Tensor] = []
    orig = ops.fp8_act_qdq

    def rec(t, scheme):
        out = orig(t, scheme)
        seen.append(out)
        return out

    ops.fp8_act_qdq = rec
    try:
        with torch.no_grad():
            y = layer(x, ids.long(), w)
    finally:
        ops.fp8_act_qdq = orig
    return y, seen


def main() -> None:
    torch.manual_seed(0)  # the policy and sequences of tests/test_vllm.py
    cfg = ModelConfig.preset("tiny", n_layers=2, dtype="float32", vocab_size=128, init_std=0.08)
    tok = CharTokenizer()
    folder = Path(tempfile.mkdtemp()) / "policy"
    save_hf_model(MoEForCausalLM(cfg), tok, folder)
    g = torch.Generator().manual_seed(1)
    seqs = [[tok.bos_id] + torch.randint(4, tok.vocab_size, (n,), generator=g).tolist() for n in (17, 24, 31)]
    eng = VLLMRolloutEngine(folder, tok, "quads", VLLMEngineConfig(dtype="float32", native_bf16=False, max_num_seqs=8, weight_storage="master"))
    print("torch ISA", torch.backends.cpu.get_cpu_capability(), "| torch.cpu reports AVX-512:",
          torch.cpu._is_avx512_supported())
    layers = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for key in ("fp8", "quads"):
        recipe = get_recipe(key)
        eng.set_recipe(recipe)
        eng.rpc(worker.record_inputs, True)
        got = eng.prompt_logprobs(seqs, one_at_a_time=True)
        rec = eng.rpc(worker.record_inputs, False)
        model, _ = load_hf_model(folder, dtype="float32")
        quantize_model(model, recipe, side="rollout", verbose=False)
        own: dict[str, list[torch.Tensor]] = {n: [] for n in layers}
        hooks = [model.get_submodule(n).register_forward_pre_hook(
            lambda m, a, n=n, own=own: own[n].append(a[0].detach().clone())) for n in layers]
        plain = logprob_gap(got, quads_prompt_logprobs(model, seqs))["max"]
        for h in hooks:
            h.remove()
        with replay_layer_inputs(model, rec):
            replayed = logprob_gap(got, quads_prompt_logprobs(model, seqs))["max"]
        print(f"{key}: max |dlogp| plain {plain:.3e}, replayed quantize inputs {replayed:.3e}")
        for n in layers:
            for i, ((xv, ids, w), xq) in enumerate(zip(rec[n], own[n])):
                layer = model.get_submodule(n)
                yv, qv = _run(layer, xv, ids, w)
                yq, qq = _run(layer, xq, ids, w)
                d = (xv - xq).abs()
                flips = [int(((a - b).abs() > 1e-2 * torch.maximum(a.abs(), b.abs())).sum()) for a, b in zip(qv, qq)]
                print(f"  seq {i} {n}: input rel diff {float(d.max() / xq.abs().max()):.1e} "
                      f"({int((d > 0).sum())}/{d.numel()} elements); output rel diff "
                      f"{float((yv - yq).abs().max() / yq.abs().max()):.1e}"
                      + (f"; FP8 activation codes that differ (per GEMM call): {sum(flips)} in {sum(f > 0 for f in flips)}"
                         f" of {len(flips)} calls" if key == "fp8" else ""))
    eng.close()


if __name__ == "__main__":
    main()
