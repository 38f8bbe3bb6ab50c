#!/usr/bin/env bash
# The second call on a machine that ran 2027-01-09_rac_select_cuda.sh (its compile caches in cache/): the GPU tests of
# RAC's selection and W4A4 operand kernels (tests/test_rac_select_cuda.py, tests/test_quant_factored_gpu.py: the
# rows of no group as zero rows of 2026-12-08 (a), and since 2026-12-08 (b) no gmax slot for them), then queue item
# 0d's rows with rows finishing at different steps (bench_e2e --stop-fraction 0.01, 256 new tokens; bf16,
# w4a4+rac50, w4a16 in that order). One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT TOTAL=575 bash scripts/device_calls/2027-01-13_tests_stop_rows.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 200) python3 -m pytest -q -p no:cacheprovider -rfE tests/test_rac_select_cuda.py tests/test_quant_factored_gpu.py \
  > $OUT/gpu_tests.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.log
timeout $(cap $((TOTAL - 20))) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 256 \
  --long-tokens 0 --graphs on --compile on --stop-fraction 0.01 --recipes bf16,w4a4+rac50,w4a16 \
  --json $OUT/e2e_1b_stop.json > $OUT/e2e_1b_stop.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_stop.log
cat $OUT/gpu.txt; tail -n 4 $OUT/gpu_tests.log; grep -h "rc=\|x bf16" $OUT/e2e_1b_stop.log | tail -n 6
true
