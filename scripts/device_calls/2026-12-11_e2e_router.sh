#!/usr/bin/env bash
# Issue 17: the 1b e2e rows with the router's top-k fused by Inductor and RAC's two-launch sort path (the one-launch
# variant of run 42 reverted); run 42 was cut before the RAC row. One H200, <= 230 s; rows written one by one.
# OUT=$OUT bash scripts/device_calls/2026-12-11_e2e_router.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
timeout 225 python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a4+rac50,w4a16 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$?" >> $OUT/e2e.log; grep "^rollout" $OUT/e2e.log; tail -n 1 $OUT/e2e.log; true
