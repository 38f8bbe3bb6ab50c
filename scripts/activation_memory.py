"""CPU proxy of the trainer's GPU memory per forward: what autograd keeps for the backward, per sequence.

    PYTHONPATH=. python scripts/activation_memory.py [--preset 100m] [--recipe bf16] [--prompt 64] \
        [--response 400] [--micro 64,32,16] [--out results/cpu/activation_memory.json]

Builds the ``--preset`` model (random weights: the saved shapes do not depend on them) as the trainer does
(FP32 master weights, ``--recipe``'s trainer side, the experts' grouped path as on CUDA), then runs the
trainer's training forward (``forward_logprobs`` with entropy, BF16 autocast) on 1 and on 2 unpadded rows of
``prompt + response`` tokens and sums, with ``torch.autograd.graph.saved_tensors_hooks``, the bytes of the
distinct storages autograd saves for the backward that are not parameters. The difference between the two
row counts is the saved activation memory per sequence; the rest is per forward (e.g. autocast's BF16
weight copies). Unpadded rows take SDPA's causal path, which saves no [L, L] attention matrix on either
device (a padded CPU batch takes the math path, which does; CUDA's memory-efficient kernel does not).

Printed estimate of the update's peak with ``m`` rows per forward: weights, gradients and AdamW state in FP32
(4 x 4 bytes per parameter) + the BF16 rollout replica (2 bytes per parameter) + the per-forward part +
``m`` x the per-sequence part. Not counted: transient buffers of the backward, the rollout engine's KV cache
and CUDA-graph pool, allocator fragmentation, the CUDA context. A proxy to compare micro-batch sizes with,
not a GPU measurement (``perf/max_mem_gib`` / ``perf/max_reserved_gib`` in a GPU run's metrics are that).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

GIB = 2**30


def saved_bytes(model: torch.nn.Module, rows: int, prompt: int, response: int, vocab: int) -> int:
    """Bytes of the non-parameter storages autograd saves in one training forward of ``rows`` sequences."""
    from quads.rl.logprobs import SequenceBatch, forward_logprobs

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    gen = torch.Generator().manual_seed(rows)
    S = prompt + response
    seq = SequenceBatch(torch.randint(4, vocab, (rows, S), generator=gen), torch.ones(rows, S, dtype=torch.bool),
                        prompt, torch.ones(rows, response, dtype=torch.bool))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        res = forward_logprobs(model, seq, None, 1.0, return_entropy=True)
    del res
    return sum(seen.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--recipe", default="bf16", help="trainer side of this recipe (bf16, quads, ...)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt columns")
    ap.add_argument("--response", type=int, default=400, help="response columns (rollout.max_new_tokens)")
    ap.add_argument("--micro", default="64,32,16", help="rows per forward to estimate the peak for")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from quads.model import ModelConfig, MoEForCausalLM
    from quads.model.tokenizer import CharTokenizer
    from quads.quant import get_recipe, quantize_model

    vocab = CharTokenizer().vocab_size
    torch.manual_seed(0)
    model = MoEForCausalLM(ModelConfig.preset(args.preset, vocab_size=vocab, dtype="float32"))
    quantize_model(model, get_recipe(args.recipe, expert_path="grouped"), side="trainer", verbose=False)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    one, two = (saved_bytes(model, r, args.prompt, args.response, vocab) for r in (1, 2))
    per_row, fixed = two - one, 2 * one - two
    static = n_params * (4 * 4 + 2)
    out = {"metric": "activation_memory", "preset": args.preset, "recipe": args.recipe, "params": n_params,
           "width": args.prompt + args.response, "saved_gib_per_sequence": per_row / GIB,
           "saved_gib_per_forward": fixed / GIB, "static_gib": static / GIB,
           "estimate_gib": {m: (static + fixed + m * per_row) / GIB for m in map(int, args.micro.split(","))},
           "seconds": time.perf_counter() - t0, "torch": torch.__version__, "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine()}
    print(f"{args.preset} ({n_params / 1e6:.0f}M parameters), trainer of {args.recipe}, rows of "
          f"{out['width']} tokens: saved {per_row / 2**20:.0f} MiB per sequence + {fixed / 2**20:.0f} MiB per "
          f"forward; FP32 weights, gradients, AdamW + BF16 replica {static / GIB:.2f} GiB")
    for m, gib in out["estimate_gib"].items():
        print(f"  {m:4d} rows per forward: ~{gib:.1f} GiB (activations {m * per_row / GIB:.1f} GiB)")
    line = json.dumps(out)
    print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
