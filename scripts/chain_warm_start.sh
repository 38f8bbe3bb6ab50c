#!/usr/bin/env bash
# Warm-start tuning for the long-response chain (arithmetic level 8) on the GPU: one `quads pretrain` per
# SFT step count in STEPS_LIST, in parallel, one per visible GPU (round robin when there are more counts
# than GPUs), each measuring held-out greedy pass@1 on EVAL prompts with a 400-token cap at its end and
# after each step of EVAL_AT below its count (PretrainConfig.eval_at: the same evaluation, in one run; a
# step-s model of a longer run is mid-schedule, its learning rate not yet decayed, so the count chosen from
# it is then trained as such, e.g. by scripts/gpu_collapse.sh). The SFT computes in COMPUTE_DTYPE (auto:
# BF16 over FP32 master weights on CUDA, the experts' grouped-GEMM path). Pick the count whose pass@1 is in
# 30-60% and set it as warm_start.steps in configs/chain_100m*.yaml; `quads train` then finds that warm
# start in WARM_DIR (same config hash: the evaluation settings are not hashed; warm_start.compute_dtype
# must match COMPUTE_DTYPE).
# Run from the repository root:  OUT=runs/chain-ws STEPS_LIST=600 EVAL_AT=100,200,300,400,500 bash scripts/chain_warm_start.sh
# Knobs (env): OUT (runs/chain-ws), WARM_DIR (warm-start cache, default $OUT/warm_start; a folder outside
#   $OUT keeps the weights for later calls on the same machine), STEPS_LIST (600), EVAL_AT
#   (100,200,300,400,500; empty: only the final evaluation), COMPUTE_DTYPE (auto), PRESET (100m),
#   LR (0.001), BATCH (32), EVAL (200), DEVICE (cuda), PY (python3), JOBS_PER_GPU (1: SFT runs sharing one GPU at
#   a time; a 100m model leaves an H200 mostly idle, so 3 fit), PROBE_RECIPES (none: after the sweep, e.g.
#   bf16,nvfp4,quads run PROBE_STEPS (3) GRPO steps each, in parallel, from the largest count's warm start with
#   configs/chain_100m.yaml, to time a long-response RL step; $OUT/probe/<recipe>/metrics.jsonl), OUTLIERS (0; 1: also inject the outlier
#   channels CHANNELS (default 37,150,301,444: configs/chain_100m_outliers.yaml's, for the 100m preset's
#   hidden size 512) into the largest count's warm start and record the check).
# Output: $OUT/chain_warm_start.jsonl (one `quads pretrain` JSON line per run: heldout_pass@1,
#   heldout_by_step, train_seconds, final_ce ...), $OUT/pretrain_<steps>.log.
set -uo pipefail
OUT=${OUT:-runs/chain-ws}
WARM_DIR=${WARM_DIR:-$OUT/warm_start}
STEPS_LIST=${STEPS_LIST:-600}
EVAL_AT=${EVAL_AT-100,200,300,400,500}
COMPUTE_DTYPE=${COMPUTE_DTYPE:-auto}
PRESET=${PRESET:-100m}
LR=${LR:-0.001}
BATCH=${BATCH:-32}
EVAL=${EVAL:-200}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
# the GPUs this script may use: CUDA_VISIBLE_DEVICES's entries when it is set (a caller keeping other GPUs
# free), else 0..NGPU-1
IFS=, read -r -a GPUS <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( NGPU > 0 ? NGPU - 1 : 0 )))}"
common=(--task arithmetic --difficulty 8 --preset "$PRESET" --lr "$LR" --batch-size "$BATCH" --eval-size "$EVAL"
        --max-new-tokens 400 --device "$DEVICE" --cache-dir "$WARM_DIR" --progress false --compute-dtype "$COMPUTE_DTYPE")
pids=()
i=0
for steps in ${STEPS_LIST//,/ }; do
  gpu=${GPUS[$(( NGPU > 0 ? i % NGPU : 0 ))]}
  at=$(echo "${EVAL_AT//,/ }" | tr ' ' '\n' | awk -v s="$steps" 'NF && $1 < s' | paste -sd, -)  # EVAL_AT below this count
  CUDA_VISIBLE_DEVICES=$gpu $PY -m quads.cli pretrain "${common[@]}" --steps "$steps" ${at:+--eval-at "$at"} \
    > "$OUT/pretrain_$steps.log" 2>&1 &
  pids+=($!)
  i=$(( i + 1 ))
  SLOTS=$(( (NGPU > 0 ? NGPU : 1) * ${JOBS_PER_GPU:-1} ))
  if [ $(( i % SLOTS )) -eq 0 ]; then wait "${pids[@]}"; pids=(); fi
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
if [ "${OUTLIERS:-0}" = 1 ]; then
  last=${STEPS_LIST##*,}
  $PY -m quads.cli pretrain "${common[@]}" --steps "$last" --outliers.mode inject \
    --outliers.channels "${CHANNELS:-37,150,301,444}" --outliers.scale 32 > "$OUT/pretrain_${last}_outliers.log" 2>&1
fi
grep -h '^{"metric": "pretrain"' "$OUT"/pretrain_*.log > "$OUT/chain_warm_start.jsonl"
$PY - "$OUT/chain_warm_start.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    o = r.get("outliers", {})
    tag = f" outliers {o['channels']} x{o['scale']:g}" if o.get("mode", "none") != "none" else ""
    print(f"steps {r['steps']:>5}{tag}: held-out pass@1 {r.get('heldout_pass@1')}, final ce {r['final_ce']:.4f}, "
          f"{r['train_seconds']} s SFT, mean response {r.get('heldout_mean_response_chars')} chars")
    for e in (e for e in r.get("heldout_by_step", []) if e["step"] < r["steps"]):  # the final one is printed above
        print(f"  at step {e['step']:>5}: held-out pass@1 {e['heldout_pass@1']}, {e.get('train_seconds')} s SFT so far, "
              f"mean response {e['heldout_mean_response_chars']} chars")
PYEOF
if [ -n "${PROBE_RECIPES:-}" ]; then
  last=${STEPS_LIST##*,}
  pids=()
  for r in ${PROBE_RECIPES//,/ }; do
    $PY -m quads.cli train --config configs/chain_100m.yaml --recipe.name "$r" --steps "${PROBE_STEPS:-3}" --eval-every 0 \
      --model.preset "$PRESET" --warm-start.steps "$last" --warm-start.lr "$LR" --warm-start.batch-size "$BATCH" \
      --warm-start.cache-dir "$WARM_DIR" --warm-start.compute-dtype "$COMPUTE_DTYPE" --device "$DEVICE" --out-dir "$OUT/probe/$r" > "$OUT/probe_$r.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  for r in ${PROBE_RECIPES//,/ }; do
    $PY - "$OUT/probe/$r/metrics.jsonl" "$r" <<'PYEOF'
import json, sys
try:
    recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError as e:
    print(f"probe {sys.argv[2]}: no metrics ({e})"); raise SystemExit
for r in recs:
    if "time/step_s" in r:
        print(f"probe {sys.argv[2]} step {r.get('step')}: {r['time/step_s']:.2f} s/step, "
              f"rollout {r.get('time/rollout_s', float('nan')):.2f} s, mean response {r.get('response/mean_len', r.get('rollout/mean_response_len'))}, "
              f"reward {r.get('reward/mean')}")
PYEOF
  done
fi
