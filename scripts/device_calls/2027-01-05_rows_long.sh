#!/usr/bin/env bash
# Issue 17, the short form of queue item 1 for a session with ~450 s of device time left: the 1b rows bf16 / w4a16 on
# the current default path (shared prefill, fused q/k/v projection) and, in the same process, their 512-token rows
# (the KV-cache side; the top table's long row is run 25's, before the shared prefill, the compiled prefill and the
# fused projection). On an H200 the first is the W4A16 row on its card; on an H100 a repeat of run 71 plus the
# long row. One GPU, <= 440 s (TOTAL=<s>).
# OUT=$OUT TOTAL=440 bash scripts/device_calls/2027-01-05_rows_long.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 430) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 \
  --long-tokens 512 --long-recipes bf16,w4a16 --graphs on --compile on --recipes bf16,w4a16 \
  --json $OUT/e2e_long.json > $OUT/e2e_long.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_long.log
cat $OUT/gpu.txt; grep -h "rc=\|x bf16" $OUT/*.log
true
