#!/usr/bin/env bash
# Issue 17, run 49: expert_routes with the token slots placed over each expert's own rows (after run 48's 9.3 us a
# call): its GPU tests and the kernel alone against the Inductor-compiled reference (bench_kernels --only routes).
# One GPU, <= 150 s.
# OUT=$OUT bash scripts/device_calls/2026-12-15_routes_kernel.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
T0=$(date +%s)
timeout 50 python3 -m pytest -q tests/test_expert_routes.py > $OUT/gpu_tests.txt 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout 90 python3 benchmarks/bench_kernels.py --only routes --json $OUT/routes.json > $OUT/routes.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/routes.log
tail -n 2 $OUT/gpu_tests.txt; grep "^row" $OUT/routes.log | cut -c1-330; tail -n 1 $OUT/routes.log; true
