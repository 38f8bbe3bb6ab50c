#!/usr/bin/env bash
# RAC's CUDA selection (quads.kernels.rac_select_cuda; tuning.json's rac_select k1024 / k256 select it since
# 2026-12-07 (k)) and the W4A4 decode operand's group amaxes from the row maxima ((j)) in the 1b step: the CUDA
# selection's GPU tests that runs 79-80 did not reach (K = 1,024 n = 512 and n = 16, K = 16), then the 1b rows in two
# processes: a) bf16, w4a4, w4a4+rac50 on the committed tuning (on an H200 w4a16 too); b) bf16, w4a4+rac50 with
# rac_select set back to the Triton selection (a copy of tuning.json, restored after): the step's difference.
# (Run 79 ran an earlier form of this script: b with cuda_fused, the units in the selection's blocks, removed since.)
# One GPU, <= 580 s (TOTAL=<s>). OUT=$OUT TOTAL=570 bash scripts/device_calls/2027-01-09_rac_select_cuda.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
T=tests/test_rac_select_cuda.py::test_cuda_selection_is_the_triton_selection_bit_for_bit
timeout $(cap 120) python3 -m pytest -q -p no:cacheprovider -rA "$T[group-1024-512-bfloat16]" "$T[token-1024-16-float32]" \
  "$T[group-16-16-bfloat16]" > $OUT/gpu_tests_rac_cuda.log 2>&1  # the three cases run 80 did not reach
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_rac_cuda.log
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
R=bf16,w4a4,w4a4+rac50; CAP_A=320
# on the issue's card W4A16's row too (queue item 1), before the RAC row; plain W4A4 last (the rows are written as
# they finish, so a cap keeps the earlier ones)
grep -q H200 $OUT/gpu.txt && R=bf16,w4a16,w4a4+rac50,w4a4 && CAP_A=390
timeout $(cap $CAP_A) python3 -u $E2E --recipes $R --json $OUT/e2e_1b_a.json > $OUT/e2e_1b_a.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_a.log
rac_select_backend triton
if [ "$(left)" -gt 100 ]; then
  timeout $(cap 230) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_1b_b_triton_select.json > $OUT/e2e_1b_b_triton_select.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_b_triton_select.log
fi
tuning_restore
cat $OUT/gpu.txt; grep -E "PASSED|FAILED|ERROR|rc=" $OUT/gpu_tests_rac_cuda.log | tail -n 20
grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b_*.log | tail -n 16
true
