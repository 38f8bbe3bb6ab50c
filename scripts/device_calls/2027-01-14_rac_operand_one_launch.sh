#!/usr/bin/env bash
# Issue 17: the decode's W4A4 + RAC operand as one CUDA launch (quads.kernels.rac_operand_cuda, 2026-12-08 (b)).
# 1. its GPU tests (tests/test_rac_operand_cuda.py: byte for byte against the launches and the reference) and the
#    selection's (tests/test_rac_select_cuda.py: no gmax slot for the rows of no group since 2026-12-08 (b));
# 2. the operand probe (scripts/device_calls/rac_operand_cuda_probe.py: one launch at each warp count against the
#    launches, replayed in CUDA graphs, 0% / 50% of the tokens finished);
# 3. the 1b rows bf16, w4a4+rac50 with tuning.json's rac_operand set to the one launch (if its tests passed; else the
#    launches), then w4a4+rac50 on the committed launches in a second process while time is left.
# One GPU, <= 580 s (TOTAL=<s>). OUT=$OUT TOTAL=575 bash scripts/device_calls/2027-01-14_rac_operand_one_launch.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 170) python3 -m pytest -q -p no:cacheprovider -rfE tests/test_rac_operand_cuda.py tests/test_rac_select_cuda.py \
  > $OUT/gpu_tests.log 2>&1; rc=$?; echo "rc=$rc at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.log
timeout $(cap 80) python3 -u scripts/device_calls/rac_operand_cuda_probe.py > $OUT/probe.jsonl 2> $OUT/probe.err
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/probe.err
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
[ $rc -eq 0 ] && tuning_set rac_operand backend '"cuda"'
timeout $(cap 300) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_1b_a.json > $OUT/e2e_1b_a.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s; rac_operand: $(python3 -c 'import json; print(json.load(open("quads/kernels/tuning.json"))["rac_operand"])')" >> $OUT/e2e_1b_a.log
tuning_restore
if [ "$(left)" -gt 150 ]; then
  timeout $(cap 300) python3 -u $E2E --recipes w4a4+rac50,bf16 --json $OUT/e2e_1b_b_launches.json > $OUT/e2e_1b_b_launches.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_b_launches.log
fi
cat $OUT/gpu.txt; tail -n 3 $OUT/gpu_tests.log; cat $OUT/probe.jsonl; tail -n 2 $OUT/probe.err
grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b_*.log | tail -n 12
true
