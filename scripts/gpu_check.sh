#!/usr/bin/env bash
# One device call that checks on the GPU what was built on the CPU since the last one, and meanwhile
# trains the chain warm-start sweep of the collapse experiment (issue 19) for the next call:
#   0. in the background: scripts/chain_warm_start.sh (STEPS_LIST SFT counts in parallel on the GPU, the
#      checkpoints kept in WARM_DIR outside $OUT, so that scripts/gpu_collapse.sh PICK=... in a call made
#      while the machine is still warm starts from them);
#   1. the GPU tests (TESTS), timing-insensitive, beside the sweep;
#   2. after the sweep has ended: the kernel benchmarks (KERNEL_SUITES at KERNEL_MS), the 1b rollout rows
#      (E2E_RECIPES, compiled step, CUDA graphs) and the 100m trainer step (plain vs compiled, BF16 vs
#      W4A16-QAT, interleaved), each with its own time limit.
# Run from the repo root on the GPU machine (image python3, no venv):  bash scripts/gpu_check.sh
# Writes $OUT/{summary.txt,check.tar.gz} (every log and JSON inside the tarball).
# Knobs: TESTS, TEST_TIMEOUT (240), SWEEP (1; 0: no warm-start sweep), STEPS_LIST (300,450,600), EVAL_AT
# (150,300,450), WARM_DIR (runs/chain-warm), SWEEP_OUT (runs/chain-ws: its logs and chain_warm_start.jsonl, for PICK), SWEEP_TIMEOUT (330), KERNEL_SUITES (w4a16,rac), KERNEL_MS
# (1,2,4,8,16,64), KERNEL_TIMEOUT (110; every part also stops by DEADLINE, 540 s from the start), E2E_RECIPES (bf16,w4a16,w4a4,w4a4+rac50), E2E_TIMEOUT (130),
# TRAINER (1; 0: skip the trainer rows; the 1b rows run when over 100 s are left), TRAINER_TIMEOUT (150), TRAINER_STEPS (20).
set -u -o pipefail
OUT=${OUT:-/tmp/quads_gpu_out}; mkdir -p "$OUT"
W=$(mktemp -d)  # everything goes here first, then into $OUT/check.tar.gz
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  git log -1 --format='commit %H %s' 2>/dev/null; } 2>&1 | tee "$W/env.txt"
t0=$(date +%s)
part() { echo "== $1 rc=$2 $(( $(date +%s) - t0 )) s" | tee -a "$W/env.txt"; }
DEADLINE=${DEADLINE:-540}  # seconds from the start by which every part has stopped (a device call allows 600)
lim() { local left=$(( DEADLINE - ($(date +%s) - t0) )); echo $(( left < $1 ? (left > 5 ? left : 5) : $1 )); }

NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
# two GPUs: the sweep and the tests on the last one, the timed parts on GPU 0 at once; one GPU: the sweep
# beside the tests, the timed parts after both
SIDE=$(( NGPU > 1 ? NGPU - 1 : 0 ))
if [ "${SWEEP:-1}" = 1 ]; then
  SWEEP_OUT=${SWEEP_OUT:-runs/chain-ws}; rm -rf "$SWEEP_OUT"
  CUDA_VISIBLE_DEVICES=$SIDE OUT=$SWEEP_OUT WARM_DIR=${WARM_DIR:-runs/chain-warm} STEPS_LIST=${STEPS_LIST:-300,450,600} \
    EVAL_AT=${EVAL_AT-150,300,450} JOBS_PER_GPU=3 timeout ${SWEEP_TIMEOUT:-330} bash scripts/chain_warm_start.sh \
    > "$W/sweep.log" 2>&1 &
  SWEEP_PID=$!
fi
TESTS=${TESTS:-tests/test_quant_factored_gpu.py tests/test_engine_gpu.py tests/test_kernels_w4a16.py tests/test_trainer_compile.py tests/test_pretrain.py}
run_tests() {
  CUDA_VISIBLE_DEVICES=$SIDE timeout $(lim ${TEST_TIMEOUT:-240}) python3 -m pytest $TESTS -q -rfE -p no:cacheprovider \
    > "$W/tests.log" 2>&1
  part tests $?
}
end_sweep() {
  if [ -n "${SWEEP_PID:-}" ]; then
    wait "$SWEEP_PID"; part sweep $?; SWEEP_PID=
    mkdir -p "$W/sweep" && cp "$SWEEP_OUT"/*.log "$SWEEP_OUT"/*.jsonl "$W/sweep/" 2>/dev/null
  fi
}
if [ "$NGPU" -gt 1 ]; then
  run_tests & TESTS_PID=$!
else
  run_tests; end_sweep
fi
export CUDA_VISIBLE_DEVICES=0
timeout $(lim ${KERNEL_TIMEOUT:-110}) python3 benchmarks/bench_kernels.py --only "${KERNEL_SUITES:-w4a16,rac}" \
  --ms "${KERNEL_MS:-1,2,4,8,16,64}" --json "$W/kernels.json" > "$W/kernels.log" 2>&1
part kernels $?
timeout $(lim ${E2E_TIMEOUT:-130}) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 \
  --long-tokens 0 --graphs on --compile on --recipes "${E2E_RECIPES:-bf16,w4a16,w4a4,w4a4+rac50}" \
  --json "$W/e2e_1b.json" > "$W/e2e.log" 2>&1
part e2e_1b $?
if [ "${TRAINER:-1}" = 1 ]; then
  timeout $(lim ${TRAINER_TIMEOUT:-150}) python3 benchmarks/bench_e2e.py --suites trainer --preset 100m --warmup 5 \
    --steps "${TRAINER_STEPS:-20}" --interleave step --trainer-compile off,on --json "$W/trainer_100m.json" \
    > "$W/trainer.log" 2>&1
  part trainer_100m $?
  # what is left of the call: the 1b trainer rows (the JSON is written row by row)
  [ $(lim 600) -gt 100 ] && { timeout $(lim 300) python3 benchmarks/bench_e2e.py --suites trainer --preset 1b --warmup 5 \
    --steps "${TRAINER_STEPS:-20}" --interleave step --trainer-compile off,on --json "$W/trainer_1b.json" \
    >> "$W/trainer.log" 2>&1; part trainer_1b $?; }
fi

[ -n "${TESTS_PID:-}" ] && wait "$TESTS_PID"
end_sweep
{ cat "$W/env.txt"; tail -15 "$W/tests.log"; grep -E '^(steps|  at step)' "$W/sweep.log" 2>/dev/null
  grep -v '^{"info"' "$W/kernels.log" | grep -v '^row \|^tune {' | tail -30
  grep -E '^rollout|Error' "$W/e2e.log" | tail -12; grep -E '^trainer|Error' "$W/trainer.log" 2>/dev/null | tail -8; } > "$OUT/summary.txt"
tar -czf "$OUT/check.tar.gz" -C "$W" . && du -sh "$OUT/check.tar.gz"
cat "$OUT/summary.txt"
