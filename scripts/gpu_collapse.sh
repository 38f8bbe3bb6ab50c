#!/usr/bin/env bash
# The collapse experiment of issue 19 in ONE self-contained device call (checkpoints of the 100m preset
# cannot be carried between calls): on one GPU,
#   1. warm start: `quads pretrain` of the PRESET model on the chain task (CONFIG's level and response cap:
#      arithmetic level 8, 400 tokens in configs/chain_100m.yaml), SFT_STEPS steps with the BF16 compute
#      path (PretrainConfig.compute_dtype auto: BF16 autocast over FP32 master weights on CUDA, the experts'
#      grouped GEMMs), its held-out greedy pass@1 on SFT_EVAL prompts (and at the EVAL_AT steps, if given)
#      in $OUT/pretrain.log; when it leaves under 30 s of runs before BUDGET_S (the long chain's SFT,
#      configs/chain_100m_long.yaml, may), no runs are started: the warm start is cached in WARM_DIR, and a
#      CONTINUE=1 call on the same machine starts from it (an SFT cut by the call's end is lost);
#   2. quads compare: RECIPES x SEEDS (bf16,nvfp4,quads x 0,1: 6 runs), x the VARIANTS (or LRS) when given,
#      all in parallel, spread over the visible GPUs, from that checkpoint, with CONFIG's settings
#      (configs/chain_100m.yaml: 16 prompts x 8 samples, 400 new tokens, lr 5e-6, temperature 1, 200 held-out
#      prompts of the fixed task.eval_seed 0); every run stops at train.time_limit_s (sized so that all end
#      before BUDGET_S seconds after the script's start) after a held-out eval, with its per-step metrics;
#   3. $OUT/results.tar.gz: per run metrics.jsonl, config.yaml and log, the compare report, the pretrain
#      log and the plan (no weights: at most 64 MiB come back from a call).
# The runs use the paper's naive setting, explicitly: correction.kind=$CORRECTION (default none: no
# importance-sampling correction of the rollout/trainer mismatch) and optim.mini_batches=$MINI_BATCHES
# (default 2: two optimizer steps per batch, so the second one is off-policy and PPO's ratio clip acts),
# optim.ppo_epochs 1, the same for every recipe. STEPS is only a cap: the time limit decides how many
# steps a run gets (not measured yet on the GPU; summary.txt in the tarball gives each run's steps, median
# seconds per step and held-out pass@1 by step, plan.txt what was given).
# Run from the repository root:  PYTHONPATH=. bash scripts/gpu_collapse.sh
# BF16 learning-rate sweep (SFT + 4 lrs x 2 seeds in one call, on 2 GPUs; runs bf16-lr2e-6-s0 ...):
#   PYTHONPATH=. RECIPES=bf16 LRS=2e-6,5e-6,1e-5,2e-5 SEEDS=0,1 bash scripts/gpu_collapse.sh
# CPU dry run (minutes):  PRESET=tiny DEVICE=cpu SFT_STEPS=4 SFT_EVAL=4 BUDGET_S=300 SEEDS=0 STEPS=2 \
#   EVAL_N=4 EXTRA_SET=rollout.n_samples=2,rollout.prompts_per_step=2,rollout.max_new_tokens=16 bash scripts/gpu_collapse.sh
#   (add RECIPES=bf16 LRS=1e-5,2e-5 for the sweep's)
#
# Knobs (env): OUT (runs/collapse), BUDGET_S (560: seconds from the start by which every run has stopped;
#   a device call allows 600), CONFIG (configs/chain_100m.yaml; its warm_start.outliers, if any, go to the SFT: configs/chain_100m_outliers.yaml), TASK (arithmetic),
#   LEVEL (CONFIG's task.difficulty, else 8), MAX_NEW_TOKENS (CONFIG's rollout.max_new_tokens, else 400: the SFT's
#   evaluation cap and the runs'), MAX_SEQ_LEN (CONFIG's warm_start.max_seq_len: the SFT model's context instead of
#   the preset's, configs/chain_100m_long.yaml; empty = the preset's), PRESET (100m), SFT_STEPS, SFT_LR, SFT_BATCH, SFT_TRAIN_SIZE (default: CONFIG's
#   warm_start.steps / lr / batch_size / train_size), SFT_EVAL (200, with a target CONFIG's warm_start.eval_size: held-out prompts of the SFT's pass@1),
#   EVAL_AT (empty: SFT steps at which pass@1 is also measured, e.g. 100,200,300; CONFIG's warm_start.eval_at
#   with a target), TARGET_PASS (CONFIG's warm_start.target_pass: the SFT stops at the first EVAL_AT step whose
#   held-out pass@1 on CONFIG's warm_start.eval_size prompts reaches it; "" = none), COMPUTE_DTYPE (auto),
#   CKPT (skip the SFT: use this checkpoint), PICK (a chain_warm_start.jsonl of scripts/chain_warm_start.sh: skip
#   the SFT and take the swept warm start whose held-out pass@1 is in PICK_LO-PICK_HI (0.3-0.6), nearest the middle), RECIPES (bf16,nvfp4,quads), SEEDS (0,1), STEPS (150: the
#   cap), EVAL_EVERY (10; 0: held-out evals at the start and the end only), EVAL_N (CONFIG's eval_n: held-out prompts of the RL evals),
#   LRS (empty: learning rates to sweep, "2e-6,5e-6": every recipe x lr x seed runs, as the run group <recipe>-lr<lr>),
#   VARIANTS (empty; instead of LRS, any sweep: quads compare --variants, ";" between variants, e.g.
#   "optim.lr=2e-5;optim.lr=2e-5,optim.warmup_steps=20"; "base" = CONFIG's settings alone, and an "r+r:" prefix limits a
#   variant to those recipes: RECIPES=bf16,nvfp4,quads VARIANTS="base;nvfp4:recipe.rollout_error_scale=4" = 4 groups), WARMUP (empty: CONFIG's optim.warmup_steps, linear lr
#   warmup in optimizer steps, for every run),
#   CORRECTION (none), MINI_BATCHES (2), MARGIN_S (45: seconds of BUDGET_S kept out of the runs' train.time_limit_s, a deadline each run meets with its
#   closing held-out eval and checkpoint written, for the runs' start-up before training and the report and packing
#   after; quads compare kills what is still running 10 s before BUDGET_S), EXTRA_SET (more TrainConfig overrides
#   "k=v,k=v"), WORK (runs/collapse-work: warm start and run folders), WARM_DIR ($WORK/warm_start),
#   RUN_GB (20: GPU memory per run; the script refuses more runs than fit 90% of the visible GPUs' memory),
#   DEVICE (cuda), PY (python3), CONTINUE (0; 1: continue the runs of an earlier call on the SAME machine:
#   the device keeps ignored folders such as runs/ while it stays warm, so a call made within its idle window
#   finds WORK as the last one left it; the warm start is found in WARM_DIR's cache (an SFT cut off by the
#   previous call continues from its last EVAL_AT check, quads.pretrain's partial state), and quads compare resumes
#   each unfinished run from the checkpoint its time limit wrote (exact resume, `quads compare --resume`)
#   and skips the finished ones; on a fresh machine it starts over).
set -uo pipefail
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-runs/collapse}
BUDGET_S=${BUDGET_S:-560}
CONFIG=${CONFIG:-configs/chain_100m.yaml}
TASK=${TASK:-arithmetic}
PRESET=${PRESET:-100m}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
WORK=${WORK:-runs/collapse-work}
WARM_DIR=${WARM_DIR:-$WORK/warm_start}
RECIPES=${RECIPES:-bf16,nvfp4,quads}
SEEDS=${SEEDS:-0,1}
STEPS=${STEPS:-150}
EVAL_EVERY=${EVAL_EVERY:-10}
EVAL_N=${EVAL_N:-}
LRS=${LRS:-}
VARIANTS=${VARIANTS:-}
WARMUP=${WARMUP:-}
CORRECTION=${CORRECTION:-none}
MINI_BATCHES=${MINI_BATCHES:-2}
MARGIN_S=${MARGIN_S:-45}
SFT_EVAL=${SFT_EVAL:-}
COMPUTE_DTYPE=${COMPUTE_DTYPE:-auto}
EXTRA_SET=${EXTRA_SET:-}
CONT=$([ "${CONTINUE:-0}" = 1 ] && echo true || echo false)
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
[ -f "$CONFIG" ] || { echo "CONFIG=$CONFIG does not exist; pass a TrainConfig YAML (e.g. configs/chain_100m.yaml)"; exit 2; }
# the SFT settings default to CONFIG's warm_start section (what `quads train --config CONFIG` would warm start)
# (and the task level, response cap and warm_start.max_seq_len it runs with)
read -r WS_STEPS WS_LR WS_BATCH WS_TRAIN WS_TARGET WS_EVAL_AT WS_EVAL_SIZE WS_MAX_SEQ_LEN CFG_LEVEL CFG_MAX_NEW <<< "$($PY -c "
import sys, yaml
c = yaml.safe_load(open(sys.argv[1])) or {}
ws = c.get('warm_start') or {}
print(ws.get('steps', 600), ws.get('lr', 3e-3), ws.get('batch_size', 32), ws.get('train_size', 20000),
      ws.get('target_pass') or '-', ','.join(map(str, ws.get('eval_at') or [])) or '-', ws.get('eval_size', 100),
      ws.get('max_seq_len') or '-', (c.get('task') or {}).get('difficulty') or 8,
      (c.get('rollout') or {}).get('max_new_tokens') or 400)" "$CONFIG")"
