#!/usr/bin/env bash
# One device call for the compiled decode step (issue 17): the GPU engine tests for compile, then the
# e2e rollout benchmark with the step compiled and not, graphs on, on the 1b and 100m presets, and a
# profile of the compiled step. Run from the repo root on the GPU machine: bash scripts/gpu_compile.sh
# Writes $OUT/{env.txt,tests.log,e2e.log,e2e_1b.json,e2e_100m.json,profile.log,profile.json}.
set -u -o pipefail
OUT=${OUT:-/tmp/quads_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  git log -1 --format='commit %H %s' 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
part() { echo "== $1 rc=$2 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"; }
timeout ${TEST_TIMEOUT:-120} python3 -m pytest tests/test_engine_gpu.py -q -rfE -p no:cacheprovider \
  ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.log" 2>&1
part tests $?
timeout ${E2E_1B_TIMEOUT:-270} python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 \
  --new-tokens 64 --long-tokens 512 --long-recipes bf16 --graphs on --compile off,on \
  --recipes ${RECIPES:-bf16,w4a16,w4a4+rac50} --json "$OUT/e2e_1b.json" > "$OUT/e2e.log" 2>&1
part e2e_1b $?
timeout ${E2E_100M_TIMEOUT:-120} python3 benchmarks/bench_e2e.py --suites rollout --preset 100m --reps 3 \
  --new-tokens 64 --long-tokens 0 --graphs on --compile off,on --recipes ${RECIPES100:-bf16,w4a4+rac50} \
  --json "$OUT/e2e_100m.json" >> "$OUT/e2e.log" 2>&1
part e2e_100m $?
timeout ${PROFILE_TIMEOUT:-60} python3 benchmarks/bench_e2e.py --suites profile --preset 1b --compile on \
  --profile-recipes bf16 --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1
part profile $?
tail -5 "$OUT/tests.log"
grep -E '^rollout|ERROR' "$OUT/e2e.log" | tail -60
