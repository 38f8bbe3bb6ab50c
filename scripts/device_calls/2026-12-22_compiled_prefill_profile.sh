#!/usr/bin/env bash
# Issue 17, the W4A16 row after the compiled prefill (runs 56-59: on an H200 W4A16 1.114x BF16 tokens/s, prefill 10.9
# vs 8.2 ms, decode step 2.08 vs 2.38 ms; the expert GEMMs explain ~0.6 ms of the prefill gap). This call: the profile
# suite for bf16 and w4a16 on the 1b (compiled step and prefill in graphs: where the prefill's GPU time goes, kernel
# by kernel, top_outside_decode_ms), then the cold-compile cost: w4a16's first generate with --compile-prefill off and
# on, each in its own process with an empty Inductor / Triton cache. One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2026-12-22_compiled_prefill_profile.sh
export PYTHONPATH=.; mkdir -p $OUT
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 300) python3 -u benchmarks/bench_e2e.py --suites profile --preset 1b --profile-recipes bf16,w4a16 \
  --graphs on --compile on --profile-top 25 --json $OUT/profile.json > $OUT/profile.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/profile.log
for cp in off on; do
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  timeout $(cap 130) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 1 --new-tokens 64 \
    --long-tokens 0 --graphs on --compile on --compile-prefill $cp --recipes w4a16 --json $OUT/cold_$cp.json \
    > $OUT/cold_$cp.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/cold_$cp.log
done
grep -h "rc=" $OUT/*.log; python3 - <<'PY'
import json, os
for f in ("cold_off", "cold_on"):
    p = os.path.join(os.environ["OUT"], f + ".json")
    if os.path.exists(p):
        for r in json.load(open(p))["rows"]:
            print(f, r.get("first_generate_s"), r.get("prefill_ms"), r.get("tokens_per_s"))
PY
true
