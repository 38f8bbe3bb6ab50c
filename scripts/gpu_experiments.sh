#!/usr/bin/env bash
# The GPU experiment of docs/RESULTS.md in one call, on one or more CUDA GPUs of one host (H200s here):
#   1. warm start the PRESET model on TASK at LEVEL (SFT, cached under WARM_DIR);
#   2. quads diagnose on that checkpoint (the decomposition and the RAC-ratio table), in the background
#      on GPU 0 while steps 3-4 run;
#   3. a probe: the recipes for 2 steps in parallel, to measure the wall time of a step;
#   4. quads compare: the recipes (x seeds) in parallel processes, spread over the visible GPUs
#      (quads compare --gpus auto), steps sized from the probe so that everything ends before BUDGET_S
#      seconds after the start. SEEDS=auto runs seeds 0,1 when the probe says that two seeds still
#      get MIN_STEPS steps, else seed 0.
# Raw metrics (metrics.jsonl), reports and plots come back in $OUT/results.tar.gz.
# Run from the repository root: PYTHONPATH=. bash scripts/gpu_experiments.sh
#
# Runs longer than one device call (<= 10 minutes each): give STEPS (the whole run's length) and SEEDS;
# every run stops at its time limit (train.time_limit_s) with a checkpoint, and the call packs the warm
# start and the run folders (latest checkpoint, metrics, configs) into $OUT/state.tar.part-NN (15 MiB
# parts). Put those parts in a folder of the repository that travels with the next call (carry it) and call
# again with STATE_DIR=<that folder> and the same knobs: the state is unpacked into WORK, the warm start is
# reused, and quads compare continues every unfinished run from its checkpoint (exact resume) and skips the
# finished ones. Size: a checkpoint holds ~12 bytes per parameter (fp32 master weights + AdamW; ~6 with
# EXTRA_SET=model.master_dtype=bfloat16), 21.7 MB per run of the tiny preset, ~7 MB gzipped; the device
# returns at most 8 files of 16 MiB, 64 MiB in all, so only small models and few runs per call fit (the
# script warns when not). The warm start is packed when WARM_DIR is inside WORK (the default).
#
# Knobs (env): OUT, BUDGET_S (default 540), TASK (arithmetic), LEVEL (4: the task difficulty), PRESET (100m: the
#   model preset), MAX_NEW_TOKENS (48), DEVICE (cuda), PY (python3), DIAG_PROMPTS (64), CKPT (skip the warm
#   start: use this checkpoint), SFT_STEPS (400), MAX_STEPS (400), MIN_STEPS (200), SEEDS (auto, or e.g. 0 / 0,1),
#   STEPS (skip the probe: run this many steps), EVAL_EVERY,
#   RECIPES (default all six; fewer recipes per call = fewer runs per GPU = more steps: docs/RESULTS.md's
#   main GPU run is three calls of two or three recipes each, STEPS=400, one WARM_DIR, then
#   `quads compare --report-only true` over the union of the run folders), DIAG (1: run diagnose),
#   E2E (1: quads bench e2e on the last GPU when there are two), EXTRA_SET (more TrainConfig overrides,
#   "k=v,k=v"; e.g. a CPU dry run: PRESET=tiny DEVICE=cpu SFT_STEPS=2 EXTRA_SET=rollout.n_samples=2; numerics
#   knobs are TrainConfig fields, set here), WORK (runs/gpu-work: the warm start, the compare and its run
#   folders; a path relative to the repository root, the same in every call, as the runs' configs name it),
#   WARM_DIR (the warm start's cache folder, default $WORK/warm_start), CHECK (1: check the batched expert
#   path against the loop on this GPU first; 0 skips, e.g. when an earlier call did), STATE_DIR (continue the
#   runs of an earlier call, see above; DIAG, E2E and CHECK then default to 0), KEEP_STATE (1: pack the state
#   parts into $OUT; 0: only the results tarball), COMPUTE_DTYPE (auto: the warm start's SFT computes in BF16
#   over FP32 weights on CUDA, PretrainConfig.compute_dtype; a state packed before that field existed holds a
#   float32-compute warm start: continue it with COMPUTE_DTYPE=float32, the same cache entry).
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-runs/gpu}
BUDGET_S=${BUDGET_S:-540}
TASK=${TASK:-arithmetic}
LEVEL=${LEVEL:-4}
PRESET=${PRESET:-100m}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-48}
WORK=${WORK:-runs/gpu-work}
STATE_DIR=${STATE_DIR:-}
if [ -n "$STATE_DIR" ]; then  # continuing earlier runs: the same plan, no side jobs unless asked
  [ -n "${STEPS:-}" ] && [ "${SEEDS:-auto}" != auto ] || { echo "STATE_DIR needs STEPS and SEEDS (those of the runs it continues)"; exit 2; }
  DIAG=${DIAG:-0}; E2E=${E2E:-0}; CHECK=${CHECK:-0}
