#!/usr/bin/env bash
# Issue 17 / 18: the W4A4 activation operand at decode as two parallel launches (group amax by atomic max, then
# the quantize over rows x column tiles) instead of one program per expert (run 31: 19.6 / 7.9 us per 1b
# gate_up / down call, ~0.55 ms of the W4A4 step). One H200, <= 540 s from its start:
#   1. the GPU bit-exactness tests of the operands (W4A4, dynamic and static RAC against the steps and the
#      reference) and the graph-replay tests of the sorted path (static RAC included);
#   2. bench_kernels' rac suite (group_units per launch config, the W4A4 and RAC 50% operands);
#   3. the 1b rollout, all five recipes (static RAC too) (the JSON is written row by row, so a cut call keeps the rows done).
# OUT=$OUT bash scripts/device_calls/2026-12-07_group_units.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 540 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 90) python3 -m pytest -q -x tests/test_quant_factored_gpu.py tests/test_quant_factored.py \
  -k "fused_rac_operands_bit_exact_cuda or sorted_linear_matches_fp32 or no_host_sync or packed_sorted_linear or units_kernel_is_bit_exact" > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout $(cap 90) python3 benchmarks/bench_kernels.py --only rac --json $OUT/bench_rac.json > $OUT/bench_rac.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_rac.log
timeout $(cap 360) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a16,w4a4,w4a4+rac50,w4a4+rac50-static --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
tail -n 2 $OUT/gpu_tests.txt; grep -h "rc=" $OUT/*.log; grep -h "x bf16" $OUT/e2e_1b.log | cut -c1-200
python3 -c "
import json
for r in json.load(open('$OUT/bench_rac.json'))['rows']:
    print(r['shape'], 'w4a4', round(r['w4a4_us'], 1), 'rac50', round(r['us'], 1), 'static', round(r['static_us'], 1), [(c, round(u, 1)) for c, u in r['group_units_cfg_us']])
" 2>&1 | tail -n 4; true
