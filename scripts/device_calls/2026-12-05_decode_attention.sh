#!/usr/bin/env bash
# Issue 17: decode attention that reads only the written KV-cache columns (quads.kernels.decode_attention,
# RolloutEngine(decode_attention="triton")), first GPU call. One H200, <= 560 s:
#   1. GPU tests: the kernel at the 1b sizes against fp64 and as the compiled custom op; the engine's
#      compiled + graphed step with it (graph = no graph, one Dynamo graph, rescoring bit for bit);
#   2. bench_kernels' attention suite: the kernel against the engine's SDPA call over the whole cache,
#      1b and 100m shapes, caches of 128 / 544 / 4096 columns at several written lengths;
#   3. the 1b rollout, bf16 and w4a16 with SDPA and with Triton attention at 64 new tokens, bf16 at 512 too.
# OUT=$OUT bash scripts/device_calls/2026-12-05_decode_attention.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
T0=$(date +%s); left() { echo $(( 560 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 120) python3 -m pytest -q tests/test_decode_attention.py tests/test_engine_gpu.py -k "decode_attention or triton" \
  > $OUT/gpu_tests.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 90) python3 benchmarks/bench_kernels.py --only attention --json $OUT/attention.json > $OUT/attention.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/attention.log
timeout $(cap 340) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 512 \
  --long-recipes bf16 --graphs on --compile on --recipes bf16,w4a16 --decode-attention sdpa,triton \
  --json $OUT/e2e_attention_1b.json > $OUT/e2e_attention_1b.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_attention_1b.log
tail -n 3 $OUT/gpu_tests.txt; grep -h "decode attention\|rc=" $OUT/attention.log | tail -n 22; grep -h "^rollout\|rc=" $OUT/e2e_attention_1b.log; true
