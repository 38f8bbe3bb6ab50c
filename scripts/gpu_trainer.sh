#!/usr/bin/env bash
# One device call for the trainer step (issue 22): the GPU tests of the trainer's batched experts and
# log-probs, then the trainer benchmark (BF16 and W4A16-QAT interleaved step by step in one process,
# 5 warm-up + 30 timed steps each, CUDA events) on 100m and 1b with the batched experts (the CUDA
# default), and on 100m with the expert loop for comparison; on 100m also a torch.profiler summary of
# one step per recipe (kernels, launches, host syncs, top ops) in the JSON. About 3-5 minutes; each part has its own
# time limit and writes its JSON as it goes.
# Run from the repo root on the GPU machine (image python3, no venv):  bash scripts/gpu_trainer.sh
# Writes $OUT/{env.txt,tests.log,trainer.log,trainer_100m.json,trainer_1b.json,trainer_100m_loop.json}.
# Knobs: TEST_TIMEOUT, T100M_TIMEOUT, T1B_TIMEOUT, LOOP_TIMEOUT, STEPS.
set -u -o pipefail
OUT=${OUT:-/tmp/quads_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv;
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)";
  git log -1 --format='commit %H %s' 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
part() { echo "== $1 rc=$2 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"; }

# (1) grouped vs loop on CUDA (CUTLASS vs cuBLAS), no host sync in the experts' forward + backward,
# the chunked log-probs, the benchmark's statistics
timeout ${TEST_TIMEOUT:-150} python3 -m pytest tests/test_trainer_experts.py tests/test_logprobs.py \
  tests/test_bench_e2e.py -m "not slow" -q -rfE -p no:cacheprovider > "$OUT/tests.log" 2>&1
part tests $?

# (2) trainer step, 64 x 128 tokens, BF16 vs W4A16-QAT interleaved, batched experts (auto = grouped on CUDA)
STEPS=${STEPS:-30}
timeout ${T100M_TIMEOUT:-120} python3 benchmarks/bench_e2e.py --suites trainer --preset 100m --warmup 5 \
  --steps "$STEPS" --interleave step --trainer-profile --json "$OUT/trainer_100m.json" > "$OUT/trainer.log" 2>&1
part trainer_100m $?
timeout ${T1B_TIMEOUT:-240} python3 benchmarks/bench_e2e.py --suites trainer --preset 1b --warmup 5 \
  --steps "$STEPS" --interleave step --json "$OUT/trainer_1b.json" >> "$OUT/trainer.log" 2>&1
part trainer_1b $?

# (3) the same on 100m with the per-expert loop (the reference path, host-synced), fewer steps
timeout ${LOOP_TIMEOUT:-120} python3 benchmarks/bench_e2e.py --suites trainer --preset 100m --warmup 3 \
  --steps 20 --interleave step --trainer-experts loop --trainer-profile --json "$OUT/trainer_100m_loop.json" >> "$OUT/trainer.log" 2>&1
part trainer_100m_loop $?
grep -h "^trainer" "$OUT/trainer.log" | tee -a "$OUT/env.txt"
