#!/usr/bin/env bash
# Issue 17: after the expert-order sum without a sort (_expert_rank) and the prefill graph bounds: the engine's GPU
# tests (the large-block and prefill-graph tests included) and the e2e table, 1b then 100m, in one process under the
# raised recompile limit (run 37's 100m 4-bit rows ran uncompiled; run 39's were cut). One H200, <= 580 s; the JSON is
# written row by row.
# OUT=$OUT bash scripts/device_calls/2026-12-10_engine_after_expert_rank.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 580 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 150) python3 -m pytest -q -x tests/test_engine_gpu.py -k "prefill or large_prompt or graph_matches_no_graph or weight_sync" \
  > $OUT/gpu_tests.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 420) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b,100m --reps 3 --new-tokens 64 --long-tokens 512 \
  --long-recipes bf16,w4a16 --graphs on --compile on --recipes bf16,w4a16,w4a4,w4a4+rac50,w4a4+rac50-static \
  --json $OUT/e2e.json > $OUT/e2e.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
tail -n 2 $OUT/gpu_tests.txt; grep -c recompile_limit $OUT/e2e.log
python3 -c "
import json
d = json.load(open('$OUT/e2e.json')); rows = d['rows'] if isinstance(d, dict) else d
for r in rows: print(r['preset'], r['recipe'], r['new_tokens'], round(r.get('tokens_per_s', 0)), round(r.get('decode_ms_per_step', 0), 2), round(r.get('prefill_ms', 0), 1), r.get('vs_bf16') and round(r['vs_bf16'], 3), round(r.get('x_floor', 0), 1), r.get('error', ''))
" 2>&1 | tail -n 16; tail -n 1 $OUT/e2e.log; true
