#!/usr/bin/env bash
# Issues 18 / 17, one H200, <= 420 s from its start:
#   0. the toolchain the CUDA extension builds with (nvcc, ninja, CUDA_HOME);
#   1. the CUDA grouped W4A16 decode kernel (quads/kernels/csrc, w4a16_cuda.py): its first build (nvcc, sm_90)
#      and its GPU tests (decode bit for bit for every code and scale byte, GEMM against the references, graph);
#   2. bench_kernels' moe suite: Triton vs CUDA (each compiled config) vs torch._grouped_mm on the same weights;
#   3. the engine's GPU tests with the defaults adopted from runs 23-26 (decode_attention auto = Triton attention
#      on CUDA, the new grouped and dense W4A16 configs) and the attention kernel's.
# OUT=$OUT bash scripts/device_calls/2026-12-03_cuda_grouped_and_defaults.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
(which nvcc ninja c++; nvcc --version | tail -n 2; python3 -c "import torch.utils.cpp_extension as c; print('CUDA_HOME', c.CUDA_HOME)") \
  > $OUT/toolchain.txt 2>&1
T0=$(date +%s); left() { echo $(( 420 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 170) python3 -m pytest -q -x tests/test_kernels_w4a16_cuda.py > $OUT/gpu_tests_cuda.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_cuda.txt
timeout $(cap 90) python3 benchmarks/bench_kernels.py --only moe --json $OUT/bench_moe.json > $OUT/bench_moe.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_moe.log
timeout $(cap 160) python3 -m pytest -q tests/test_engine_gpu.py tests/test_decode_attention.py > $OUT/gpu_tests_engine.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_engine.txt
cat $OUT/toolchain.txt; tail -n 4 $OUT/gpu_tests_cuda.txt; grep -h "^grouped\|rc=" $OUT/bench_moe.log | cut -c1-150
python3 -c "
import json
for r in json.load(open('$OUT/bench_moe.json'))['rows']:
    print(r['bench'], r['shape'], r.get('cfg'), round(r.get('us', 0), 1), r.get('x_vs_bf16') and round(r['x_vs_bf16'], 2), r.get('x_vs_triton') and round(r['x_vs_triton'], 2), r.get('error', '')[:300])
" 2>&1 | tail -n 60; tail -n 3 $OUT/gpu_tests_engine.txt; true
