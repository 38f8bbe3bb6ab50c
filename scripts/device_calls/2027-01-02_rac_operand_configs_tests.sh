#!/usr/bin/env bash
# Issue 17, after 2027-01-01_rac_operand_one_launch.sh on the same machine: the engine's GPU contract with the one-launch
# operand on (a copy whose tuning.json enables rac_operand.decode: graph replay = no graph, rescoring bit for bit,
# an in-place weight update reaching the captured graphs, for w4a4+rac50), then the W4A4 + RAC operands alone at the
# 1b decode shapes (bench_kernels --only rac: the five launches, the one launch per launch config, group_units'
# configs). One GPU, <= 580 s (TOTAL=<s> for less).
# OUT=$OUT bash scripts/device_calls/2027-01-02_rac_operand_configs_tests.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt 2>&1
rm -rf /tmp/one && mkdir -p /tmp/one && tar -c quads tests | tar -x -C /tmp/one && (cd /tmp/one && \
  sed -i 's/"decode": {"enabled": false, "block_m"/"decode": {"enabled": true, "block_m"/' quads/kernels/tuning.json && \
  grep -c '"enabled": true' quads/kernels/tuning.json > $OUT/gpu_tests_one.txt && \
  PYTHONPATH=. timeout $(cap 260) python3 -u -m pytest -q tests/test_engine_gpu.py -k "fused_qkv_graph and rac50" \
    >> $OUT/gpu_tests_one.txt 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_one.txt)
timeout $(cap 300) python3 -u benchmarks/bench_kernels.py --only rac --json $OUT/rac.json > $OUT/rac.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/rac.log
cat $OUT/gpu.txt; grep -h "rc=\|passed\|failed" $OUT/*.log $OUT/*.txt; grep -h "RAC 50" $OUT/rac.log
true
