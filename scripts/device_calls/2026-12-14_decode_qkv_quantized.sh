#!/usr/bin/env bash
# Issue 17, run 45: the quantized 1b e2e rows that run 44 (2026-12-13_decode_qkv.sh) cut, on this tree and on 777d584
# (before the decode_qkv kernel and the experts' gather), same machine. One GPU, <= 480 s.
# OUT=$OUT bash scripts/device_calls/2026-12-14_decode_qkv_quantized.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on --recipes w4a16,w4a4+rac50"
T0=$(date +%s); timeout 235 python3 $E2E --json $OUT/e2e.json > $OUT/e2e.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
mkdir -p /tmp/base && git archive 777d584ef8eb1ac09cde9df6eedc40377a56903a | tar -x -C /tmp/base && cd /tmp/base && PYTHONPATH=. timeout 235 \
  python3 $E2E --json $OUT/e2e_base.json > $OUT/e2e_base.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_base.log
grep -h "^rollout\|rc=" $OUT/e2e.log $OUT/e2e_base.log