fi
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
SFT_STEPS=${SFT_STEPS:-400}
MAX_STEPS=${MAX_STEPS:-400}
SEEDS=${SEEDS:-auto}
MIN_STEPS=${MIN_STEPS:-200}
RECIPES=${RECIPES:-bf16,fp8,nvfp4,w4a16-qat,w4a4-qat,quads}
NREC=$(echo "$RECIPES" | tr ',' '\n' | wc -l)
EXTRA_SET=${EXTRA_SET:-}
WARM_DIR=${WARM_DIR:-$WORK/warm_start}
SET_COMMON="device=$DEVICE,task.name=$TASK,task.difficulty=$LEVEL,rollout.max_new_tokens=$MAX_NEW_TOKENS${EXTRA_SET:+,$EXTRA_SET}"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT" "$WORK"
if [ -n "$STATE_DIR" ]; then
  ls "$STATE_DIR"/state.tar.part-* > /dev/null || { echo "STATE_DIR=$STATE_DIR holds no state.tar.part-* files"; exit 2; }
  cat "$STATE_DIR"/state.tar.part-* | tar -xz -C "$WORK" && echo "continuing: unpacked $(du -sh "$WORK" | cut -f1) of state into $WORK"
fi
elapsed() { echo $(( $(date +%s) - T0 )); }
{
  echo "date: $(date -u)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
} | tee "$OUT/env.txt"

# the rollout's batched expert path (quads.quant.grouped) must match the experts loop on this GPU; if it
# does not, the runs fall back to the loop (slower) rather than produce wrong numbers (checked in the
# background while the warm start trains; the verdict is read before the first RL run)
CHECK_PID=
if [ "$DEVICE" = cuda ] && [ "${CHECK:-1}" = 1 ]; then
  $PY -m pytest tests/test_quant_grouped.py -q -k cuda -p no:cacheprovider > "$OUT/grouped_check.log" 2>&1 &
  CHECK_PID=$!
