#!/usr/bin/env bash
# Run 28 (the rest of run 27's budget, <= 150 s): the CUDA grouped kernel's build with run 27's compile error fixed
# (at::empty needs ATen/ATen.h), its GPU tests, the moe suite (Triton vs CUDA vs torch._grouped_mm), then the
# engine test that run 27 failed on its expected decode-path string (now with "+triton-attention").
# OUT=$OUT bash scripts/device_calls/2026-12-03_cuda_grouped_retry.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 150 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 75) python3 -m pytest -q -x tests/test_kernels_w4a16_cuda.py > $OUT/gpu_tests_cuda.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_cuda.txt
timeout $(cap 45) python3 benchmarks/bench_kernels.py --only moe --json $OUT/bench_moe.json > $OUT/bench_moe.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_moe.log
timeout $(cap 60) python3 -m pytest -q -x tests/test_engine_gpu.py -k "test_graph_matches_no_graph and (bf16-1.0-True or w4a16-0.0-True or w4a4+rac50-1.0-True)" \
  > $OUT/gpu_tests_engine.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_engine.txt
grep -h "passed\|failed\|error:\|rc=" $OUT/gpu_tests_cuda.txt | tail -n 6 | cut -c1-300
python3 -c "
import json
for r in json.load(open('$OUT/bench_moe.json'))['rows']:
    print(r['bench'][-4:], r['shape'][:40], r.get('cfg'), round(r.get('us', 0), 1), r.get('x_vs_bf16') and round(r['x_vs_bf16'], 2), r.get('x_vs_triton') and round(r['x_vs_triton'], 2), r.get('max_rel_vs_triton'), r.get('error', '')[-200:])
" 2>&1 | tail -n 50; tail -n 2 $OUT/gpu_tests_engine.txt; true
