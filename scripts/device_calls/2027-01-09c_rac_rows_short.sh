#!/usr/bin/env bash
# The short form of 2027-01-09_rac_select_cuda.sh (queue item 0), for a session with little device time left: only
# the 1b rows bf16 / w4a4+rac50 / w4a4 on the committed defaults (RAC's CUDA selection at K = 1,024 / 256, (j)'s
# W4A4 decode operand), one process, the rows written as they finish (a cap keeps the earlier ones). Compare with
# runs 71-75 on H100s (w4a4+rac50 3.01-3.03, w4a4 2.27 ms a step). One GPU, <= 420 s (TOTAL=<s>; run 81: each recipe's cold compile ~118 s).
# OUT=$OUT TOTAL=420 bash scripts/device_calls/2027-01-09c_rac_rows_short.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap $((TOTAL - 10))) python3 -u $E2E --recipes bf16,w4a4+rac50,w4a4 --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
cat $OUT/gpu.txt; grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b.log | tail -n 8
true
