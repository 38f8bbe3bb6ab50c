#!/usr/bin/env bash
# Never ran: run 70 (the short form) measured the weights-first launch slower and it was removed after ea8343e;
# this script needs that tree.
# Issue 17's W4A16 row on the issue's card on the current default path (the shared prefill, the fused q/k/v
# projection; only run 58 before both: 1.114x), then the same rows with programmatic dependent launch: Inductor's
# (its kernels let the next one start early) and the grouped W4A16 kernel's weights-first launch (its weight slice
# prefetched into L2 before gdc_wait). First the GPU tests: vLLM's sorted expert path (tests/test_vllm_experts.py),
# the fused projection (bf16), and the weights-first launch's same bits in a graph; last, vLLM's quads experts one
# layer eager, loop against sorted, at the 1b shapes. One GPU, <= 580 s (TOTAL=<s>); it replaces
# 2027-01-02_h200_w4a16_vllm_experts.sh (whose RAC rows it leaves out: runs 64-69 measured them on this path).
# OUT=$OUT bash scripts/device_calls/2027-01-03_h200_w4a16_pdl.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 90) python3 -u -m pytest -q -x tests/test_kernels_w4a16.py tests/test_vllm_experts.py tests/test_engine_gpu.py \
  -k "weights_first or vllm or (fused_qkv and bf16) or sorted or which or amplifier" > $OUT/gpu_tests.txt 2>&1
RC=$?; echo "rc=$RC at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 200) python3 -u $E2E --recipes bf16,w4a16 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
if [ $RC = 0 ]; then  # the weights-first launch only after its test passed
  timeout $(cap 200) python3 -u $E2E --recipes bf16,w4a16 --inductor-pdl on --weights-first on --json $OUT/e2e_pdl.json > $OUT/e2e_pdl.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_pdl.log
fi
timeout $(cap 90) python3 -u benchmarks/bench_vllm_experts.py --preset 1b --tokens 128,2048 --json $OUT/vllm_experts.json > $OUT/vllm_experts.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/vllm_experts.log
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed\|x bf16\| T=" $OUT/*.log $OUT/*.txt
true
