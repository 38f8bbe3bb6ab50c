#!/usr/bin/env bash
# Issues 17/18: RAC's select kernel with its channels sorted in runs merged by binary search (rac_units sort_run;
# offline SASS at the 1b gate_up: 51 barriers with runs of 128 against 155 for one sort of 1024) and the router's
# top-k fused by Inductor (moe.top_experts, in since run 42, its kernel not yet seen in a profile). GPU tests of the
# runs (byte for byte against the count path), the RAC operand bench per sort_run and select_warps (offline SASS at
# K = 1024: 16 warps cut the per-warp static count 6600 -> 3760 for runs of 128), the 1b W4A4 + RAC profile (the
# router's fused kernel against run 41's 16.7 us a layer of aten.topk), then the 1b e2e rows. One H200, <= 580 s.
# OUT=$OUT bash scripts/device_calls/2026-12-12_rac_runs.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 580 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 150) python3 -m pytest -q tests/test_quant_factored_gpu.py -k "rac_sort_equals_count and (1024 or 208)" \
  > $OUT/gpu_tests_rac.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_rac.txt
timeout $(cap 170) python3 benchmarks/bench_kernels.py --only rac --json $OUT/bench_rac.json > $OUT/bench_rac.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_rac.log
timeout $(cap 100) python3 benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes w4a4+rac50 --graphs on \
  --compile on --json $OUT/profile_1b.json > $OUT/profile_1b.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_1b.log
timeout $(cap 160) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
tail -n 2 $OUT/gpu_tests_rac.txt
grep "^row" $OUT/bench_rac.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l[4:]); print(r['shape'], round(r['us'], 1), 'w4a4', round(r['w4a4_us'], 1), 'runs', r.get('residual_sort_run_us'))"
python3 scripts/device_calls/print_profile.py $OUT/profile_1b.json --top 16 2>&1 | head -n 20; grep "^rollout" $OUT/e2e.log | tail -n 3; tail -n 1 $OUT/e2e.log; true
