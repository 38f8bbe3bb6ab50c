#!/usr/bin/env bash
# Issue 17, for a short device budget (~2-3 min): what one kernel boundary costs inside a CUDA graph, plain and with
# programmatic dependent launch (benchmarks/bench_graph_launch.py: chains of 256 tiny dependent kernels), the number
# behind the PDL design in docs/PERF.md (an expert GEMM reading its weights before griddepcontrol.wait); then, with
# the time left, the fused q/k/v projection's GPU test for bf16 (graph = no graph, rescoring, a weight update reaching
# the captured graphs). One GPU, <= 150 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2026-12-29_graph_launch_short.sh
TOTAL=${TOTAL:-150}; . scripts/device_calls/lib.sh
timeout $(cap 60) python3 -u benchmarks/bench_graph_launch.py --n 256 --json $OUT/graph_launch.json > $OUT/graph_launch.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/graph_launch.log
timeout $(cap 150) python3 -m pytest -q tests/test_engine_gpu.py -k "fused_qkv and bf16" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
cat $OUT/gpu.txt $OUT/graph_launch.log; tail -n 3 $OUT/gpu_tests.txt
true
