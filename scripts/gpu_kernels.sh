#!/usr/bin/env bash
# One device call: real-size kernel correctness tests (tests/test_kernels*.py), then every kernel benchmark.
# Run from the repo root on the GPU machine (image python3, no venv):  bash scripts/gpu_kernels.sh
# Writes $OUT/{env.txt,tests.log,bench.log,bench.json}; prints the short table last.
# Knobs: SUITES (add tune for the config sweep), BENCH_ARGS (e.g. --ms 1,4,16,64; with tune:
# --tuning-out $OUT/tuning.json), TEST_K (pytest -k), TEST_TIMEOUT, BENCH_TIMEOUT,
# PARALLEL_TESTS=1 (the tests run beside the benchmark; the "tune" suite compiles its configs
# meanwhile and waits for the tests to end before it times anything).
set -u -o pipefail
OUT=${OUT:-/tmp/quads_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SUITES=${SUITES:-quantize,w4a16,moe,w4a4}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
run_tests() {
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_kernels.py tests/test_kernels_w4a16.py -q -x -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.log" 2>&1
  echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/tests.log"; touch "$OUT/tests.done"
}
if [ "${PARALLEL_TESTS:-0}" = 1 ]; then
  run_tests & export TUNE_WAIT="$OUT/tests.done"
else
  run_tests
fi
t1=$(date +%s)
timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench_kernels.py --only "$SUITES" --json "$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - t1 )) s"
wait
tail -4 "$OUT/tests.log"; rm -f "$OUT/tests.done"
grep -v '^{"info"' "$OUT/bench.log" | grep -v '^row \|^tune {' | tail -40
