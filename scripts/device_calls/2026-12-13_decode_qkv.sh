#!/usr/bin/env bash
# Issue 17: the decode step's attention prologue (per-head q/k RMSNorm, RoPE, the new KV column) as one Triton kernel
# (quads.kernels.decode_qkv) in place of Inductor's fused kernels, which runs 20 and 41 timed at ~18 us a call each
# (two a layer: ~0.7 ms of a ~3-4 ms step in every recipe; run 31: 3 us). GPU tests (the kernel at the 1b shapes;
# graph = no graph, rescoring, one Dynamo graph with the op), the prologue alone (kernel vs the same operations
# compiled by Inductor, bench_kernels --only prologue), then the 1b e2e rows on this tree and on the tree before
# the kernel (777d584), same machine; this tree also brings the experts' sorted rows back by a gather. One H200, <= 400 s.
# OUT=$OUT bash scripts/device_calls/2026-12-13_decode_qkv.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 400 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
BASE=777d584ef8eb1ac09cde9df6eedc40377a56903a
timeout $(cap 125) python3 -m pytest -q tests/test_decode_qkv.py "tests/test_engine_gpu.py::test_graph_matches_no_graph[w4a4+rac50-1.0-True]" \
  tests/test_engine_gpu.py::test_triton_decode_attention_graph_compiled_and_rescored \
  > $OUT/gpu_tests.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 50) python3 benchmarks/bench_kernels.py --only prologue --json $OUT/bench_prologue.json > $OUT/bench_prologue.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_prologue.log
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on --recipes bf16,w4a16"
timeout $(cap 110) python3 $E2E --json $OUT/e2e.json > $OUT/e2e.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
mkdir -p /tmp/base && git archive $BASE | tar -x -C /tmp/base && (cd /tmp/base && PYTHONPATH=. timeout $(cap 110) python3 $E2E \
  --json $OUT/e2e_base.json > $OUT/e2e_base.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_base.log)
tail -n 3 $OUT/gpu_tests.txt; grep "^row\|decode prologue" $OUT/bench_prologue.log | tail -n 4
for f in e2e e2e_base; do echo $f; grep "^rollout" $OUT/$f.log; tail -n 1 $OUT/$f.log; done; true
