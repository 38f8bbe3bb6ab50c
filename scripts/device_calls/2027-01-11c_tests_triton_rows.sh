#!/usr/bin/env bash
# The follow-up of 2027-01-11b_rows_and_masked.sh on the same warm machine: the GPU tests of the kernels the rows of
# no group changed (tests/test_rac_select_cuda.py, tests/test_quant_factored_gpu.py), then the 1b rows bf16 /
# w4a4+rac50 with RAC's selection set back to Triton's (a copy of tuning.json, restored after): the step's difference
# against 11b's rows (CUDA selection). One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT TOTAL=575 bash scripts/device_calls/2027-01-11c_tests_triton_rows.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 220) python3 -m pytest -q -p no:cacheprovider -rfE tests/test_rac_select_cuda.py tests/test_quant_factored_gpu.py \
  > $OUT/gpu_tests.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.log
rac_select_backend triton
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 330) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_1b_triton_select.json > $OUT/e2e_1b_triton_select.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_triton_select.log
tuning_restore
cat $OUT/gpu.txt; tail -n 4 $OUT/gpu_tests.log; grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b_triton_select.log | tail -n 6
true
