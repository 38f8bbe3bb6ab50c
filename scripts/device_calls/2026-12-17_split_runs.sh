#!/usr/bin/env bash
# Issues 17/18, the next call (run 51 was cut short: a cold machine, every step past its cap): RAC's selection as a
# program per (group, run) (rac_units(split_runs=True), two launches) against the one-program select kernel: the GPU
# tests (the sort path byte for byte against count at K = 1,024 and 208, split runs included; cold compiles), the 1b
# e2e rows of this tree (bf16, w4a16, w4a4+rac50) and w4a4+rac50 of a copy whose tuning.json takes split runs of 128
# channels (K = 1,024 and 256) on the same machine, then the select configs timed alone (bench_kernels --only
# rac_select, printed as each is timed). One GPU, <= 580 s (TOTAL=<s> for less).
# OUT=$OUT bash scripts/device_calls/2026-12-17_split_runs.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 150) python3 -m pytest -q tests/test_quant_factored_gpu.py -k "rac_sort_equals_count and (1024 or 208)" \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 210) python3 $E2E --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
mkdir -p /tmp/split && tar -c quads benchmarks/bench_e2e.py | tar -x -C /tmp/split && (cd /tmp/split && \
  sed -i 's/"k1024_sort": {"sort_run": 256, "select_warps": null, "select_rows": null, "split_runs": null}/"k1024_sort": {"sort_run": 128, "select_warps": null, "select_rows": null, "split_runs": true}/; s/"k256_sort": {"sort_run": null, "select_warps": null, "select_rows": 16, "split_runs": null}/"k256_sort": {"sort_run": 128, "select_warps": null, "select_rows": 16, "split_runs": true}/' quads/kernels/tuning.json && \
  grep -c '"split_runs": true' quads/kernels/tuning.json > $OUT/e2e_split.log && \
  PYTHONPATH=. timeout $(cap 110) python3 $E2E --recipes w4a4+rac50 --json $OUT/e2e_split.json >> $OUT/e2e_split.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_split.log)
timeout $(cap 200) python3 benchmarks/bench_kernels.py --only rac_select --json $OUT/rac_select.json > $OUT/rac_select.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/rac_select.log
tail -n 3 $OUT/gpu_tests.txt; grep -h "^rollout\|rc=" $OUT/e2e.log $OUT/e2e_split.log | cut -c1-160
grep -h "^timed" $OUT/rac_select.log | cut -c1-260; tail -n 1 $OUT/rac_select.log; true
