#!/usr/bin/env bash
# Issue 17, the fused q/k/v projection (RolloutEngine(fuse_qkv=True), off by default until this call): run 48's
# profile had the q, k and v products as three cuBLAS GEMMs a layer of one input (~12.6 us a layer on an H100, of the
# ~21 us of BF16 GEMMs every recipe shares), so one GEMM over the stacked weights should take ~0.1 ms off every
# recipe's decode step. This call (best after 2026-12-26_h200_shared_prefill_profile.sh on the same warm machine, for
# its compile caches): the GPU test of the fused path (graph = no graph, rescoring, weight updates reaching the
# captured graphs; bf16 / w4a16 / w4a4+rac50), then the 1b rows bf16 / w4a16 with it off and on, each in its own
# process. One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2026-12-27_fused_qkv.sh
. scripts/device_calls/lib.sh
timeout $(cap 200) python3 -m pytest -q tests/test_decode_qkv.py tests/test_engine_gpu.py -k "fused_qkv or decode_qkv" \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 3 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
for f in off on; do
  timeout $(cap 250) python3 -u $E2E --fuse-qkv $f --recipes bf16,w4a16 --json $OUT/e2e_fuse_$f.json > $OUT/e2e_fuse_$f.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_fuse_$f.log
done
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed\|x bf16" $OUT/*.txt $OUT/*.log
true
