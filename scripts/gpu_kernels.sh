#!/usr/bin/env bash
# One device call: real-size kernel correctness tests, then every kernel benchmark.
# Run from the repo root on the GPU machine (image python3, no venv):  bash scripts/gpu_kernels.sh
# Writes $OUT/{env.txt,tests.log,bench.log,bench.json}; prints the short table last.
# Knobs: SUITES, BENCH_ARGS (e.g. --ms 1,4,16,64), TEST_K (pytest -k), TEST_TIMEOUT, BENCH_TIMEOUT.
set -u -o pipefail
OUT=${OUT:-/tmp/quads_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SUITES=${SUITES:-quantize,w4a16,moe,w4a4,sweep}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; 
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_kernels.py -q -x -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/tests.log" | tail -25
echo "tests: $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench_kernels.py --only "$SUITES" --json "$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - t1 )) s"
grep -v '^{"info"' "$OUT/bench.log" | grep -v '^row ' | tail -60
