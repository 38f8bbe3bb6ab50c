#!/usr/bin/env bash
# tests/test_fp8_scaled.py on the GPU with run 77's accumulation allowance; then on an H200 the 1b rows bf16, w4a16
# (queue item 1's W4A16 row on the issue's card), on any other card where the 1b fp8 step goes (torch.profiler over
# the compiled step in its graph, bf16 and fp8). One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT TOTAL=420 bash scripts/device_calls/2027-01-07c_fp8_tests_profile.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 80) python3 -m pytest -q -p no:cacheprovider tests/test_fp8_scaled.py > $OUT/test_fp8_scaled.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/test_fp8_scaled.log
if grep -q H200 $OUT/gpu.txt; then
  timeout $(cap 490) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 \
    --long-tokens 0 --graphs on --compile on --recipes bf16,w4a16 --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
else
  timeout $(cap 490) python3 -u benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes bf16,fp8 \
    --graphs on --compile on --profile-top 0 --json $OUT/profile_1b.json > $OUT/profile_1b.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_1b.log
fi
cat $OUT/gpu.txt; tail -n 3 $OUT/test_fp8_scaled.log; grep -h "rc=\|x bf16" $OUT/e2e_1b.log 2>/dev/null
tail -n 25 $OUT/profile_1b.log 2>/dev/null
true
