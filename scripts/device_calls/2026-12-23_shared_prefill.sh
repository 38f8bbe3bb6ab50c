#!/usr/bin/env bash
# Issue 17, the shared prefill (RolloutEngine(share_prefill=True), the new default: each prompt prefilled once for
# its n samples, its KV cache rows copied; 16 prompt rows instead of 128 at the e2e shape). Runs 56-59 left W4A16 at
# 1.114x BF16 tokens/s on an H200 (1.199x on an H100) with the prefill 10.9 vs 8.2 ms, W4A4 + RAC 50% at 0.705x with
# a 22.6 ms prefill. This call: the GPU tests of the prefill graphs (shared and not) and of graph = no graph for
# every recipe on the default path, then the 1b rows with the shared prefill on and off, bf16 / w4a16 / w4a4+rac50
# (one process per setting: the same warm caches). One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2026-12-23_shared_prefill.sh
export PYTHONPATH=.; mkdir -p $OUT
T0=$(date +%s); TOTAL=${TOTAL:-580}; left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt 2>&1
timeout $(cap 200) python3 -m pytest -q -x tests/test_engine_gpu.py \
  -k "prefill_graph_matches or static_tokens_match or (graph_matches_no_graph and bf16) or weight_sync" \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
for sp in on off; do
  timeout $(cap 330) python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 \
    --long-tokens 0 --graphs on --compile on --share-prefill $sp --recipes bf16,w4a16,w4a4+rac50 \
    --json $OUT/e2e_share_$sp.json > $OUT/e2e_share_$sp.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_share_$sp.log
done
grep -h "rc=\|passed\|failed" $OUT/*.txt $OUT/*.log; python3 - <<'PY'
import json, os
for sp in ("on", "off"):
    p = os.path.join(os.environ["OUT"], f"e2e_share_{sp}.json")
    if os.path.exists(p):
        for r in json.load(open(p))["rows"]:
            print(sp, r["recipe"], r.get("prefill_rows"), r.get("decode_ms_per_step"), r.get("prefill_ms"),
                  r.get("tokens_per_s"), r.get("vs_bf16"), r.get("error"))
PY
true
