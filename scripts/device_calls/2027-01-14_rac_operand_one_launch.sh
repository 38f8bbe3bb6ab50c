#!/usr/bin/env bash
# Issue 17: the decode's W4A4 + RAC operand as one CUDA launch (quads.kernels.rac_operand_cuda, 2026-12-08 (b)).
# 1. its GPU tests (tests/test_rac_operand_cuda.py: byte for byte against the launches, which run the CUDA selection,
#    and the reference; in a CUDA graph; in a compiled function);
# 2. the 1b rows bf16, w4a4+rac50 with tuning.json's rac_operand set to the one launch if those tests passed (else on
#    the launches: item 0's RAC row);
# 3. the operand probe (scripts/device_calls/rac_operand_cuda_probe.py: one launch at each warp count against the
#    launches, replayed in CUDA graphs, 0% / 50% of the tokens finished);
# 4. the selection's own GPU tests (tests/test_rac_select_cuda.py: no gmax slot for the rows of no group and the
#    shared select_channels since 2026-12-08 (b)).
# The launches' RAC row in a process of its own is item 0 (2027-01-09_rac_select_cuda.sh), on the same warm machine.
# One GPU, <= 580 s (TOTAL=<s>). OUT=$OUT TOTAL=575 bash scripts/device_calls/2027-01-14_rac_operand_one_launch.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 200) python3 -m pytest -q -p no:cacheprovider -rfE tests/test_rac_operand_cuda.py > $OUT/gpu_tests.log 2>&1
rc=$?; echo "rc=$rc at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.log
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
[ $rc -eq 0 ] && tuning_set rac_operand backend '"cuda"'
timeout $(cap 290) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s; rac_operand: $(python3 -c 'import json; print(json.load(open("quads/kernels/tuning.json"))["rac_operand"])')" >> $OUT/e2e_1b.log
tuning_restore
timeout $(cap 60) python3 -u scripts/device_calls/rac_operand_cuda_probe.py > $OUT/probe.jsonl 2> $OUT/probe.err
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/probe.err
timeout $(cap 120) python3 -m pytest -q -p no:cacheprovider -rfE tests/test_rac_select_cuda.py > $OUT/gpu_tests_select.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_select.log
cat $OUT/gpu.txt; tail -n 3 $OUT/gpu_tests.log $OUT/gpu_tests_select.log; cat $OUT/probe.jsonl; tail -n 2 $OUT/probe.err
grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b.log | tail -n 8
true
