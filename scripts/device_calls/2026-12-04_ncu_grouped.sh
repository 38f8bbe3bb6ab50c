#!/usr/bin/env bash
# Issue 18 / 17: where the grouped W4A16 kernel's time goes at the 1b decode shapes (27-39% of the issue-rate
# bound in run 11, docs/PERF.md): Nsight Compute's stall reasons, occupancy and launch stats of one gate_up
# and one down call. One H200, ~2-4 minutes. OUT=$OUT bash scripts/device_calls/2026-12-04_ncu_grouped.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
python3 scripts/ncu_grouped.py > $OUT/plain.txt 2>&1
for s in gate_up down; do
  timeout 240 ncu --clock-control none --kernel-name regex:_grouped_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 scripts/ncu_grouped.py --shapes $s --calls 3 > $OUT/ncu_$s.txt 2>&1; echo "rc=$?" >> $OUT/ncu_$s.txt
done
cat $OUT/plain.txt; tail -n 40 $OUT/ncu_gate_up.txt; true
