#!/usr/bin/env bash
# Scale-out measurement: the same `quads train` run on 1 GPU and under torchrun on 2 GPUs (NCCL,
# FSDP2 trainer, data-parallel rollouts), same global batch and seed; prints step time, rollout
# tokens/s and the scaling efficiency, and ends in one JSON line.
#
#   bash scripts/gpu_scaleout.sh                 # PRESET=100m STEPS=3 PROMPTS=16 N=8 NEW=48
#   OUT=/some/dir PYTHON=python3 bash scripts/gpu_scaleout.sh
#
# The policy is a random-init checkpoint of the built-in PRESET (no warm start: timing only).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
# NVLink multicast stays off (a program that uses it can take a shared host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
OUT=${OUT:-runs/scaleout}
PRESET=${PRESET:-100m}
STEPS=${STEPS:-3}
PROMPTS=${PROMPTS:-16}
N=${N:-8}
NEW=${NEW:-48}
NGPU=${NGPU:-2}
DEVICE=${DEVICE:-cuda}  # cpu: a smoke test of this script under gloo
LIMIT=${LIMIT:-150}  # seconds per run
mkdir -p "$OUT"
nvidia-smi -L 2>/dev/null | head -4
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"

$PY - "$OUT/ckpt" "$PRESET" <<'PYEOF'
import sys
import torch
from quads.model.checkpoint import save_checkpoint
from quads.model.config import ModelConfig
from quads.model.tokenizer import CharTokenizer
from quads.model.transformer import MoEForCausalLM
torch.manual_seed(0)
tok = CharTokenizer()
cfg = ModelConfig.preset(sys.argv[2], vocab_size=tok.vocab_size)
save_checkpoint(MoEForCausalLM(cfg), sys.argv[1], tokenizer=tok)
print(f"checkpoint {sys.argv[1]}: preset {sys.argv[2]}, {sum(p.numel() for p in MoEForCausalLM(cfg).parameters())/1e6:.1f}M params")
PYEOF

ARGS=(--model.checkpoint "$OUT/ckpt" --task.name arithmetic --recipe.name quads
      --rollout.prompts-per-step "$PROMPTS" --rollout.n-samples "$N" --rollout.max-new-tokens "$NEW"
      --steps "$STEPS" --eval-every 0 --eval-n 8 --device "$DEVICE" --dtype bfloat16
      --log.tensorboard false --log.progress false --quiet)
rm -rf "$OUT/gpu1" "$OUT/gpu$NGPU"
echo "== 1 GPU: $PY -m quads.cli train ${ARGS[*]} --out-dir $OUT/gpu1"
CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" $PY -m quads.cli train "${ARGS[@]}" --out-dir "$OUT/gpu1" 2>&1 | tail -3
echo "== $NGPU GPUs: $PY -m torch.distributed.run --nproc-per-node $NGPU -m quads.cli train ... --out-dir $OUT/gpu$NGPU"
timeout "$LIMIT" $PY -m torch.distributed.run --nproc-per-node "$NGPU" -m quads.cli train "${ARGS[@]}" \
    --out-dir "$OUT/gpu$NGPU" 2>&1 | grep -v "^\s*$" | tail -3

$PY - "$OUT" "$NGPU" <<'PYEOF'
import json, sys
from pathlib import Path
out, ngpu = Path(sys.argv[1]), int(sys.argv[2])
keys = ("time/step_s", "time/rollout_s", "time/old_logprobs_s", "time/train_s", "time/sync_s",
        "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "mismatch/tokens")
res = {}
for name in ("gpu1", f"gpu{ngpu}"):
    path = out / name / "metrics.jsonl"
    if not path.exists():
        print(f"{name}: no metrics (run failed)"); continue
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    steps = [r for r in recs if r["step"] >= 2 and "time/step_s" in r] or [r for r in recs if "time/step_s" in r]
    res[name] = {k: sum(r[k] for r in steps) / len(steps) for k in keys if all(k in r for r in steps)}
    res[name]["steps_averaged"] = [r["step"] for r in steps]
    print(name, " ".join(f"{k}={v:.4g}" for k, v in res[name].items() if isinstance(v, float)))
if len(res) == 2:
    a, b = res["gpu1"], res[f"gpu{ngpu}"]
    res["speedup_step"] = a["time/step_s"] / b["time/step_s"]
    res["efficiency_step"] = res["speedup_step"] / ngpu
    res["speedup_rollout_tokens_per_s"] = b["perf/rollout_tokens_per_s"] / a["perf/rollout_tokens_per_s"]
    res["efficiency_rollout"] = res["speedup_rollout_tokens_per_s"] / ngpu
    print(f"step speedup {res['speedup_step']:.2f}x on {ngpu} GPUs (efficiency {res['efficiency_step']:.0%}); "
          f"rollout tokens/s {res['speedup_rollout_tokens_per_s']:.2f}x (efficiency {res['efficiency_rollout']:.0%})")
print(json.dumps({"metric": "scaleout", "ngpu": ngpu, **res}))
(out / "scaleout.json").write_text(json.dumps(res, indent=1))
PYEOF