fi
# quads bench e2e (rollout tok/s per precision, QAT trainer step vs BF16) on the last GPU while the warm
# start trains on the first (E2E=0 skips; only with two or more GPUs, so the two do not share one)
NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
E2E_PID=
if [ "${E2E:-1}" = 1 ] && [ "$NGPU" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=$((NGPU - 1)) $PY benchmarks/bench_e2e.py --reps 3 --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1 &
  E2E_PID=$!
fi
if [ -z "${CKPT:-}" ]; then
  echo "== 1. warm start ($PRESET on $TASK level $LEVEL, $SFT_STEPS SFT steps; reused when cached) at $(elapsed)s"
  $PY -m quads.cli pretrain --preset "$PRESET" --task "$TASK" --difficulty "$LEVEL" --steps "$SFT_STEPS" --batch-size 64 --lr 1e-3 \
    --max-new-tokens "$MAX_NEW_TOKENS" --device "$DEVICE" --cache-dir "$WARM_DIR" --progress false --eval-size 200 \
    --compute-dtype "${COMPUTE_DTYPE:-auto}" 2>&1 | tail -3 | tee -a "$WORK/pretrain.txt"
  CKPT=$(sed -n 's/^\(trained\|cached\) checkpoint: //p' "$WORK/pretrain.txt" | tail -1)/  # with the / the runs' configs have
fi
[ -f "$CKPT/config.json" ] || { echo "no warm-start checkpoint at '$CKPT'"; exit 1; }
if [ -n "$CHECK_PID" ]; then
  wait $CHECK_PID || { echo "grouped expert check FAILED: the runs use recipe.expert_path=loop, diagnose is skipped";
                       SET_COMMON="$SET_COMMON,recipe.expert_path=loop"; DIAG=0; }
  tail -1 "$OUT/grouped_check.log"
fi

DIAG_PID=
if [ "${DIAG:-1}" = 1 ]; then
  echo "== 2. diagnose (background) at $(elapsed)s"
  ( CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} $PY -m quads.cli diagnose --checkpoint "$CKPT" --device "$DEVICE" --task "$TASK" --difficulty "$LEVEL" \
    --prompts "${DIAG_PROMPTS:-64}" --n-samples 4 --max-new-tokens "$MAX_NEW_TOKENS" --out-dir "$OUT/diagnose" > "$OUT/diagnose.log" 2>&1 \
    || echo "diagnose failed (see diagnose.log)" ) &
  DIAG_PID=$!
fi

[ -n "$E2E_PID" ] && { wait $E2E_PID; grep -v '^{' "$OUT/e2e.log" | tail -8; }
if [ -n "${STEPS:-}" ]; then
  [ "$SEEDS" = auto ] && SEEDS=0
  echo "steps $STEPS and seeds $SEEDS as given (no probe)" | tee "$OUT/plan.txt"
else
  echo "== 3. probe: the recipes ($RECIPES) x 2 steps in parallel at $(elapsed)s"
  P0=$(date +%s)
  $PY -m quads.cli compare --train-config configs/experiments/gpu.yaml --set "$SET_COMMON,model.checkpoint=$CKPT,steps=2,eval_every=0,eval_n=32" \
    --recipes "$RECIPES" --seeds 0 --parallel "$NREC" --out-dir "$OUT/probe" > "$OUT/probe.log" 2>&1
  P1=$(date +%s)
  # the slowest run's second step (the first one compiles kernels)
  STEP_S=$($PY - "$OUT/probe" <<'PY'
import json, sys, pathlib
ts = []
for f in pathlib.Path(sys.argv[1]).glob("runs/*/metrics.jsonl"):
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    steps = [r["time/step_s"] for r in recs if "time/step_s" in r]
    ts += steps[-1:]
print(max(ts) if ts else 5.0)
PY
)
  LEFT=$(( BUDGET_S - $(elapsed) - (P1 - P0) / 2 - 30 ))  # startup + evals ~ half the probe, 30 s margin for reports
  STEPS=$($PY -c "print(max(10, min($MAX_STEPS, int(0.85 * $LEFT / max($STEP_S, 1e-3)))))")
  if [ "$SEEDS" = auto ]; then  # twice the runs: assume a step 1.8x slower (shared GPUs and cores)
    STEPS2=$($PY -c "print(min($MAX_STEPS, int(0.85 * $LEFT / max(1.8 * $STEP_S, 1e-3))))")
    if [ "$STEPS2" -ge "$MIN_STEPS" ]; then SEEDS=0,1; STEPS=$STEPS2; else SEEDS=0; fi
  fi
  echo "probe: $((P1 - P0))s, slowest parallel step ${STEP_S}s; ${LEFT}s left -> seeds $SEEDS, $STEPS steps" | tee "$OUT/plan.txt"
fi
NRUNS=$(( NREC * $(echo "$SEEDS" | tr ',' '\n' | wc -l) ))

