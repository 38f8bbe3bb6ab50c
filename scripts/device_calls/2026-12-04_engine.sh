#!/usr/bin/env bash
# Issues 17/18, next device call: run 21 = the profile suite with the host's split (where the 1b prefill's
# 70-130 ms of wall time go: ATen ops, CUDA runtime calls, syncs, or Python between them) and run 22 = the 1b
# e2e rollout table again (run 18's command) with the one-copy prompt block (363d23c). One H200, <= 560 s.
# OUT=$OUT bash scripts/device_calls/2026-12-04_engine.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; nvidia-smi > $OUT/nvidia-smi.txt 2>&1
timeout 250 python3 benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes w4a16,bf16 --compile on \
  --json $OUT/profile_1b.json > $OUT/profile_1b.log 2>&1; echo "profile rc=$?" >> $OUT/profile_1b.log
timeout 290 python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a16,w4a4+rac50,w4a4 --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "e2e rc=$?" >> $OUT/e2e_1b.log
tail -n 4 $OUT/profile_1b.log $OUT/e2e_1b.log; true
