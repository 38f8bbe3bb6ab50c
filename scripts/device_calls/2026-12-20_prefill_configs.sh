#!/usr/bin/env bash
# Issue 17, the W4A16 prefill (runs 53-55: its expert GEMMs on the fused tiled kernel, 104 / 62 us a layer at the 1b
# prefill against BF16 _grouped_mm's 56 / 41; tokens/s 1.191-1.197x BF16, the decode step 1.22x): the fused kernel's
# launch configs at the 1b prefill shapes (bench_kernels --only moe_prefill: the table's config, then
# MOE_PREFILL_CONFIGS), then, time left, the 1b rows bf16 and w4a16. One GPU, <= 240 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2026-12-20_prefill_configs.sh
# Adopt the fastest as tuning.json w4a16_grouped_gemm.prefill (or an n{N}_k{K}_prefill entry) and re-measure e2e.
export PYTHONPATH=.; mkdir -p $OUT
T0=$(date +%s); TOTAL=${TOTAL:-240}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 200) python3 -u benchmarks/bench_kernels.py --only moe_prefill --json $OUT/moe_prefill.json \
  > $OUT/moe_prefill.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/moe_prefill.log
[ $(left) -gt 90 ] && { timeout $(cap 200) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 \
  --new-tokens 64 --long-tokens 0 --graphs on --compile on --recipes bf16,w4a16 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log; }
grep -h "^row\|rc=" $OUT/moe_prefill.log | cut -c1-330; grep -h "^rollout\|rc=" $OUT/e2e.log 2>/dev/null | cut -c1-150; true
