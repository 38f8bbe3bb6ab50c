#!/usr/bin/env bash
# One device call for the rollout engine (issue 17): GPU engine tests, the e2e rollout benchmark (the
# engine's default: static decode, compiled step, CUDA graphs; --compile on,off compares) on
# the 1b and 100m presets (every recipe with CUDA graphs, bf16 and w4a4+rac50 also without graphs and
# on the eager reference path; 64 new tokens + 512-token rows), and a torch.profiler summary of the
# decode step. About 7.5 minutes in all; each part has its own time limit and writes its results as
# it goes, so a part that runs out still leaves its rows.
# Run from the repo root on the GPU machine (image python3, no venv):  bash scripts/gpu_engine.sh
# Writes $OUT/{env.txt,tests.log,e2e.log,e2e_1b.json,e2e_100m.json,e2e_off.json,profile.log,profile.json}.
# Knobs: TEST_TIMEOUT, E2E_1B_TIMEOUT, E2E_100M_TIMEOUT, E2E_OFF_TIMEOUT, PROFILE_TIMEOUT, REPS, TEST_K.
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
timeout ${TEST_TIMEOUT:-100} python3 -m pytest tests/test_engine_gpu.py tests/test_engine_static.py -q -rfE \
  -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.log" 2>&1
part tests $?

# (2) e2e rollout benchmark, 16 prompts x 8 samples, 64 new tokens, the engine's default path (static
# decode, CUDA graphs): every recipe on 1b (+ a 512-token bf16 row), then on 100m (+ 512-token rows)
REPS=${REPS:-3}
timeout ${E2E_1B_TIMEOUT:-120} python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 \
  --new-tokens 64 --long-tokens 512 --long-recipes bf16 --graphs on --json "$OUT/e2e_1b.json" > "$OUT/e2e.log" 2>&1
part e2e_1b $?
timeout ${E2E_100M_TIMEOUT:-80} python3 benchmarks/bench_e2e.py --suites rollout --preset 100m --reps "$REPS" \
  --new-tokens 64 --long-tokens 512 --long-recipes bf16,w4a4+rac50 --graphs on --json "$OUT/e2e_100m.json" \
  >> "$OUT/e2e.log" 2>&1
part e2e_100m $?
# graphs off and the eager reference path, for bf16 and w4a4+rac50 on both presets
timeout ${E2E_OFF_TIMEOUT:-90} python3 benchmarks/bench_e2e.py --suites rollout --preset 100m,1b --reps 2 \
  --recipes bf16,w4a4+rac50 --new-tokens 64 --long-tokens 0 --decodes auto,eager --graphs off \
  --json "$OUT/e2e_off.json" >> "$OUT/e2e.log" 2>&1
part e2e_off $?

# (3) profile of the decode step (per-step kernels, launches, host syncs; graphs on and off), 100m
timeout ${PROFILE_TIMEOUT:-50} python3 benchmarks/bench_e2e.py --suites profile --preset 100m \
  --profile-recipes bf16,w4a4+rac50 --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1
part profile $?

tail -5 "$OUT/tests.log"
grep -E '^rollout|ERROR' "$OUT/e2e.log" | tail -60
grep -c '^profile' "$OUT/profile.log"
