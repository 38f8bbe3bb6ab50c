#!/usr/bin/env bash
# Issues 17/18 after run 41's profile: the router's top-k fused by Inductor (moe.top_experts; aten.topk was three
# kernels, ~17 us a 1b layer) and RAC's sort path in one launch (_rac_sort_units_kernel: each expert's program
# quantizes its own rows; the units kernel was ~6 us a call). GPU tests (bit-exactness of the one launch against
# the count path, the steps and the reference; compiled graph = no graph), the RAC operand bench, the 1b e2e table.
# One H200, <= 580 s.
# OUT=$OUT bash scripts/device_calls/2026-12-11_router_rac_one_launch.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 580 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 110) python3 -m pytest -q -x tests/test_quant_factored_gpu.py -k "rac_sort_equals_count or fused_rac_operands" \
  > $OUT/gpu_tests_rac.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_rac.txt
timeout $(cap 100) python3 -m pytest -q -x tests/test_engine_gpu.py -k "graph_matches_no_graph and True and (bf16 or rac50)" \
  > $OUT/gpu_tests_engine.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_engine.txt
timeout $(cap 110) python3 benchmarks/bench_kernels.py --only rac --json $OUT/bench_rac.json > $OUT/bench_rac.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_rac.log
timeout $(cap 300) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 3 --new-tokens 64 --graphs on \
  --compile on --recipes bf16,w4a16,w4a4,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
tail -n 2 $OUT/gpu_tests_rac.txt $OUT/gpu_tests_engine.txt
grep "^row" $OUT/bench_rac.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l[4:]); print(r['shape'], {k: round(v, 1) for k, v in r.items() if k.endswith('_us') and isinstance(v, float)})"
grep "^rollout" $OUT/e2e.log; tail -n 1 $OUT/e2e.log; true
