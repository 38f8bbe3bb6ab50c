#!/usr/bin/env bash
# RAC's selection as a CUDA kernel (quads.kernels.rac_select_cuda, 2026-12-07 (k)), on the tree with the W4A4 decode
# operand's group amaxes from the row maxima ((j), queue item 0): the CUDA selection's GPU tests (bit for bit against
# the Triton selection), the probe (the operand alone in a CUDA graph, both selections, each warp count), then the 1b
# rows in two processes: b) bf16, w4a4+rac50 with tuning.json's rac_select set to the CUDA selection with its units
# (cuda_fused; a copy of the file, restored after); a) bf16, w4a4, w4a4+rac50 on the committed tuning (the Triton selection; item 0's rows).
# One GPU, <= 580 s (TOTAL=<s>). OUT=$OUT TOTAL=570 bash scripts/device_calls/2027-01-09_rac_select_cuda.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 170) python3 -m pytest -q -p no:cacheprovider tests/test_rac_select_cuda.py > $OUT/gpu_tests_rac_cuda.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_rac_cuda.log
timeout $(cap 90) python3 -u scripts/device_calls/rac_select_cuda_probe.py > $OUT/probe.jsonl 2> $OUT/probe.err
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/probe.err
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
cp quads/kernels/tuning.json $OUT/tuning_committed.json
python3 - <<'PY'
import json
p = "quads/kernels/tuning.json"
d = json.load(open(p))
for case in d["rac_select"].values():
    case["select_backend"] = "cuda_fused"
json.dump(d, open(p, "w"), indent=1)
PY
cp quads/kernels/tuning.json $OUT/tuning_cuda_select.json
timeout $(cap 230) python3 -u $E2E --recipes bf16,w4a4+rac50 --json $OUT/e2e_1b_b_cuda_select.json > $OUT/e2e_1b_b_cuda_select.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_b_cuda_select.log
cp $OUT/tuning_committed.json quads/kernels/tuning.json
R=bf16,w4a4,w4a4+rac50
grep -q H200 $OUT/gpu.txt && R=bf16,w4a16,w4a4,w4a4+rac50  # on the issue's card W4A16's row too (queue item 1)
if [ "$(left)" -gt 120 ]; then
  timeout $(cap 300) python3 -u $E2E --recipes $R --json $OUT/e2e_1b_a.json > $OUT/e2e_1b_a.log 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b_a.log
fi
cat $OUT/gpu.txt; tail -n 3 $OUT/gpu_tests_rac_cuda.log; cat $OUT/probe.jsonl; tail -n 3 $OUT/probe.err
grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b_*.log | tail -n 16
true
