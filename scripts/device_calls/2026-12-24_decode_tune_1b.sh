#!/usr/bin/env bash
# Issue 17, the W4A16 decode step on an H200 (runs 58-59: 2.08 vs BF16's 2.38 ms, 1.145x per step; with the shared
# prefill the tokens/s ratio is bounded by that; 1.2x needs ~0.1 ms off W4A16's step). The grouped kernel's decode
# config is one entry for every shape, tuned in run 23 (an H200, the kernel before the row gather and the row-scale
# epilogue). This call follows 2026-12-23_shared_prefill.sh on the same warm machine (its e2e_share_on rows are the
# "before"; the Inductor and Triton caches under cache/ are still there): the grouped kernel's sweep at the two 1b
# decode shapes (`--tune-moe-shapes 1b`: each shape's own n{N}_k{K}_decode entry, the shared one untouched), the
# table adopted in the device's copy, the bf16 / w4a16 rows again, then bf16 / w4a4+rac50 with the shared prefill.
# One GPU, <= 580 s (TOTAL=<s>). BEFORE=1 also runs the bf16 / w4a16 rows first (a cold machine).
# OUT=$OUT bash scripts/device_calls/2026-12-24_decode_tune_1b.sh
. scripts/device_calls/lib.sh
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
if [ -n "$BEFORE" ]; then
  timeout $(cap 230) python3 -u $E2E --recipes bf16,w4a16 --json $OUT/e2e_before.json > $OUT/e2e_before.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_before.log
fi
timeout $(cap 200) python3 -u benchmarks/bench_kernels.py --only tune --tune-kinds moe --tune-moe-shapes 1b \
  --workers 15 --tuning-out $OUT/tuning.json --json $OUT/tune.json > $OUT/tune.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/tune.log
if [ -s $OUT/tuning.json ]; then
  cp $OUT/tuning.json quads/kernels/tuning.json
  timeout $(cap 200) python3 -u $E2E --recipes bf16,w4a16 --json $OUT/e2e_after.json > $OUT/e2e_after.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_after.log
fi
timeout $(cap 330) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_rac50.json > $OUT/e2e_rac50.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_rac50.log
grep -h "rc=\|^rollout" $OUT/*.log; python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "tuning.json")
if os.path.exists(p):
    g = json.load(open(p))["w4a16_grouped_gemm"]
    print({k: v for k, v in g.items() if k.endswith("decode")})
PY
true