# CONFIG's warm_start.outliers (configs/chain_100m_outliers.yaml): the same flags for quads pretrain, so that the
# checkpoint the runs start from carries them (model.checkpoint below bypasses quads train's own warm start)
OUTLIER_FLAGS=$($PY -c "
import sys, yaml
o = ((yaml.safe_load(open(sys.argv[1])) or {}).get('warm_start') or {}).get('outliers') or {}
if o.get('mode', 'none') != 'none':
    print('--outliers.mode', o['mode'], '--outliers.channels', ','.join(map(str, o.get('channels') or [])),
          '--outliers.scale', o.get('scale', 32.0), '--outliers.sites', ','.join(o.get('sites') or ['mlp']))" "$CONFIG")
[ "$WS_TARGET" = - ] && WS_TARGET=
[ "$WS_EVAL_AT" = - ] && WS_EVAL_AT=
[ "$WS_MAX_SEQ_LEN" = - ] && WS_MAX_SEQ_LEN=
LEVEL=${LEVEL:-$CFG_LEVEL}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-$CFG_MAX_NEW}
MAX_SEQ_LEN=${MAX_SEQ_LEN:-$WS_MAX_SEQ_LEN}
TARGET_PASS=${TARGET_PASS-$WS_TARGET}
if [ -n "$TARGET_PASS" ]; then  # the SFT stops at a held-out pass@1: CONFIG's checks, so `quads train` finds it
  EVAL_AT=${EVAL_AT:-$WS_EVAL_AT}
  SFT_EVAL=${SFT_EVAL:-$WS_EVAL_SIZE}
