#!/usr/bin/env bash
# Issues 17/18: the e2e rows of the tree after runs 46-49 (expert_routes with the token slots over each expert's own
# rows, W4A16 rows read in place, tuning.json rac_select, decode attention's one split finished in one launch) and of a32c32f (the tree before them) on the same machine,
# then the compiled steps' graph = no graph and the RAC sort GPU tests with the table's select configs (K = 1,024 and 208, padded to 256). One GPU,
# <= 580 s (TOTAL=<s> for less).
# OUT=$OUT bash scripts/device_calls/2026-12-16_session_ab.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 250) python3 $E2E --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
mkdir -p /tmp/base && git archive a32c32fe06a737647ea41e65ecb8099907975282 | tar -x -C /tmp/base && (cd /tmp/base && \
  PYTHONPATH=. timeout $(cap 180) python3 $E2E --recipes bf16,w4a16 --json $OUT/e2e_base.json > $OUT/e2e_base.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_base.log)
timeout $(cap 150) python3 -m pytest -q tests/test_decode_attention.py "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a16-1.0-True]" \
  "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a4+rac50-1.0-True]" tests/test_quant_factored_gpu.py \
  -k "decode_attention or one_split or graph_matches_no_graph or (rac_sort_equals_count and (1024 or 208))" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
grep -h "^rollout\|rc=" $OUT/e2e.log $OUT/e2e_base.log | cut -c1-160; tail -n 3 $OUT/gpu_tests.txt; true
