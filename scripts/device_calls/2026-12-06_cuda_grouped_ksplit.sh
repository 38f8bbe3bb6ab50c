#!/usr/bin/env bash
# Issues 18 / 17, next call for the CUDA grouped W4A16 decode kernel (one H200, <= 560 s from its start):
#   1. its GPU tests (the new split-K instantiations beside runs 28-29's: decode bit for bit, identity rows, GEMM
#      against the reference, graph replay after a weight refresh);
#   2. bench_kernels' moe suite: Triton vs every CUDA config vs torch._grouped_mm on the same weights;
#   3. the 1b rollout (bf16, w4a16, w4a4+rac50) with the committed table (Triton), then, in this device copy only,
#      tuning.json's grouped decode backend set to cuda with the config fastest over 1b gate_up + down in step 2,
#      and the rollout again: a same-machine A/B of the backend.
# OUT=$OUT bash scripts/device_calls/2026-12-06_cuda_grouped_ksplit.sh
# Adopt by committing backend "cuda" and that config to quads/kernels/tuning.json if the rollout says so.
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 560 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
timeout $(cap 120) python3 -m pytest -q tests/test_kernels_w4a16_cuda.py > $OUT/gpu_tests_cuda.txt 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_cuda.txt
timeout $(cap 120) python3 benchmarks/bench_kernels.py --only moe --json $OUT/bench_moe.json > $OUT/bench_moe.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench_moe.log
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on --recipes bf16,w4a16,w4a4+rac50"
timeout $(cap 140) python3 $E2E --json $OUT/e2e_triton.json > $OUT/e2e.log 2>&1; echo "triton rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
python3 - "$OUT" > $OUT/cuda_pick.txt 2>&1 <<'PY'
import json, sys
rows = json.load(open(sys.argv[1] + "/bench_moe.json"))["rows"]
t = {}
for r in rows:
    if r["bench"] == "grouped MoE W4A16 cuda" and "us" in r and r["shape"].startswith("1b "):
        t.setdefault(tuple(r["cfg"]), []).append(r["us"])
best = min((sum(v), c) for c, v in t.items() if len(v) == 2)[1]
tab = json.load(open("quads/kernels/tuning.json"))
tab["w4a16_grouped_gemm"]["decode"]["backend"] = "cuda"
tab["w4a16_grouped_gemm"]["prefill"]["backend"] = "cuda"  # W4A4 + RAC's stacked rows (2 x 1,024 at the 1b decode)
tab["w4a16_grouped_cuda"]["decode"] = {**dict(zip(("ng", "nt", "warps", "ksplit"), best)), "nt": None}  # per call
json.dump(tab, open("quads/kernels/tuning.json", "w"), indent=1)
print("cuda decode config", best, "1b gate_up + down us", round(sum(t[best]), 1))
PY
if grep -q "cuda decode config" $OUT/cuda_pick.txt; then
  timeout $(cap 140) python3 $E2E --json $OUT/e2e_cuda.json >> $OUT/e2e.log 2>&1; echo "cuda rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e.log
  git checkout quads/kernels/tuning.json
fi
tail -n 2 $OUT/gpu_tests_cuda.txt; cat $OUT/cuda_pick.txt; grep -h "x bf16\|rc=" $OUT/e2e.log
python3 -c "
import json
for r in json.load(open('$OUT/bench_moe.json'))['rows']:
    print(r['bench'][-4:], r['shape'][:40], r.get('cfg'), round(r.get('us', 0), 1), r.get('x_vs_bf16') and round(r['x_vs_bf16'], 2), r.get('x_vs_triton') and round(r['x_vs_triton'], 2), r.get('error', '')[-200:])
" 2>&1 | tail -n 80; true