fi
SFT_EVAL=${SFT_EVAL:-200}
SFT_STEPS=${SFT_STEPS:-$WS_STEPS}
SFT_LR=${SFT_LR:-$WS_LR}
SFT_BATCH=${SFT_BATCH:-$WS_BATCH}
SFT_TRAIN_SIZE=${SFT_TRAIN_SIZE:-$WS_TRAIN}
[ -n "$LRS" ] && [ -n "$VARIANTS" ] && { echo "pass LRS or VARIANTS, not both"; exit 2; }
[ -n "$LRS" ] && VARIANTS=$(echo "$LRS" | tr ',' '\n' | sed '/^$/d; s/^/optim.lr=/' | paste -sd';' -)
# runs = (recipe, variant) groups x seeds, as quads compare plans them ("r+r:" variants apply to some recipes only)
NRUNS=$($PY -c "
import sys
from quads.experiments.compare import CompareConfig
c = CompareConfig(recipes=sys.argv[1], seeds=sys.argv[2], variants=sys.argv[3])
print(len(c.groups()) * len(c.seed_list()))" "$RECIPES" "$SEEDS" "$VARIANTS") || { echo "bad RECIPES / SEEDS / VARIANTS"; exit 2; }
# runs that fit the visible GPUs at RUN_GB each (a 100m chain run peaks at ~15-19 GiB: 9 on one 140 GiB H200
# ran out of memory): more runs than that would queue behind the first ones and get no time in this call.
# That was with whole mini-batches; with CONFIG's optim.micro_batch_size 32 a run allocates at most 9.5 GiB
# (perf/max_mem_gib) but the caching allocator holds up to 18.0 GiB (perf/max_reserved_gib; the outlier chain
# runs, results/gpu/collapse/2026-12-02_chain100m_outliers), so RUN_GB stays 20
GPU_GB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | awk '{s += int($1 / 1024)} END {print s + 0}')
if [ "$DEVICE" = cuda ] && [ "${GPU_GB:-0}" -gt 0 ]; then
  FIT=$(( GPU_GB * 9 / 10 / ${RUN_GB:-20} ))
  [ "$NRUNS" -le "$FIT" ] || { echo "$NRUNS runs x ${RUN_GB:-20} GiB do not fit in ${GPU_GB} GiB of GPU memory (at most $FIT): fewer SEEDS or RECIPES per call, or RUN_GB"; exit 2; }
