#!/usr/bin/env bash
# RAC's CUDA selection (quads.kernels.rac_select_cuda; tuning.json's rac_select k1024 / k256 select it since
# 2026-12-07 (k)) in the 1b step, in two processes: a) bf16, w4a4+rac50, w4a4 on the committed tuning (on an H200
# w4a16 too); b) bf16, w4a4+rac50 with rac_select set back to the Triton selection (a copy of tuning.json, restored
# after): the step's difference. The recipes run in the order given, each row written as it ends. (Runs 79-80 ran
# earlier forms, with the selection's GPU tests first; those are in 2027-01-11c_tests_triton_rows.sh now. Run 81
# timed plain w4a4 with (j)'s operand: 2.12 ms a step.)
# One GPU, <= 580 s (TOTAL=<s>). OUT=$OUT TOTAL=570 bash scripts/device_calls/2027-01-09_rac_select_cuda.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
R=bf16,w4a4+rac50,w4a4; CAP_A=390  # run 81: each recipe's cold compile ~118 s
# on the issue's card W4A16's row too (queue item 1), before the RAC row; plain W4A4 last (the rows are written as
# they finish, so a cap keeps the earlier ones)
grep -q H200 $OUT/gpu.txt && R=bf16,w4a16,w4a4+rac50,w4a4 && CAP_A=480
timeout $(cap $CAP_A) python3 -u $E2E --recipes $R --json $OUT/e2e_1b_a.json > $OUT/e2e_1b_a.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_a.log
rac_select_backend triton
if [ "$(left)" -gt 150 ]; then
  timeout $(cap 230) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_1b_b_triton_select.json > $OUT/e2e_1b_b_triton_select.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_b_triton_select.log
fi
tuning_restore
cat $OUT/gpu.txt
grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b_*.log | tail -n 16
cache_pack 1  # the compile caches back (lib.sh), for a later call's carry
true
