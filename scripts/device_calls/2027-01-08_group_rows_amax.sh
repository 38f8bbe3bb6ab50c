#!/usr/bin/env bash
# The W4A4 decode operand's group amaxes from the row maxima (2026-12-07 (j): no zero fill, no atomic amax kernel):
# its GPU tests (the operand kernels, then the engine's compiled step against no graph and the eager reference),
# then the 1b rows bf16 / w4a4 / w4a4+rac50 in one process; on an H200 the w4a16 row too (queue item 1's row on the
# issue's card); then, with time left, the profile of the w4a4+rac50 step. One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT TOTAL=560 bash scripts/device_calls/2027-01-08_group_rows_amax.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 90) python3 -m pytest -q -p no:cacheprovider tests/test_quant_factored_gpu.py \
  -k "sorted_linear or forward_static or fused_rac_operands" > $OUT/gpu_tests_operands.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_operands.log
timeout $(cap 120) python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py \
  -k "(graph_matches_no_graph or static_tokens_match_eager or compiled_decode_step_is_one_graph) and rac50 and not rac50x4" \
  > $OUT/gpu_tests_engine.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_engine.log
R=bf16,w4a4,w4a4+rac50
grep -q H200 $OUT/gpu.txt && R=bf16,w4a16,w4a4,w4a4+rac50
timeout $(cap 560) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 \
  --long-tokens 0 --graphs on --compile on --recipes $R --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
if [ "$(left)" -gt 90 ]; then  # where the step goes now: is the row max fused into the gather / SiLU kernels?
  timeout $(cap 200) python3 -u benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes w4a4+rac50 \
    --graphs on --compile on --profile-top 0 --json $OUT/profile_rac50.json > $OUT/profile_rac50.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_rac50.log
fi
cat $OUT/gpu.txt; tail -n 2 $OUT/gpu_tests_operands.log $OUT/gpu_tests_engine.log
grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b.log | tail -n 12
true
