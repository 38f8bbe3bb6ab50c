#!/usr/bin/env bash
# Issue 17, the W4A16 prefill under the compiled prefill (run 57: bf16 8.5 ms, w4a16 10.2 ms, tokens/s 1.199x BF16;
# the fused grouped kernel at ~256 rows per expert ~104 / 62 us a layer against _grouped_mm's 56 / 41). This call:
# the fused kernel's launch configs at the 1b prefill shapes (bench_kernels --only moe_prefill), the fastest with
# the table config's bits adopted per shape (scripts/device_calls/adopt_prefill_configs.py, on this copy of
# tuning.json), then the 1b rows bf16 and w4a16 with --compile-prefill on (one process). One GPU, <= 540 s.
# OUT=$OUT bash scripts/device_calls/2026-12-21_prefill_configs_rows.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
T0=$(date +%s); TOTAL=${TOTAL:-540}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 200) python3 -u benchmarks/bench_kernels.py --only moe_prefill --json $OUT/moe_prefill.json \
  > $OUT/moe_prefill.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/moe_prefill.log
python3 scripts/device_calls/adopt_prefill_configs.py $OUT/moe_prefill.json > $OUT/adopted.txt 2>&1
timeout $(cap 330) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 \
  --long-tokens 0 --graphs on --compile on --compile-prefill on --recipes bf16,w4a16 --json $OUT/e2e.json \
  > $OUT/e2e.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
grep -h "^row\|rc=" $OUT/moe_prefill.log | cut -c1-260; cat $OUT/adopted.txt; grep -h "^rollout\|rc=" $OUT/e2e.log | cut -c1-150; true
