#!/usr/bin/env bash
# Issues 17 / 18: the defaults adopted from runs 23-26 on one H200 (<= 420 s from its start):
#   0. GPU tests with them: the W4A16 kernels (the new dense and grouped decode configs), the engine's
#      GPU tests (decode_attention "auto" = Triton attention on CUDA now), the attention kernel;
#   1. bench_kernels' w4a16 and moe suites with the committed table (the issue's side-by-side numbers);
#   2. the 1b rollout rows, every recipe, the engine's defaults (compiled step, graphs, auto attention),
#      64 new tokens and 512 for bf16 / w4a16.
# OUT=$OUT bash scripts/device_calls/2026-12-03_new_defaults.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
# what a CUDA extension build would have here (nvcc, ninja, CUDA_HOME, headers), for the next kernel
(which nvcc ninja g++ c++; nvcc --version | tail -n 2; python3 -c "import torch.utils.cpp_extension as c; print('CUDA_HOME', c.CUDA_HOME)"; ls /usr/local/cuda/include/cuda_runtime.h; python3 -c "import ninja" && echo py-ninja) > $OUT/toolchain.txt 2>&1
T0=$(date +%s); left() { echo $(( 420 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 170) python3 -m pytest -q tests/test_kernels_w4a16.py tests/test_engine_gpu.py tests/test_decode_attention.py \
  > $OUT/gpu_tests.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 70) python3 benchmarks/bench_kernels.py --only w4a16,moe --json $OUT/bench_w4a16_moe.json \
  > $OUT/bench_w4a16_moe.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_w4a16_moe.log
timeout $(cap 200) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 512 \
  --long-recipes bf16,w4a16 --graphs on --compile on --recipes bf16,w4a16,w4a4+rac50,w4a4 \
  --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
tail -n 3 $OUT/gpu_tests.txt; grep -h "rc=" $OUT/bench_w4a16_moe.log; grep -h "x bf16\|rc=" $OUT/e2e_1b.log; true
