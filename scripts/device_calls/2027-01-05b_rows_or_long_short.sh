#!/usr/bin/env bash
# The shortest form of queue item 1 (~250 s of device time left): on an H200 the 1b rows bf16 / w4a16 at 64 new tokens
# on the current default path (the W4A16 row on its card); on any other card the same two recipes at 512 new
# tokens instead (the long row on the current path: the top table's is run 25's). One GPU, <= 250 s (TOTAL=<s>).
# OUT=$OUT TOTAL=250 bash scripts/device_calls/2027-01-05b_rows_or_long_short.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
if grep -q H200 $OUT/gpu.txt; then TOK=64; else TOK=512; fi
timeout $(cap 245) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens $TOK \
  --long-tokens 0 --graphs on --compile on --recipes bf16,w4a16 --json $OUT/e2e_$TOK.json > $OUT/e2e_$TOK.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_$TOK.log
cat $OUT/gpu.txt; grep -h "rc=\|x bf16" $OUT/*.log
true
