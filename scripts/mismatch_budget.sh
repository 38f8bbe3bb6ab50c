#!/usr/bin/env bash
# The mismatch-budget dose-response (issue 19 item 6): quads compare once per alpha, where alpha scales the
# rollout's quantization error in every quantized GEMM (recipe.rollout_error_scale: operands x + alpha (Q(x) - x)).
# BF16 runs once (alpha = 1): it quantizes nothing, so alpha does not change it. A summary table over every
# (alpha, recipe) lands in $OUT/summary.md and one JSON line per (alpha, recipe, seed) in $OUT/summary.jsonl
# (scripts/mismatch_budget_summary.py; with eval_trainer the trainer's own policy's held-out pass@1 too).
# Run from the repository root:  nice bash scripts/mismatch_budget.sh
# Knobs (env): OUT (results/mismatch_budget), CONFIG (configs/experiments/mismatch_budget.yaml), ALPHAS (1,4,8,16),
#   RECIPES (nvfp4,quads: the amplified ones), SEEDS (0,1), PARALLEL (1), PY (.venv/bin/python), EXTRA_SET (more
#   TrainConfig overrides "k=v,k=v"), CLEAN (1: drop checkpoints and policies at the end, as results/ is committed;
#   0 keeps them, so that a second call reuses finished runs and resumes unfinished ones, quads compare).
set -euo pipefail
OUT=${OUT:-results/mismatch_budget}
CONFIG=${CONFIG:-configs/experiments/mismatch_budget.yaml}
ALPHAS=${ALPHAS:-1,4,8,16}
RECIPES=${RECIPES:-nvfp4,quads}
SEEDS=${SEEDS:-0,1}
PARALLEL=${PARALLEL:-1}
PY=${PY:-.venv/bin/python}
EXTRA_SET=${EXTRA_SET:-}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
for a in ${ALPHAS//,/ }; do
  recipes=$RECIPES
  [ "$a" = 1 ] && recipes="bf16,$RECIPES"
  echo "== alpha $a: $recipes x seeds $SEEDS at $(date -u +%H:%M:%S)"
  $PY -m quads.cli compare --train-config "$CONFIG" --recipes "$recipes" --seeds "$SEEDS" --parallel "$PARALLEL" \
    --set "recipe.rollout_error_scale=$a${EXTRA_SET:+,$EXTRA_SET}" --out-dir "$OUT/alpha$a"
done
$PY scripts/mismatch_budget_summary.py "$OUT" "$ALPHAS"  # summary.md / summary.jsonl (the trainer's policy when logged)
# results/ is committed: keep metrics (gzipped), configs, logs and the sweep's reports; drop weights (checkpoints,
# policies: ~30 MB a run) and the per-run reports (`quads report <run>` rebuilds one from its metrics)
if [ "${CLEAN:-1}" = 1 ]; then
  rm -rf "$OUT"/alpha*/runs/*/checkpoints "$OUT"/alpha*/runs/*/policy "$OUT"/alpha*/runs/*/tb "$OUT"/alpha*/runs/*/report
  for f in "$OUT"/alpha*/runs/*/metrics.jsonl; do [ -f "$f" ] && gzip -n -9 -f "$f"; done
fi