# every run also stops at a time limit (held-out eval, checkpoint and policy first: train.time_limit_s),
# so a recipe slower than planned ends with fewer steps instead of being killed
TLIMIT=$(( BUDGET_S - $(elapsed) - 45 ))
echo "== 4. compare ($STEPS steps, time limit ${TLIMIT}s per run) at $(elapsed)s" | tee -a "$OUT/plan.txt"
EVAL_EVERY=${EVAL_EVERY:-$(( STEPS / 4 > 5 ? STEPS / 4 : 5 ))}  # held-out evals cost about a step each: keep them few
$PY -m quads.cli compare --train-config configs/experiments/gpu.yaml --recipes "$RECIPES" \
  --set "$SET_COMMON,model.checkpoint=$CKPT,steps=$STEPS,eval_every=$EVAL_EVERY,time_limit_s=$TLIMIT" --seeds "$SEEDS" \
  --parallel "$NRUNS" --timeout-s $(( BUDGET_S - $(elapsed) - 10 )) --out-dir "$WORK/compare" 2>&1 | tail -15
[ -n "$DIAG_PID" ] && { wait $DIAG_PID; tail -25 "$OUT/diagnose.log"; }
echo "== done at $(elapsed)s"
# what comes back (at most 8 files of 16 MiB): the results tarball (metrics, configs, logs, reports, plots: no
# weights) and, with KEEP_STATE=1, the state to continue from: the warm start and every run folder with its
# latest checkpoint only, in 15 MiB parts
cp -r "$WORK/compare" "$OUT/compare"; cp "$WORK/pretrain.txt" "$OUT/" 2>/dev/null
rm -rf "$OUT"/warm_start/*/model.safetensors "$OUT"/*/runs/*/checkpoints "$OUT"/*/runs/*/policy "$OUT"/*/runs/*/tb
TARBALL=$(mktemp --suffix=.tar.gz)  # packed outside $OUT (tar must not read the folder it writes into)
tar -czf "$TARBALL" -C "$OUT" --exclude=results.tar.gz . && mv "$TARBALL" "$OUT/results.tar.gz" && du -sh "$OUT/results.tar.gz"
find "$OUT" -mindepth 1 -maxdepth 1 ! -name results.tar.gz -exec rm -rf {} +  # packed: only the tarball (+ state) comes back
if [ "${KEEP_STATE:-1}" = 1 ]; then
  LIST=$(mktemp)
  ( cd "$WORK" && find "${WARM_DIR#"$WORK"/}" compare \( -name tb -o -name policy -o -name checkpoints \) -prune \
      -o -type f -print 2>/dev/null ) > "$LIST"
  for run in "$WORK"/compare/runs/*/; do  # only the latest checkpoint of each run (what compare resumes from)
    latest=$(cat "$run/checkpoints/latest" 2>/dev/null) || continue
    rel=${run#"$WORK"/}
    ( cd "$WORK" && find "${rel}checkpoints/$latest" -type f && echo "${rel}checkpoints/latest" ) >> "$LIST"
  done
  RAW=$( (cd "$WORK" && tr '\n' '\0' < "$LIST" | du -cb --files0-from=- | tail -1 | cut -f1) )
  if [ "$RAW" -gt $((1024 * 1024 * 1024)) ]; then  # would not come back anyway (64 MiB): spare the gzip time
    echo "state not packed: $((RAW / 1048576)) MiB of checkpoints, far above the 64 MiB a device call returns (smaller PRESET or fewer runs)"
  else
    STAGE=$(mktemp -d)  # packed outside $OUT: only a state that fits comes into $OUT, so results.tar.gz always comes back
    tar -c -C "$WORK" -T "$LIST" | gzip -1 | split -b 15M -d - "$STAGE/state.tar.part-"
    NPARTS=$(ls "$STAGE"/state.tar.part-* | wc -l)
    if [ "$NPARTS" -le 7 ]; then
      mv "$STAGE"/state.tar.part-* "$OUT/"
      echo "state to continue from: $NPARTS part(s), $(du -ch "$OUT"/state.tar.part-* | tail -1 | cut -f1) (next call: STATE_DIR=<folder with them>)"
    else
      echo "state not kept: $NPARTS parts of 15 MiB, but a device call returns 8 files at most (results.tar.gz is one); fewer runs per call, a smaller PRESET or model.master_dtype=bfloat16"
    fi
    rm -rf "$STAGE"
  fi
fi
