#!/usr/bin/env bash
# Issues 17/18, run 47: the MoE slots sorted by expert in one Triton launch (quads.kernels.expert_routes, in every
# recipe's decode step): its GPU tests and graph = no graph for the compiled bf16 / RAC steps, the 1b e2e rows (all
# three recipes in one run: the same-run ratios), the RAC select kernel per config (bench_kernels --only rac_select,
# each config's bits checked against the default's), and the profile of the bf16 step (every kernel). One GPU,
# <= 560 s (TOTAL=<s> for less).
# OUT=$OUT bash scripts/device_calls/2026-12-15_expert_routes.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-560}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 90) python3 -m pytest -q tests/test_expert_routes.py "tests/test_engine_gpu.py::test_graph_matches_no_graph[bf16-1.0-True]" \
  "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a4+rac50-1.0-True]" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 290) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
timeout $(cap 110) python3 benchmarks/bench_kernels.py --only rac_select --json $OUT/rac_select.json > $OUT/rac_select.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/rac_select.log
timeout $(cap 90) python3 benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes bf16 --graphs on \
  --compile on --profile-top 0 --json $OUT/profile_1b_bf16.json > $OUT/profile_1b_bf16.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_1b_bf16.log
tail -n 2 $OUT/gpu_tests.txt; grep -h "^rollout\|rc=" $OUT/e2e.log | cut -c1-200
grep "^row" $OUT/rac_select.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l[4:]); print(r['shape'][:14], r.get('sort_run'), r.get('select_warps'), r.get('select_rows'), round(r.get('us', -1), 2), r.get('same_bits_as_default'))"
tail -n 1 $OUT/rac_select.log
python3 scripts/device_calls/print_profile.py $OUT/profile_1b_bf16.json --top 30 2>&1 | cut -c1-120; tail -n 1 $OUT/profile_1b_bf16.log; true
