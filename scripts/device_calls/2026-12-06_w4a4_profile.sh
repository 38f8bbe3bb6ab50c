#!/usr/bin/env bash
# Issue 17 / 18, the W4A4 + RAC 50% step (run 25: 4.76 ms against W4A16's 2.78 and BF16's 2.99 on the 1b): where its
# extra ~2 ms goes, with today's defaults (Triton decode attention, run 23's grouped config). One H200, <= 540 s:
#   1. bench_kernels' rac suite: the W4A4 operand (one launch, and as three steps) and the RAC 50% operand per
#      selection method at the 1b decode shapes (run 19's numbers were taken before runs 23-29);
#   2. torch.profiler over the compiled 1b step for w4a4+rac50, w4a4 and w4a16 (kernels per step, GPU time per
#      kernel name): the operand kernels, the stacked-row GEMMs and what else the W4A4 step runs that W4A16's does not.
# OUT=$OUT bash scripts/device_calls/2026-12-06_w4a4_profile.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 540 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 120) python3 benchmarks/bench_kernels.py --only rac --json $OUT/bench_rac.json > $OUT/bench_rac.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_rac.log
timeout $(cap 400) python3 benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes w4a4+rac50,w4a4,w4a16 \
  --graphs on --compile on --json $OUT/profile_1b.json > $OUT/profile_1b.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_1b.log
grep -h "rc=" $OUT/*.log; tail -n 30 $OUT/bench_rac.log | cut -c1-220; grep -h "^profile" $OUT/profile_1b.log | cut -c1-400 | head -20; true
