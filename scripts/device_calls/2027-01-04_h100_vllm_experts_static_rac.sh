#!/usr/bin/env bash
# Run 72 (2026-12-07, an H100 kept warm after run 71), as one call: queue item 0 (vLLM's sorted expert path on a GPU:
# its tests and bench, into $OUT/a), then, into $OUT/b, the fused q/k/v projection's bf16 GPU test and the 1b rows
# bf16 / w4a4+rac50-static (the static RAC order, last timed in run 40). The call ran this as one inline command
# (the same text); this file keeps it. One GPU, <= 540 s.
# OUT=$OUT bash scripts/device_calls/2027-01-04_h100_vllm_experts_static_rac.sh
mkdir -p $OUT/a $OUT/b; OUT=$OUT/a TOTAL=175 bash scripts/device_calls/2027-01-02_vllm_experts_gpu.sh
. scripts/device_calls/lib.sh; OUT=$OUT/b; T0=$(date +%s); TOTAL=300
timeout $(cap 110) python3 -u -m pytest -q tests/test_engine_gpu.py -k "fused_qkv and bf16" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 290) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a4+rac50-static --json $OUT/e2e_static.json > $OUT/e2e_static.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_static.log
grep -h "rc=\|passed\|failed\|x bf16" $OUT/*.log $OUT/*.txt
