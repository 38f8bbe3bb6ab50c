#!/usr/bin/env bash
# Issues 17/18: every kernel of the 1b decode step after the attention prologue kernel (runs 44-45), per recipe:
# bench_e2e's profile suite with --profile-top 0 (name, calls a step, us a step; the compiled step in its graph), so
# that the next fusions are chosen from the whole list, not the top 15. One GPU, <= 420 s (TOTAL=<s> for less).
# OUT=$OUT bash scripts/device_calls/2026-12-14_anatomy.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); TOTAL=${TOTAL:-420}; left() { local l=$(( TOTAL - ($(date +%s) - T0) )); [ $l -lt 1 ] && l=1; echo $l; }  # timeout 0: none
for R in bf16 w4a16 w4a4+rac50; do
  timeout $(left) python3 benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes $R --graphs on \
    --compile on --profile-top 0 --json $OUT/profile_1b_$R.json > $OUT/profile_1b_$R.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile_1b_$R.log
done
for R in bf16 w4a16 w4a4+rac50; do
  python3 scripts/device_calls/print_profile.py $OUT/profile_1b_$R.json --top 12 2>&1 | head -n 16; tail -n 1 $OUT/profile_1b_$R.log
done; true
