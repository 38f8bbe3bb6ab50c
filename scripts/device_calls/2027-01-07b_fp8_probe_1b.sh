#!/usr/bin/env bash
# The FP8 GEMMs' accumulation measured (fp8_accum_probe.py), then the 1b rows bf16, fp8 with a longer cap than run 76
# (its fp8 compile outlasted 230 s). One GPU, <= 580 s. OUT=$OUT bash scripts/device_calls/2027-01-07b_fp8_probe_1b.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 90) python3 -u scripts/device_calls/fp8_accum_probe.py > $OUT/fp8_accum_probe.jsonl 2> $OUT/fp8_accum_probe.err
echo "rc=$?" >> $OUT/fp8_accum_probe.err
E2E="benchmarks/bench_e2e.py --suites rollout --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 480) python3 -u $E2E --preset 1b --recipes bf16,fp8 --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
cat $OUT/gpu.txt $OUT/fp8_accum_probe.jsonl; tail -3 $OUT/fp8_accum_probe.err; grep -h "rc=\|x bf16" $OUT/e2e_1b.log
true
