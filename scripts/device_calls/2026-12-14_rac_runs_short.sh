#!/usr/bin/env bash
# Issues 17/18: the first half of 2026-12-12_rac_runs.sh for a short device budget: the GPU tests of RAC's sorted runs
# (byte for byte against the count path) and the RAC operand bench per sort_run and select_warps, then the cost of one
# kernel boundary in a CUDA graph (bench_graph_launch, from 2026-12-13_pdl.sh). First the contracts of decode_attention's
# rows (dead rows zeroed by the kernel: the GPU tests, and graph = no graph for the compiled bf16 step with finishing
# rows). One GPU, <= 330 s (TOTAL=<s> for less).
# OUT=$OUT bash scripts/device_calls/2026-12-14_rac_runs_short.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-330}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 80) python3 -m pytest -q tests/test_decode_attention.py "tests/test_engine_gpu.py::test_graph_matches_no_graph[bf16-1.0-True]" \
  > $OUT/gpu_tests_attention.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_attention.txt
timeout $(cap 80) python3 -m pytest -q tests/test_quant_factored_gpu.py -k "rac_sort_equals_count and (1024 or 208)" \
  > $OUT/gpu_tests_rac.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_rac.txt
timeout $(cap 140) python3 benchmarks/bench_kernels.py --only rac --json $OUT/bench_rac.json > $OUT/bench_rac.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_rac.log
timeout $(cap 30) python3 benchmarks/bench_graph_launch.py --n 256 --json $OUT/graph_launch.json > $OUT/graph_launch.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/graph_launch.log
tail -n 2 $OUT/gpu_tests_attention.txt $OUT/gpu_tests_rac.txt
grep "^row" $OUT/bench_rac.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l[4:]); print(r['shape'], round(r['us'], 1), 'w4a4', round(r['w4a4_us'], 1), 'runs', r.get('residual_sort_run_us'))"
tail -n 1 $OUT/bench_rac.log; tail -c 1500 $OUT/graph_launch.log; true
