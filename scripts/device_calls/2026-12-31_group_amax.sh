#!/usr/bin/env bash
# RAN as run 73 (2026-12-07, an H100): the per-group amax was slower in the 1b step (RAC 50% 3.33 against 3.02 ms) and
# was removed afterwards; this script needs the tree of 4e40e00 (before the removal), kept as the record.
# Issue 17, W4A4's activation operand: group_units' group amaxes by one program per group (amax_by="group", no
# atomics, no zero fill: one launch less a layer call; built 2026-12-07, CPU-tested, compiled offline, not yet timed)
# against the default (amax_by="row": a zero fill, then an atomic max per row). This call: its GPU test (the same bits
# as the default at the 1b decode shapes), the W4A4 (+RAC) operand
# kernels alone at the 1b decode shapes (bench_kernels --only rac: group_units per launch config, the "group" ones
# included), then the 1b e2e rows bf16 / w4a4+rac50 of this tree, then w4a4+rac50 of a copy whose tuning.json takes
# amax_by "group", on one machine. One GPU, <= 580 s (TOTAL=<s> for less). If the copy's row is faster, tuning.json's
# group_units.decode.amax_by becomes "group".
# OUT=$OUT bash scripts/device_calls/2026-12-31_group_amax.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 100) python3 -u -m pytest -q tests/test_quant_factored_gpu.py -k amax_by_group > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 150) python3 -u benchmarks/bench_kernels.py --only rac --json $OUT/rac.json > $OUT/rac.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/rac.log
timeout $(cap 250) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
mkdir -p /tmp/group && tar -c quads benchmarks/bench_e2e.py | tar -x -C /tmp/group && (cd /tmp/group && \
  sed -i 's/"amax_block_m": 4, "num_warps": 4, "amax_by": "row"}/"amax_block_m": 4, "num_warps": 4, "amax_by": "group"}/' \
    quads/kernels/tuning.json && grep -c '"amax_by": "group"' quads/kernels/tuning.json > $OUT/e2e_group.log && \
  PYTHONPATH=. timeout $(cap 200) python3 -u $E2E --recipes w4a4+rac50 --json $OUT/e2e_group.json >> $OUT/e2e_group.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_group.log)
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed\|x bf16\|tok/s" $OUT/*.log $OUT/*.txt
true