fi
rm -rf "$OUT/stage"
mkdir -p "$OUT/stage" "$WORK"
S=$OUT/stage  # everything that comes back is packed from here into $OUT/results.tar.gz
{
  echo "date: $(date -u)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  $PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
} | tee "$S/env.txt"

if [ -z "${CKPT:-}" ] && [ -n "${PICK:-}" ]; then
  # the warm start of a scripts/chain_warm_start.sh sweep whose held-out pass@1 is in [PICK_LO, PICK_HI],
  # closest to their middle (else the one closest to the band), written to $S/pick.txt
  CKPT=$($PY - "$PICK" "${PICK_LO:-0.3}" "${PICK_HI:-0.6}" <<'PY' | tee "$S/pick.txt" | sed -n 's/^checkpoint: //p'
import json, sys
lo, hi = float(sys.argv[2]), float(sys.argv[3])
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
runs = [r for r in runs if r.get("heldout_pass@1") is not None and r.get("outliers", {}).get("mode", "none") == "none"]
if not runs:
    raise SystemExit("no evaluated warm start in " + sys.argv[1])
dist = lambda p: 0.0 if lo <= p <= hi else min(abs(p - lo), abs(p - hi))
best = min(runs, key=lambda r: (dist(r["heldout_pass@1"]), abs(r["heldout_pass@1"] - (lo + hi) / 2)))
for r in runs:
    print(f"sweep: {r['steps']} SFT steps -> held-out pass@1 {r['heldout_pass@1']}")
print(f"picked: {best['steps']} SFT steps, held-out pass@1 {best['heldout_pass@1']} (band {lo}-{hi})")
print(f"checkpoint: {best['checkpoint']}")
PY
)
  cat "$S/pick.txt"
fi
if [ -z "${CKPT:-}" ]; then
  echo "== 1. warm start: $PRESET${MAX_SEQ_LEN:+ (max_seq_len $MAX_SEQ_LEN)} on $TASK level $LEVEL, $SFT_STEPS SFT steps (lr $SFT_LR, batch $SFT_BATCH, compute $COMPUTE_DTYPE${OUTLIER_FLAGS:+, $OUTLIER_FLAGS}) at $(elapsed)s"
  # cut off 20 s before BUDGET_S so that this call still returns its logs; the SFT's state at its last EVAL_AT
  # check stays in WARM_DIR, and a CONTINUE=1 call on the same machine continues from it
  SFT_LEFT=$(( BUDGET_S - $(elapsed) - 20 )); [ "$SFT_LEFT" -ge 1 ] || SFT_LEFT=1  # timeout 0 would mean none
  timeout "$SFT_LEFT" \
  $PY -m quads.cli pretrain --task "$TASK" --difficulty "$LEVEL" --preset "$PRESET" --steps "$SFT_STEPS" --lr "$SFT_LR" \
    --batch-size "$SFT_BATCH" --train-size "$SFT_TRAIN_SIZE" --max-new-tokens "$MAX_NEW_TOKENS" --eval-size "$SFT_EVAL" \
    --compute-dtype "$COMPUTE_DTYPE" ${EVAL_AT:+--eval-at "$EVAL_AT"} ${TARGET_PASS:+--target-pass "$TARGET_PASS"} $OUTLIER_FLAGS \
    ${MAX_SEQ_LEN:+--max-seq-len "$MAX_SEQ_LEN"} \
    --device "$DEVICE" --cache-dir "$WARM_DIR" \
    --progress false > "$S/pretrain.log" 2>&1
  RC=${PIPESTATUS[0]}
  tail -3 "$S/pretrain.log" | cut -c1-600
  CKPT=$(sed -n 's/^\(trained\|cached\) checkpoint: //p' "$S/pretrain.log" | tail -1)
  if [ "$RC" = 124 ]; then
    echo "the SFT ran into this call's budget (BUDGET_S $BUDGET_S) and was stopped; its state at the last EVAL_AT check is kept in $WARM_DIR: call again with CONTINUE=1 on the same machine" | tee "$S/plan.txt"
    tar -czf "$OUT/results.tar.gz" -C "$S" . && rm -rf "$S" && exit 0
  fi
