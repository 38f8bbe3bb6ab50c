#!/usr/bin/env bash
# Issue 18 / 17, next kernel call: Nsight Compute (2026-12-03, docs/PERF.md) found the grouped W4A16 decode
# kernel at 225 registers per thread, 2 blocks of 4 warps per SM (12.5% theoretical occupancy), each
# scheduler issuing every 2 cycles; compiled offline, the K tile decoded in parts of 64 columns (sub_k 64)
# needs 128 registers (16 warps per SM, no spill). This call (one H200, <= 570 s from its start):
#   0. the W4A16 kernels' GPU tests first (real sizes; max_registers changes no bit; the shared K tile, fbc763d);
#   1. the tune suite for the grouped kernel at the 1b decode shapes (`--tune-kinds moe --tune-moe-shapes 1b`: sub_k 64,
#      block_k 64, two stages and register caps 128 / 168 first, then run 6's grid), its fastest decode config
#      in $OUT/tuning.json;
#   2. the 1b e2e rollout rows (run 18's command, bf16 + w4a16) with the committed table, then, in this
#      device copy only, that winner copied over quads/kernels/tuning.json and the rows again (bf16, w4a16,
#      w4a4+rac50): a same-machine A/B of the table.
# OUT=$OUT bash scripts/device_calls/2026-12-05_grouped_occupancy.sh
# Adopt the winner by committing its decode entry to quads/kernels/tuning.json (docs/PERF.md records the run).
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
T0=$(date +%s); left() { echo $(( 570 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 90) python3 -m pytest -q -x tests/test_kernels_w4a16.py > $OUT/gpu_tests.txt 2>&1; echo "rc=$?" >> $OUT/gpu_tests.txt
timeout $(cap 220) python3 benchmarks/bench_kernels.py --only tune --tune-kinds moe --tune-moe-shapes 1b --workers 15 \
  --json $OUT/tune_moe.json --tuning-out $OUT/tuning.json > $OUT/tune_moe.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/tune_moe.log
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 110) python3 $E2E --recipes bf16,w4a16 --json $OUT/e2e_before.json > $OUT/e2e.log 2>&1
echo "before rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
if [ -f $OUT/tuning.json ]; then
  cp $OUT/tuning.json quads/kernels/tuning.json
  timeout $(cap 170) python3 $E2E --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e_after.json >> $OUT/e2e.log 2>&1
  echo "after rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
  git checkout quads/kernels/tuning.json
fi
grep -h "compiled\|done in\|rc=" $OUT/tune_moe.log; python3 -c "import json;print(json.load(open('$OUT/tuning.json'))['w4a16_grouped_gemm'])" 2>&1
grep -h "vs bf16\|rc=" $OUT/e2e.log; tail -n 2 $OUT/gpu_tests.txt 2>/dev/null; true
