#!/usr/bin/env bash
# Issue 18, the one row of its table never re-timed since run 5: the W4A16 GEMM at M >= 1024 (target >= 0.9x cuBLAS
# BF16; run 5: 0.83x / 0.82x with the per-element decode). bench_kernels' w4a16 suite at M = 1024, 4096 on
# both shapes (cuBLAS BF16, FP8, the launcher's choice = dequantize_bf16 + cuBLAS above fused_max_m, the tiled kernel),
# then the 1b expert GEMMs at the prefill (dequant + _grouped_mm against the fused tiled kernel; bench_kernels
# --only moe_prefill), after the dense W4A16 GPU tests and the row-scale epilogue's (run 52 cut its tests at their cap: unbuffered now). One GPU, <= 300 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2026-12-19_w4a16_large_m.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-300}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 150) python3 -u -m pytest -q tests/test_kernels_w4a16.py -k "gpu_gemm_real or row_scale or rollout_layers" \
  > $OUT/gpu_tests_w4a16.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_w4a16.txt
timeout $(cap 150) python3 benchmarks/bench_kernels.py --only w4a16 --ms 1024,4096 --json $OUT/bench_w4a16.json \
  > $OUT/bench_w4a16.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_w4a16.log
timeout $(cap 70) python3 benchmarks/bench_kernels.py --only moe_prefill --json $OUT/bench_moe_prefill.json \
  > $OUT/bench_moe_prefill.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_moe_prefill.log
tail -n 2 $OUT/gpu_tests_w4a16.txt; grep -h "^row" $OUT/bench_moe_prefill.log; grep -h "rc=" $OUT/*.log
python3 -c "
import json
for r in json.load(open('$OUT/bench_w4a16.json'))['rows']:
    if r['bench'] == 'W4A16 GEMM':
        print(r['shape'], 'us', round(r['us'], 1), 'bf16', round(r['bf16_us'], 1), 'x', round(r['x_vs_bf16'], 3),
              'tiled', round(r['fused_us'], 1), 'fp8', round(r['fp8_us'], 1))
" 2>&1 | tail -n 40; true
