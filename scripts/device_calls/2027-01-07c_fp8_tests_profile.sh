#!/usr/bin/env bash
# tests/test_fp8_scaled.py on the GPU with run 77's accumulation allowance, then where the 1b fp8 step goes
# (torch.profiler over the compiled step in its graph, bf16 and fp8). One GPU, <= 580 s.
# OUT=$OUT bash scripts/device_calls/2027-01-07c_fp8_tests_profile.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 100) python3 -m pytest -q -p no:cacheprovider tests/test_fp8_scaled.py > $OUT/test_fp8_scaled.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/test_fp8_scaled.log
timeout $(cap 470) python3 -u benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes bf16,fp8 --graphs on \
  --compile on --profile-top 0 --json $OUT/profile_1b.json > $OUT/profile_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_1b.log
cat $OUT/gpu.txt; tail -n 3 $OUT/test_fp8_scaled.log; tail -n 25 $OUT/profile_1b.log
true
