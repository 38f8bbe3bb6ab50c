#!/usr/bin/env bash
# Issues 17/18, run 48: each token's sorted rows from expert_routes (StaticRoutes.token_slots, no _expert_rank /
# _expert_slots kernels) and the W4A16 grouped kernel reading the tokens' rows in place (w4a16.grouped_gemm(rows=),
# no [T*k, H] gathered copy): GPU tests (expert_routes, the grouped kernel with gathered rows at real sizes and in a
# graph, graph = no graph for the compiled bf16 / w4a16 / RAC steps), the 1b e2e rows (three recipes, one run), the
# profile of the w4a16 step (every kernel), then the RAC select kernel per config (bench_kernels --only rac_select,
# printed as each is timed). One GPU, <= 580 s (TOTAL=<s> for less).
# OUT=$OUT bash scripts/device_calls/2026-12-15_gather_rows.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 100) python3 -m pytest -q tests/test_expert_routes.py \
  tests/test_kernels_w4a16.py -k "expert_routes or gpu_grouped_real_size or in_a_cuda_graph or graph_matches_no_graph" \
  "tests/test_engine_gpu.py::test_graph_matches_no_graph[bf16-1.0-True]" \
  "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a16-1.0-True]" \
  "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a4+rac50-1.0-True]" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 260) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
timeout $(cap 90) python3 benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes w4a16 --graphs on \
  --compile on --profile-top 0 --json $OUT/profile_1b_w4a16.json > $OUT/profile_1b_w4a16.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_1b_w4a16.log
timeout $(cap 200) python3 benchmarks/bench_kernels.py --only rac_select --json $OUT/rac_select.json > $OUT/rac_select.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/rac_select.log
tail -n 3 $OUT/gpu_tests.txt; grep -h "^rollout\|rc=" $OUT/e2e.log | cut -c1-150
python3 scripts/device_calls/print_profile.py $OUT/profile_1b_w4a16.json --top 25 2>&1 | cut -c1-110; tail -n 1 $OUT/profile_1b_w4a16.log
grep "^timed" $OUT/rac_select.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l[6:]); print(r['shape'][:14], r.get('sort_run'), r.get('select_warps'), r.get('select_rows'), round(r.get('us', -1), 2), r.get('same_bits_as_default'))"
tail -n 1 $OUT/rac_select.log; true
