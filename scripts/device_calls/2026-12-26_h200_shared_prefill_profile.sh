#!/usr/bin/env bash
# Issue 17 on the card. Runs 60-62 (an H100, the shared prefill) put W4A16 at 1.21-1.23x BF16 tokens/s and
# W4A4 + RAC 50% at 0.79x; no H200 has run the shared prefill yet, and on run 58's H200 W4A16's decode step was 1.145x
# BF16's (2.08 vs 2.38 ms), which bounds its tokens/s ratio there. This call (an H200; on an H100 it is a repeat): the
# 1b rows bf16 / w4a16 with the shared prefill (the default), then the profile suite of the same two recipes (the
# compiled step in its graph, every kernel: what the ~1.35 ms of the step that both recipes share is made of, now
# that the expert GEMMs are ~35 us a layer), then, with the time left, bf16 / w4a4+rac50 rows. The Inductor and Triton
# caches under cache/ carry the compiles from one process to the next. One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2026-12-26_h200_shared_prefill_profile.sh
. scripts/device_calls/lib.sh
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 260) python3 -u $E2E --recipes bf16,w4a16 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
timeout $(cap 150) python3 -u benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes bf16,w4a16 \
  --graphs on --compile on --profile-top 0 --json $OUT/profile.json > $OUT/profile.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile.log
timeout $(cap 300) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_rac50.json > $OUT/e2e_rac50.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_rac50.log
cat $OUT/gpu.txt; grep -h "rc=\|x bf16" $OUT/*.log
true
