#!/usr/bin/env bash
# Issue 18: the grouped W4A16 decode kernel's stall reasons by name (the 2026-12-04 ncu call printed the
# sections' summaries only): Nsight Compute's raw metrics of the warp-state, scheduler, occupancy and source
# sections for the 1b gate_up and down calls, with the committed decode config and, when CONFIG names a
# tuning.json (the occupancy call's winner), with that one too. One H200, ~1-2 minutes.
# OUT=$OUT [CONFIG=path/to/tuning.json] bash scripts/device_calls/2026-12-05_ncu_stalls.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
for which in current ${CONFIG:+config}; do
  cfg=""; [ $which = config ] && cfg="--config $CONFIG"
  for s in gate_up down; do
    echo "== $which $s" >> $OUT/ncu_$which.txt
    timeout 120 ncu --clock-control none --kernel-name regex:_grouped_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
      --section WarpStateStats --section SourceCounters --page raw \
      python3 scripts/ncu_grouped.py --shapes $s --calls 3 $cfg >> $OUT/ncu_$which.txt 2>&1; echo "rc=$?" >> $OUT/ncu_$which.txt
  done
done
grep -h "== \|stalled.*ratio\|launch__registers_per_thread \|gpu__time_duration.sum" $OUT/ncu_*.txt | head -80; true
