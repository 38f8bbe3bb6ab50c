#!/usr/bin/env bash
# One device call for the rollout engine (issue 17): GPU engine tests, the e2e rollout benchmark on
# the 100m and 1b presets (every recipe, CUDA graphs on and off, 64 new tokens + one 512-token row),
# and a torch.profiler summary of the decode step. About 8 minutes in all; each part has its own
# time limit and writes its results as it goes, so a part that runs out still leaves its rows.
# Run from the repo root on the GPU machine (image python3, no venv):  bash scripts/gpu_engine.sh
# Writes $OUT/{env.txt,tests.log,e2e.log,e2e_100m.json,e2e_1b.json,profile.log,profile.json}.
# Knobs: TEST_TIMEOUT, E2E_100M_TIMEOUT, E2E_1B_TIMEOUT, PROFILE_TIMEOUT, REPS, TEST_K (pytest -k).
set -u -o pipefail
OUT=${OUT:-/tmp/quads_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  git log -1 --format='commit %H %s' 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
part() { echo "== $1 rc=$2 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"; }

# (1) engine tests: the GPU ones (graph vs no graph, weight sync into the graph, no host sync in a
# step) and the CPU-side static path tests on this machine's torch
timeout ${TEST_TIMEOUT:-170} python3 -m pytest tests/test_engine_gpu.py tests/test_engine_static.py -q -rfE \
  -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.log" 2>&1
part tests $?

# (2) e2e rollout benchmark: 16 prompts x 8 samples; 100m also times the eager reference path
REPS=${REPS:-3}
timeout ${E2E_100M_TIMEOUT:-110} python3 benchmarks/bench_e2e.py --suites rollout --preset 100m --reps "$REPS" \
  --new-tokens 64 --long-tokens 512 --decodes auto,eager --graphs on,off --json "$OUT/e2e_100m.json" \
  > "$OUT/e2e.log" 2>&1
part e2e_100m $?
timeout ${E2E_1B_TIMEOUT:-170} python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps "$REPS" \
  --new-tokens 64 --long-tokens 512 --decodes auto --graphs on,off --json "$OUT/e2e_1b.json" \
  >> "$OUT/e2e.log" 2>&1
part e2e_1b $?

# (3) profile of the decode step: kernels, launches and host syncs per step, graphs on and off
timeout ${PROFILE_TIMEOUT:-70} python3 benchmarks/bench_e2e.py --suites profile --preset 100m,1b \
  --profile-recipes bf16,w4a4+rac50 --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1
part profile $?

tail -5 "$OUT/tests.log"
grep -E '^rollout|ERROR' "$OUT/e2e.log" | tail -60
grep -c '^profile' "$OUT/profile.log"
