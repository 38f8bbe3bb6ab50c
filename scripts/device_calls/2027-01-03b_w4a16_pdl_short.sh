#!/usr/bin/env bash
# Ran as run 70 (docs/PERF.md) on the tree of ea8343e; the weights-first launch was removed after it (slower), so
# --weights-first needs that tree.
# The short form of 2027-01-03_h200_w4a16_pdl.sh for a call with little device time left: the weights-first launch's
# GPU test first, then the 1b rollout rows bf16,w4a16 with programmatic dependent launch on (Inductor's and the
# grouped W4A16 kernel's weights-first launch; both rows get Inductor's, so the ratio is same-run), then, with what
# is left, the same rows on the default path. TOTAL=<s> (default 580).
# OUT=$OUT TOTAL=380 bash scripts/device_calls/2027-01-03b_w4a16_pdl_short.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 80) python3 -u -m pytest -q -x tests/test_kernels_w4a16.py -k weights_first > $OUT/gpu_tests.txt 2>&1
RC=$?; echo "rc=$RC at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
if [ $RC = 0 ]; then  # the weights-first launch only after its test passed
  timeout $(cap 240) python3 -u $E2E --recipes bf16,w4a16 --inductor-pdl on --weights-first on --json $OUT/e2e_pdl.json > $OUT/e2e_pdl.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_pdl.log
fi
timeout $(cap 240) python3 -u $E2E --recipes bf16,w4a16 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed\|x bf16" $OUT/*.log $OUT/*.txt
true
