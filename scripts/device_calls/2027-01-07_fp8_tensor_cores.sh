#!/usr/bin/env bash
# The fp8 recipe's rollout on FP8 tensor cores (quads.quant.fp8_scaled: torch._scaled_mm / _scaled_grouped_mm over
# the kept E4M3 codes), first timing and its GPU tests. 1. tests/test_fp8_scaled.py (the kernels against the exact
# product, a graph replay, the stores); 2. the 1b rows bf16, fp8 (and w4a16 on an H200: the card) on the
# default path, 16 prompts x 8 samples, 64 new tokens, median of 2 after a warm-up, BF16 first in the process;
# 3. the engine's GPU contract for fp8 (graph = no graph, rescoring, weight sync without re-capture, no host sync,
# one Dynamo graph); 4. the 100m rows bf16, fp8. One GPU, <= 580 s (TOTAL=<s>).
# OUT=$OUT bash scripts/device_calls/2027-01-07_fp8_tensor_cores.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_capability())" >> $OUT/gpu.txt 2>&1
timeout $(cap 100) python3 -m pytest -q -p no:cacheprovider tests/test_fp8_scaled.py > $OUT/test_fp8_scaled.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/test_fp8_scaled.log
R=bf16,fp8; grep -q H200 $OUT/gpu.txt && R=bf16,fp8,w4a16
E2E="benchmarks/bench_e2e.py --suites rollout --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap ${CAP_1B:-230}) python3 -u $E2E --preset 1b --recipes $R --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py -k fp8 > $OUT/test_engine_gpu_fp8.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/test_engine_gpu_fp8.log
timeout $(cap 200) python3 -u $E2E --preset 100m --recipes bf16,fp8 --json $OUT/e2e_100m.json > $OUT/e2e_100m.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_100m.log
cat $OUT/gpu.txt; tail -n 3 $OUT/test_*.log; grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_*.log | head -30
true
