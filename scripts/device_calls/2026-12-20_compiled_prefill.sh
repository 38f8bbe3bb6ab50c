#!/usr/bin/env bash
# Issue 17, the prefill (runs 53-55: ~11% of a 64-token 1b generation, ~150 eager kernels a layer in every recipe,
# W4A16 tokens/s 1.191-1.197x BF16 against 1.22x per decode step): the compiled prefill (RolloutEngine
# compile_prefill, one graph for every prompt width; CPU-tested on Dynamo's eager backend only). This call: its GPU
# tests (graph = no graph, rescoring bit for bit, two widths; every recipe), then the 1b rows bf16, w4a16 and
# w4a4+rac50 with --compile-prefill on, then bf16 and w4a16 with it off, on one machine. One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2026-12-20_compiled_prefill.sh
# If the tests pass and the rows are faster: rollout.compile_prefill true by default (config, engine, bench default).
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 200) python3 -u -m pytest -q tests/test_engine_gpu.py -k "compiled_prefill" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 250) python3 -u $E2E --compile-prefill on --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e_on.json \
  > $OUT/e2e_on.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_on.log
timeout $(cap 120) python3 -u $E2E --compile-prefill off --recipes bf16,w4a16 --json $OUT/e2e_off.json \
  > $OUT/e2e_off.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_off.log
tail -n 3 $OUT/gpu_tests.txt; grep -h "^rollout\|rc=" $OUT/e2e_on.log $OUT/e2e_off.log | cut -c1-190; true
