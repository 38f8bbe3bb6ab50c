#!/usr/bin/env bash
# Issue 17, queue item 0d: the 1b rows with rows finishing at different steps, as in a real rollout (bench_e2e
# --stop-fraction 0.01: 1% of the vocabulary's ids end a sample, ~1 - 0.99^256 = 92% of the rows finish within 256
# tokens), bf16 / w4a16 / w4a4+rac50 in that order, 256 new tokens: the step time with masked slots, where the rows of
# no group are zero rows since 2026-12-08 (a). One GPU, <= 580 s (TOTAL=<s>; ~118 s of cold compile a recipe).
# OUT=$OUT TOTAL=575 bash scripts/device_calls/2027-01-12_stop_fraction_rows.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap $((TOTAL - 40))) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 256 \
  --long-tokens 0 --graphs on --compile on --stop-fraction 0.01 --recipes bf16,w4a16,w4a4+rac50 \
  --json $OUT/e2e_1b_stop.json > $OUT/e2e_1b_stop.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_stop.log
cat $OUT/gpu.txt; grep -h "rc=\|x bf16" $OUT/e2e_1b_stop.log | tail -n 6
cache_pack 3  # the compile caches back (lib.sh), for a later call's carry
true
