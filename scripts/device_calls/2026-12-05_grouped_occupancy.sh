#!/usr/bin/env bash
# Issue 18 / 17, next kernel call: Nsight Compute (2026-12-03, docs/PERF.md) found the grouped W4A16 decode
# kernel at 225 registers per thread, 2 blocks of 4 warps per SM (12.5% theoretical occupancy), each
# scheduler issuing every 2 cycles. This call (one H200, ~5-7 min):
#   1. the grouped kernel's GPU tests (max_registers, the PTX .maxnreg cap, changes no bit);
#   2. the tune suite for the grouped kernel alone (`--tune-kinds moe`: the earlier grid plus block_k 64,
#      two stages and register caps 128 / 168), its fastest decode config in $OUT/tuning.json;
#   3. Nsight Compute on the 1b gate_up and down calls with the current config and with that winner, every
#      raw metric of the warp-state and source sections (`--page raw`: the stall reasons by name).
# OUT=$OUT bash scripts/device_calls/2026-12-05_grouped_occupancy.sh   (adopt the winner: copy its decode entry
# into quads/kernels/tuning.json, then the engine call, scripts/device_calls/2026-12-04_engine.sh, measures it)
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
timeout 120 python3 -m pytest -q tests/test_kernels_w4a16.py -k grouped > $OUT/gpu_tests.txt 2>&1; echo "rc=$?" >> $OUT/gpu_tests.txt
timeout 330 python3 benchmarks/bench_kernels.py --only tune --tune-kinds moe --tune-moe-shapes 1b --workers 15 --json $OUT/tune_moe.json \
  --tuning-out $OUT/tuning.json > $OUT/tune_moe.log 2>&1; echo "rc=$?" >> $OUT/tune_moe.log
for which in current best; do
  cfg=""; [ $which = best ] && [ -f $OUT/tuning.json ] && cfg="--config $OUT/tuning.json"
  [ $which = best ] && [ -z "$cfg" ] && continue
  for s in gate_up down; do
    echo "== $which $s" >> $OUT/ncu_$which.txt
    timeout 90 ncu --clock-control none --kernel-name regex:_grouped_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
      --section WarpStateStats --section SourceCounters --page raw \
      python3 scripts/ncu_grouped.py --shapes $s --calls 3 $cfg >> $OUT/ncu_$which.txt 2>&1; echo "rc=$?" >> $OUT/ncu_$which.txt
  done
done
grep -h "compiled\|done in" $OUT/tune_moe.log; python3 -c "import json;print(json.load(open('$OUT/tuning.json'))['w4a16_grouped_gemm'])" 2>&1
grep -h "stalled.*ratio\|registers_per_thread\|gpu__time_duration.sum" $OUT/ncu_*.txt | head -60; tail -n 3 $OUT/gpu_tests.txt; true
