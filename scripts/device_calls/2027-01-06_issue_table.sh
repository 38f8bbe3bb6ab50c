#!/usr/bin/env bash
# The issue's own table (issue 17, "Why": bf16 / fp8 / w4a16 / w4a4 / w4a4+rac50 at 100m and 1b) on the current default
# path: compiled step and shared compiled prefill in CUDA graphs, fused q/k/v, Triton decode attention. The top table's
# 100m rows are run 4's (an H200, before most of the path) and its fp8 and plain w4a4 rows were last timed in runs 1-3
# and 40, so this refreshes the whole row set on one machine. 16 prompts x 8 samples, 64 new tokens, median of 2 timed
# generations after a warm-up; each process BF16 first, so every ratio is a same-process one.
# PRESET=1b: bf16,w4a16,w4a4 then bf16,fp8 (the second BF16 row from the warm Inductor cache);
# PRESET=100m: the five recipes in one process. (W4A4 + RAC 50% at 1b is runs 71 and 73, on this path.)
# One GPU, <= 580 s (TOTAL=<s>). OUT=$OUT PRESET=1b bash scripts/device_calls/2027-01-06_issue_table.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
P=${PRESET:-1b}
E2E="benchmarks/bench_e2e.py --suites rollout --preset $P --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
run() {  # run <name> <cap s> <recipes>
  timeout $(cap $2) python3 -u $E2E --recipes $3 --json $OUT/e2e_${P}_$1.json > $OUT/e2e_${P}_$1.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_${P}_$1.log
}
if [ "$P" = 1b ]; then
  run a 340 bf16,w4a16,w4a4
  run b 230 bf16,fp8
else
  run a 570 bf16,w4a16,w4a4,w4a4+rac50,fp8
fi
cat $OUT/gpu.txt; grep -h "rc=\|x bf16" $OUT/*.log
true
