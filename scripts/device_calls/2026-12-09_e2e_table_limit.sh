#!/usr/bin/env bash
# Issue 17: run 37's e2e table again with the compiled step under COMPILED_SHAPES (run 37's 100m 4-bit rows ran the
# step eagerly inside its graph: Dynamo's recompile limit of 8 hit after the 1b's compiles), and the engine's GPU
# graph tests of the compiled step. One H200, <= 400 s; the JSON is written row by row.
# OUT=$OUT bash scripts/device_calls/2026-12-09_e2e_table_limit.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s)
timeout 280 python3 benchmarks/bench_e2e.py --suites rollout --preset 1b,100m --reps 3 --new-tokens 64 --long-tokens 512 \
  --long-recipes bf16,w4a16 --graphs on --compile on --recipes bf16,w4a16,w4a4,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
timeout $(( 400 - ($(date +%s) - T0) )) python3 -m pytest -q -x tests/test_engine_gpu.py -k "graph_matches_no_graph and True" \
  > $OUT/gpu_tests.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
python3 -c "
import json
d = json.load(open('$OUT/e2e.json')); rows = d['rows'] if isinstance(d, dict) else d
for r in rows: print(r['preset'], r['recipe'], r['new_tokens'], round(r.get('tokens_per_s', 0)), round(r.get('decode_ms_per_step', 0), 2), round(r.get('prefill_ms', 0), 1), r.get('vs_bf16') and round(r['vs_bf16'], 3), round(r.get('x_floor', 0), 1), r.get('error', ''))
" 2>&1 | tail -n 14; grep -c recompile_limit $OUT/e2e.log; tail -n 1 $OUT/e2e.log; tail -n 2 $OUT/gpu_tests.txt; true
