#!/usr/bin/env bash
# Issue 17: the prefill on the decoder's dispatch, replayed from a CUDA graph per prompt block shape (run 35: the
# eager prefill 83-121 ms of a 1b generation's ~300 ms at 64 new tokens, host-bound), and the dense W4A16 dispatch's
# shape entry (run 35: the CUDA kernel at 28672 x 4096, M <= 4). One H200, <= 580 s from its start:
#   1. GPU tests: prefill graph = eager prefill (padding or not, routing or not), graph = no graph over three
#      generations (the third replays the prefill graph) with rescoring, every recipe, compiled or not;
#   2. the 1b rollout, four recipes (the JSON is written row by row, so a cut call keeps the rows done);
#   3. the rest of the engine's GPU tests and the w4a16 kernel tests (the dense dispatch).
# OUT=$OUT bash scripts/device_calls/2026-12-09_prefill_graphs.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 580 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 200) python3 -m pytest -q -x tests/test_engine_gpu.py -k "prefill_graph or graph_matches_no_graph" \
  > $OUT/gpu_tests_prefill.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_prefill.txt
timeout $(cap 270) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a16,w4a4,w4a4+rac50 --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
timeout $(cap 200) python3 -m pytest -q tests/test_engine_gpu.py tests/test_kernels_w4a16.py -k "not prefill_graph and not graph_matches_no_graph" \
  > $OUT/gpu_tests_rest.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_rest.txt
tail -n 3 $OUT/gpu_tests_prefill.txt $OUT/gpu_tests_rest.txt; grep -h "rc=" $OUT/*.log
grep -h "x bf16\|tok/s" $OUT/e2e_1b.log | cut -c1-220
python3 -c "
import json
d = json.load(open('$OUT/e2e_1b.json')); rows = d['rows'] if isinstance(d, dict) else d
for r in rows: print(r['recipe'], round(r.get('tokens_per_s', 0)), round(r.get('decode_ms_per_step', 0), 2), round(r.get('prefill_ms', 0), 1), r.get('vs_bf16'), r.get('error', ''))
" 2>&1 | tail -n 8; grep -h "FAILED\|Error" $OUT/gpu_tests_*.txt | head -20; true
