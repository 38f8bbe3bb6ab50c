#!/usr/bin/env bash
# Issue 17: the 100m's 4-bit decode steps (run 37: W4A16 2.25 ms, W4A4 2.56, BF16 1.02; run 10: W4A16 1.09): where the
# extra ~1.2 ms a step goes, GPU time per kernel name (torch.profiler over the compiled step in its graph, and the eager
# step). One H200, <= 400 s.
# OUT=$OUT bash scripts/device_calls/2026-12-09_profile_100m.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s)
timeout 400 python3 benchmarks/bench_e2e.py --suites profile --preset 100m --profile-recipes w4a16,bf16 \
  --graphs on --compile on --json $OUT/profile_100m.json > $OUT/profile_100m.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_100m.log
python3 scripts/device_calls/print_profile.py $OUT/profile_100m.json --top 14 2>&1 | head -n 70; tail -n 1 $OUT/profile_100m.log; true
