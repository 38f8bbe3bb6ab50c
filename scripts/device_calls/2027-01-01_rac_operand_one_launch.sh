#!/usr/bin/env bash
# Issue 17, W4A4 + RAC 50%'s activation operand in one launch a layer call (quads::rac_operand, a program per expert:
# amax, quantize, residual, selection, residual quantize; built 2026-12-07, CPU-tested under the interpreter) against
# the five launches it replaces (a zero fill, group_units' amax and quantize, rac_units' select and units). This call,
# most important first: its GPU tests (the same bits as the five launches at the 1b decode shapes; and group amax's),
# the 1b e2e rows bf16 / w4a4+rac50 of a copy whose tuning.json enables it (rac_operand.decode.enabled), then
# w4a4+rac50 of this tree (five launches), on one machine. One GPU, <= 580 s (TOTAL=<s> for less).
# Ran as run 67 (docs/PERF.md) on the tree of 94f15cd; quads.kernels.rac_operand was removed after runs 67-69 (slower
# than the five launches), so this needs `git checkout 94f15cd` to run again.
# OUT=$OUT bash scripts/device_calls/2027-01-01_rac_operand_one_launch.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt 2>&1
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 110) python3 -u -m pytest -q tests/test_quant_factored_gpu.py -k "one_launch or amax_by_group" \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
rm -rf /tmp/one && mkdir -p /tmp/one && tar -c quads benchmarks/bench_e2e.py | tar -x -C /tmp/one && (cd /tmp/one && \
  sed -i 's/"decode": {"enabled": false, "block_m"/"decode": {"enabled": true, "block_m"/' quads/kernels/tuning.json && \
  grep -c '"enabled": true' quads/kernels/tuning.json > $OUT/e2e_one.log && \
  PYTHONPATH=. timeout $(cap 270) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_one.json >> $OUT/e2e_one.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_one.log)
timeout $(cap 220) python3 -u $E2E --recipes w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed\|x bf16\|tok/s" $OUT/*.log $OUT/*.txt
true
