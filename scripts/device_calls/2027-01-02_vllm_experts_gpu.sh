#!/usr/bin/env bash
# vLLM's sorted expert path on a GPU, alone (the short form of 2027-01-02_h200_w4a16_vllm_experts.sh, for a session
# with little device time left): its GPU tests (tests/test_vllm_experts.py: the same bits as quads' kernel path, the
# stored kernel layout updated in place), then one layer in eager mode, loop against sorted
# (benchmarks/bench_vllm_experts.py, the 1b expert shapes). One GPU, <= 180 s (TOTAL=<s>).
# OUT=$OUT TOTAL=180 bash scripts/device_calls/2027-01-02_vllm_experts_gpu.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
timeout $(cap 80) python3 -u -m pytest -q tests/test_vllm_experts.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 100) python3 -u benchmarks/bench_vllm_experts.py --preset 1b --tokens 128,2048 --reps 10 --json $OUT/vllm_experts.json > $OUT/vllm_experts.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/vllm_experts.log
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed\| T=" $OUT/*.log $OUT/*.txt
true
