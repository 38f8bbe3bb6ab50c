#!/usr/bin/env bash
# The GPU tests of vLLM's sorted expert path (tests/test_vllm_experts.py: the same bits as quads' kernel path, the
# stored kernel layout updated in place) and of the fused projection (bf16); then issue 17 on the card, the
# current default path (shared prefill, fused q/k/v): the 1b rows bf16 / w4a16 (W4A16's 1.2x on an H200 is measured
# only before both: run 58, 1.114x); then vLLM's quads experts one layer in eager mode, loop against sorted
# (benchmarks/bench_vllm_experts.py, the 1b expert shapes), then, with the time left, the 1b rows bf16 / w4a4+rac50.
# One GPU, <= 580 s (TOTAL=<s>); a later form of 2026-12-30_h200_default_rows_tests.sh.
# OUT=$OUT bash scripts/device_calls/2027-01-02_h200_w4a16_vllm_experts.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 60) python3 -u -m pytest -q -x tests/test_vllm_experts.py tests/test_engine_gpu.py -k "vllm or (fused_qkv and bf16) or sorted or which or amplifier" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 200) python3 -u $E2E --recipes bf16,w4a16 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
timeout $(cap 90) python3 -u benchmarks/bench_vllm_experts.py --preset 1b --tokens 128,2048 --json $OUT/vllm_experts.json > $OUT/vllm_experts.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/vllm_experts.log
timeout $(cap 300) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_rac50.json > $OUT/e2e_rac50.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_rac50.log
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed\|x bf16\| T=" $OUT/*.log $OUT/*.txt
true
