#!/usr/bin/env bash
# Issues 17/18, run 50: the W4A16 experts' gating in the grouped kernel's epilogue (w4a16.grouped_gemm(gated=True)),
# the route weights applied after the per-token gather (no weighted [T*k, H] copy), decode attention's one split
# finished in its split kernel: GPU tests (the one-split finish, the gated kernel and the W4A16 rollout layers, graph =
# no graph for the compiled w4a16 / RAC steps), the 1b e2e rows of this tree (three recipes, one run) and of c725298
# (the tree before this session: bf16, w4a16) on the same machine, between them the gated kernel alone at several N
# tiles (bench_kernels --only gated). One GPU, <= 580 s
# (TOTAL=<s> for less).
# OUT=$OUT bash scripts/device_calls/2026-12-17_gated.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 120) python3 -m pytest -q tests/test_decode_attention.py \
  tests/test_kernels_w4a16.py -k "decode_attention or one_split or gated or rollout_layers or gpu_grouped_real_size or graph_matches_no_graph" \
  "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a16-1.0-True]" \
  "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a4+rac50-1.0-True]" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 240) python3 $E2E --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
timeout $(cap 90) python3 benchmarks/bench_kernels.py --only gated --json $OUT/gated.json > $OUT/gated.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gated.log
# the base tree: carried as .base_tree (git archive c725298 quads benchmarks/bench_e2e.py), else from the device's git
mkdir -p /tmp/base && { [ -d .base_tree/quads ] && cp -r .base_tree/. /tmp/base || git archive c725298724e00180f5510dc51732af2706d73299 | tar -x -C /tmp/base; } && (cd /tmp/base && \
  PYTHONPATH=. timeout $(cap 140) python3 $E2E --recipes bf16,w4a16 --json $OUT/e2e_base.json > $OUT/e2e_base.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_base.log)
tail -n 3 $OUT/gpu_tests.txt; grep -h "^rollout\|rc=" $OUT/e2e.log $OUT/e2e_base.log | cut -c1-160
grep -h "^timed\|rc=" $OUT/gated.log | cut -c1-260; true
