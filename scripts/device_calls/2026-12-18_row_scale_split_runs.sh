#!/usr/bin/env bash
# Issues 17/18, the next call (run 51 was cut short: a cold machine, every step past its cap). Two changes landed
# CPU-tested, neither timed: (1) the W4A16 down projection's route weights in the grouped kernel's epilogue
# (w4a16.grouped_gemm(row_scale=), 63abee7, on by default); (2) RAC's selection as a program per (group, run)
# (rac_units(split_runs=True), 16636eb, off in tuning.json). This call: the GPU tests of both (cold compiles), the 1b e2e
# rows of this tree (bf16, w4a16, w4a4+rac50), w4a16 of e886c3b (the tree before (1)) and w4a4+rac50 of a copy whose
# tuning.json takes split runs of 128 channels (K = 1,024 and 256), all on one machine, then the select configs timed
# alone (bench_kernels --only rac_select). One GPU, <= 580 s (TOTAL=<s> for less). The base tree: `git archive e886c3b`
# on the device, else carried: `git archive e886c3b quads benchmarks/bench_e2e.py | tar -x -C .base_tree` here and
# carry=[".base_tree"] (listed in .git/info/exclude).
# OUT=$OUT bash scripts/device_calls/2026-12-18_row_scale_split_runs.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 150) python3 -m pytest -q tests/test_quant_factored_gpu.py tests/test_kernels_w4a16.py \
  -k "(rac_sort_equals_count and (1024 or 208)) or row_scale or rollout_layers or gpu_grouped_real_size or in_a_cuda_graph or graph_matches_no_graph" \
  "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a16-1.0-True]" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 200) python3 $E2E --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
mkdir -p /tmp/base && { [ -d .base_tree/quads ] && cp -r .base_tree/. /tmp/base || git archive e886c3b quads benchmarks/bench_e2e.py | tar -x -C /tmp/base; } && (cd /tmp/base && \
  PYTHONPATH=. timeout $(cap 80) python3 $E2E --recipes w4a16 --json $OUT/e2e_base.json > $OUT/e2e_base.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_base.log)
mkdir -p /tmp/split && tar -c quads benchmarks/bench_e2e.py | tar -x -C /tmp/split && (cd /tmp/split && \
  sed -i 's/"k1024_sort": {"sort_run": 256, "select_warps": null, "select_rows": null, "split_runs": null}/"k1024_sort": {"sort_run": 128, "select_warps": null, "select_rows": null, "split_runs": true}/; s/"k256_sort": {"sort_run": null, "select_warps": null, "select_rows": 16, "split_runs": null}/"k256_sort": {"sort_run": 128, "select_warps": null, "select_rows": 16, "split_runs": true}/' quads/kernels/tuning.json && \
  grep -c '"split_runs": true' quads/kernels/tuning.json > $OUT/e2e_split.log && \
  PYTHONPATH=. timeout $(cap 90) python3 $E2E --recipes w4a4+rac50 --json $OUT/e2e_split.json >> $OUT/e2e_split.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_split.log)
timeout $(cap 200) python3 benchmarks/bench_kernels.py --only rac_select --json $OUT/rac_select.json > $OUT/rac_select.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/rac_select.log
tail -n 3 $OUT/gpu_tests.txt; grep -h "^rollout\|rc=" $OUT/e2e.log $OUT/e2e_base.log $OUT/e2e_split.log | cut -c1-160
grep -h "^timed" $OUT/rac_select.log | cut -c1-260; tail -n 1 $OUT/rac_select.log; true
