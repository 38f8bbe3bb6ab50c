#!/usr/bin/env bash
# Issues 17 / 18: run 35 again (its raw files were lost before they were committed) and the dense CUDA candidate,
# in one call. One H200, <= 560 s from its start:
#   1. GPU tests: the operands (W4A4, dynamic and static RAC) and the sorted path's graph replay; the CUDA kernel's
#      tests (the one-expert stack against the dense reference, every config);
#   2. bench_kernels' rac suite (group_units per launch config, the W4A4 and RAC 50% operands, static RAC);
#   3. bench_kernels' w4a16 suite at M = 1, 4, 16, 64: cuBLAS, the Triton launcher, every CUDA config, same weights;
#   4. the 1b rollout, five recipes (static RAC too); the JSON is written row by row, so a cut call keeps the rows done.
# OUT=$OUT bash scripts/device_calls/2026-12-09_rerun_dense.sh
# Adopt where a CUDA config wins: tuning.json w4a16_dispatch.dense.cuda_max_m (0: off) and w4a16_grouped_cuda.dense.
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $OUT/tree.txt 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/tree.txt 2>&1
T0=$(date +%s); left() { echo $(( 560 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 80) python3 -m pytest -q -x tests/test_quant_factored_gpu.py tests/test_quant_factored.py \
  -k "fused_rac_operands_bit_exact_cuda or sorted_linear_matches_fp32 or no_host_sync or packed_sorted_linear or units_kernel_is_bit_exact" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 100) python3 -m pytest -q tests/test_kernels_w4a16_cuda.py > $OUT/gpu_tests_cuda.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_cuda.txt
timeout $(cap 70) python3 benchmarks/bench_kernels.py --only rac --json $OUT/bench_rac.json > $OUT/bench_rac.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_rac.log
timeout $(cap 130) python3 benchmarks/bench_kernels.py --only w4a16 --ms 1,4,16,64 --json $OUT/bench_w4a16.json \
  > $OUT/bench_w4a16.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_w4a16.log
timeout $(cap 300) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a16,w4a4,w4a4+rac50,w4a4+rac50-static --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
tail -n 2 $OUT/gpu_tests.txt $OUT/gpu_tests_cuda.txt; grep -h "rc=" $OUT/*.log; grep -h "x bf16" $OUT/e2e_1b.log | cut -c1-200
python3 -c "
import json
for r in json.load(open('$OUT/bench_rac.json'))['rows']:
    print(r['shape'], 'w4a4', round(r['w4a4_us'], 1), 'rac50', round(r['us'], 1), 'static', round(r['static_us'], 1), [(c, round(u, 1)) for c, u in r['group_units_cfg_us']])
for r in json.load(open('$OUT/bench_w4a16.json'))['rows']:
    print(r['bench'][-22:], r['shape'], r.get('cfg'), round(r.get('us', 0), 1), r.get('x_vs_bf16') and round(r['x_vs_bf16'], 2),
          r.get('x_vs_triton') and round(r['x_vs_triton'], 2), r.get('error', '')[-160:])
" 2>&1 | tail -n 100; true