fi
[ -n "$CKPT" ] && [ -f "$CKPT/config.json" ] || { echo "no warm-start checkpoint at '$CKPT' (see $S/pretrain.log)"; cp -r "$S" "$OUT/failed"; exit 1; }

TLIMIT=$(( BUDGET_S - $(elapsed) - MARGIN_S ))
if [ "$TLIMIT" -lt 30 ]; then  # a warm start that took the call (the long chain's SFT can): no runs now
  echo "only ${TLIMIT}s of RL left after the warm start (BUDGET_S $BUDGET_S, MARGIN_S $MARGIN_S): no runs in this call; the warm start is cached in $WARM_DIR, where a call on the same machine finds it (CONTINUE=1)" | tee "$S/plan.txt"
else
  SET="device=$DEVICE,task.name=$TASK,task.difficulty=$LEVEL,rollout.max_new_tokens=$MAX_NEW_TOKENS,model.checkpoint=$CKPT"
  SET="$SET,steps=$STEPS,eval_every=$EVAL_EVERY${EVAL_N:+,eval_n=$EVAL_N},time_limit_s=$TLIMIT,correction.kind=$CORRECTION"
  SET="$SET,optim.mini_batches=$MINI_BATCHES,optim.ppo_epochs=1${WARMUP:+,optim.warmup_steps=$WARMUP},log.save_every=0${EXTRA_SET:+,$EXTRA_SET}"
  echo "== 2. compare: $RECIPES x seeds $SEEDS${VARIANTS:+ x variants $VARIANTS} ($NRUNS runs in parallel), at most $STEPS steps, time limit ${TLIMIT}s per run, at $(elapsed)s" | tee "$S/plan.txt"
  echo "config $CONFIG; warm start $CKPT; --set $SET${VARIANTS:+; --variants $VARIANTS}" | tee -a "$S/plan.txt"
  $PY -m quads.cli compare --train-config "$CONFIG" --recipes "$RECIPES" --seeds "$SEEDS" --set "$SET" --variants="$VARIANTS" --parallel "$NRUNS" \
    --timeout-s $(( BUDGET_S - $(elapsed) - 10 )) --reuse "$CONT" --resume "$CONT" --out-dir "$WORK/compare" > "$S/compare.log" 2>&1
  echo "compare exit $? at $(elapsed)s"; tail -15 "$S/compare.log"
fi

# per run: metrics.jsonl (every step), config.yaml, the run's log; the compare report (no checkpoints, policies, tb)
for run in "$WORK"/compare/runs/*/; do
  [ -d "$run" ] || continue  # no runs (none in this call)
  name=$(basename "$run")
  mkdir -p "$S/runs/$name"
  find "$run" -maxdepth 1 -type f \( -name '*.jsonl' -o -name '*.yaml' -o -name '*.json' -o -name '*.md' -o -name '*.log' -o -name '*.txt' \) \
    -exec cp {} "$S/runs/$name/" \;
  $PY - "$run/metrics.jsonl" "$name" <<'PY' | tee -a "$S/summary.txt"
import json, sys
try:
    recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError:
    print(f"{sys.argv[2]}: no metrics.jsonl"); raise SystemExit
steps = [r for r in recs if "time/step_s" in r]
evals = [(r["step"], r["eval/pass@1"]) for r in recs if "eval/pass@1" in r]
own = [(r["step"], r["eval/trainer_pass@1"]) for r in recs if "eval/trainer_pass@1" in r]  # eval_trainer
ts = [r["time/step_s"] for r in steps]
print(f"{sys.argv[2]}: {len(steps)} steps, median {sorted(ts)[len(ts) // 2] if ts else float('nan'):.1f} s/step, "
      f"held-out pass@1 by step {evals}" + (f"; the trainer's policy {own}" if own else ""))
PY
done
[ -d "$WORK/compare" ] && find "$WORK/compare" -maxdepth 1 -type f -exec cp {} "$S/" \;
[ -d "$WORK/compare/report" ] && cp -r "$WORK/compare/report" "$S/report"
[ -d "$WORK/compare/logs" ] && cp -r "$WORK/compare/logs" "$S/logs"
echo "== done at $(elapsed)s" | tee -a "$S/plan.txt"
TARBALL=$(mktemp --suffix=.tar.gz)  # packed outside $OUT, then only the tarball is left there
tar -czf "$TARBALL" -C "$S" . && rm -rf "$S" && mv "$TARBALL" "$OUT/results.tar.gz" && du -sh "$OUT/results.tar.gz"
