#!/usr/bin/env bash
# Issues 17/18, run 51: (a) RAC's selection as a program per (group, run) (rac_units(split_runs=True), two launches)
# against the one-program select kernel: the GPU tests (the sort path byte for byte against count at K = 1,024 and
# 208, split runs included), the select configs timed alone (bench_kernels --only rac_select, printed as each is
# timed); (b) the 1b e2e rows on one machine: this tree (bf16, w4a16, w4a4+rac50), a copy whose tuning.json takes
# split runs of 128 channels (K = 1,024 and 256; w4a4+rac50), and a copy with the route weights applied to the
# sorted rows again (2026-12-17_contrib_revert.patch, the weighting of c725298; w4a16): run 50 had this tree's w4a16
# at 2.50 ms/step against c725298's 2.43; and a copy
# without the gated epilogue (2026-12-17_gated_off.patch; w4a16). One GPU, <= 580 s (TOTAL=<s> for less; in that order, so a
# shorter call keeps the e2e rows).
# OUT=$OUT bash scripts/device_calls/2026-12-17_split_runs.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
copy() { mkdir -p $1 && tar -c quads benchmarks/bench_e2e.py | tar -x -C $1; }
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 180) python3 $E2E --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
copy /tmp/contrib && (cd /tmp/contrib && patch -p1 < $OLDPWD/scripts/device_calls/2026-12-17_contrib_revert.patch > $OUT/e2e_contrib.log && \
  PYTHONPATH=. timeout $(cap 70) python3 $E2E --recipes w4a16 --json $OUT/e2e_contrib.json >> $OUT/e2e_contrib.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_contrib.log)
copy /tmp/split && (cd /tmp/split && \
  sed -i 's/"k1024_sort": {"sort_run": 256, "select_warps": null, "select_rows": null, "split_runs": null}/"k1024_sort": {"sort_run": 128, "select_warps": null, "select_rows": null, "split_runs": true}/; s/"k256_sort": {"sort_run": null, "select_warps": null, "select_rows": 16, "split_runs": null}/"k256_sort": {"sort_run": 128, "select_warps": null, "select_rows": 16, "split_runs": true}/' quads/kernels/tuning.json && \
  grep -c '"split_runs": true' quads/kernels/tuning.json > $OUT/e2e_split.log && \
  PYTHONPATH=. timeout $(cap 80) python3 $E2E --recipes w4a4+rac50 --json $OUT/e2e_split.json >> $OUT/e2e_split.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_split.log)
timeout $(cap 90) python3 -m pytest -q tests/test_quant_factored_gpu.py -k "rac_sort_equals_count and (1024 or 208)" \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
copy /tmp/gated_off && (cd /tmp/gated_off && patch -p1 < $OLDPWD/scripts/device_calls/2026-12-17_gated_off.patch > $OUT/e2e_gated_off.log && \
  PYTHONPATH=. timeout $(cap 70) python3 $E2E --recipes w4a16 --json $OUT/e2e_gated_off.json >> $OUT/e2e_gated_off.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_gated_off.log)
timeout $(cap 120) python3 benchmarks/bench_kernels.py --only rac_select --json $OUT/rac_select.json > $OUT/rac_select.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/rac_select.log
grep -h "^rollout\|rc=" $OUT/e2e.log $OUT/e2e_contrib.log $OUT/e2e_gated_off.log $OUT/e2e_split.log | cut -c1-160; tail -n 3 $OUT/gpu_tests.txt
grep -h "^timed" $OUT/rac_select.log | cut -c1-260; tail -n 1 $OUT/rac_select.log; true
