#!/usr/bin/env bash
# Issue 18, the dense W4A16 GEMM target (M = 1..16 >= 2.5x cuBLAS BF16; run 26: the Triton kernels 1.11-1.22x):
# the CUDA grouped decode kernel (3.4-4.5 SASS instructions per weight against the Triton kernel's 7.1; split K across
# a block's warps made it 1.72-2.40x torch._grouped_mm at Qwen3's gate_up in run 30) on the dense weights as
# one-expert stacks (`W4A16Weight.as_stack`, ends = [M]). One H200, <= 300 s:
#   1. the CUDA kernel's GPU tests (the one-expert stack against the dense reference, every config);
#   2. bench_kernels' w4a16 suite at M = 1, 4, 16, 64: cuBLAS, the Triton launcher, every CUDA config, same weights.
# OUT=$OUT bash scripts/device_calls/2026-12-08_dense_cuda.sh
# Adopt where a CUDA config wins: tuning.json w4a16_dispatch.dense.cuda_max_m (0: off) and w4a16_grouped_cuda.dense.
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 300 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 120) python3 -m pytest -q tests/test_kernels_w4a16_cuda.py > $OUT/gpu_tests_cuda.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_cuda.txt
timeout $(cap 200) python3 benchmarks/bench_kernels.py --only w4a16 --ms 1,4,16,64 --json $OUT/bench_w4a16.json \
  > $OUT/bench_w4a16.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_w4a16.log
tail -n 2 $OUT/gpu_tests_cuda.txt; grep -h "rc=" $OUT/*.log
python3 -c "
import json
for r in json.load(open('$OUT/bench_w4a16.json'))['rows']:
    print(r['bench'][-22:], r['shape'], r.get('cfg'), round(r.get('us', 0), 1), r.get('x_vs_bf16') and round(r['x_vs_bf16'], 2),
          r.get('x_vs_triton') and round(r['x_vs_triton'], 2), r.get('error', '')[-160:])
" 2>&1 | tail -n 120; true
