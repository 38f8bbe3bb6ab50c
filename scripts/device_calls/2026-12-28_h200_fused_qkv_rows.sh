#!/usr/bin/env bash
# Issue 17 on the card, in one call when machines are scarce: the 1b rows bf16 / w4a16 with the shared
# prefill (the default) and the q/k/v products as they are (--fuse-qkv off, the committed default), then the same
# rows with the fused q/k/v projection (--fuse-qkv on, each in its own process: a new compile of each model), then,
# with the time left, the fused path's GPU test (graph = no graph, rescoring, weight updates reaching the captured
# graphs). The Inductor and Triton caches under cache/ carry the compiles from one process to the next. One GPU,
# <= 580 s (TOTAL=<s>); OFF / ON=<recipes> narrow the rows of each (e.g. ON=w4a16 on a short budget: one cold compile less).
# OUT=$OUT bash scripts/device_calls/2026-12-28_h200_fused_qkv_rows.sh
. scripts/device_calls/lib.sh
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
for f in off on; do
  r=${OFF:-bf16,w4a16}; [ $f = on ] && r=${ON:-bf16,w4a16}
  timeout $(cap 250) python3 -u $E2E --fuse-qkv $f --recipes $r --json $OUT/e2e_fuse_$f.json > $OUT/e2e_fuse_$f.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_fuse_$f.log
done
timeout $(cap 200) python3 -m pytest -q tests/test_decode_qkv.py tests/test_engine_gpu.py -k "fused_qkv or decode_qkv" \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed\|x bf16" $OUT/*.txt $OUT/*.log
true
