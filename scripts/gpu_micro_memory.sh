#!/usr/bin/env bash
# GPU memory of one 100m chain run (CONFIG, configs/chain_100m.yaml) with whole mini-batches and with
# micro-batches (optim.micro_batch_size), in one device call of ~3 minutes on one GPU:
#   1. a short warm start: `quads pretrain` of the 100m preset on the chain (arithmetic level 8), SFT_STEPS
#      steps (200: enough for responses in the chain's format, which run to the 400-token cap or end; the
#      width of a step is its widest prompt + longest response, and the activations grow with it);
#   2. one `quads train` per MICRO value (none = whole mini-batches of 64, then 32, 16), all at once on the GPU,
#      STEPS (2) RL steps each with CONFIG's other settings (16 prompts x 8 samples, 2 mini-batches, bf16);
#      every step logs perf/max_mem_gib (torch.cuda.max_memory_allocated) and perf/max_reserved_gib (what
#      the caching allocator held), and nvidia-smi samples each process's GPU memory every second (the
#      CUDA context included: what RUN_GB of scripts/gpu_collapse.sh must cover);
#   3. $OUT/micro_memory.txt: one line per run (the largest step values, the longest response, nvidia-smi's
#      peak) and a JSON line; each run's metrics.jsonl and log beside it (the warm start and the run folders,
#      with their checkpoints, stay in WORK).
# Run from the repository root:  PYTHONPATH=. bash scripts/gpu_micro_memory.sh
# CPU dry run (a minute):  PRESET=tiny DEVICE=cpu SFT_STEPS=2 MICRO=none,2 \
#   EXTRA="--rollout.prompts-per-step 2 --rollout.n-samples 2 --rollout.max-new-tokens 16" bash scripts/gpu_micro_memory.sh
# Knobs (env): OUT (runs/micro-memory), WORK (runs/micro-memory-work), CONFIG, PRESET (100m), SFT_STEPS (200),
#   STEPS (2), MICRO (none,32,16), RECIPE (bf16), DEVICE (cuda), PY (python3), EXTRA (more `quads train` flags).
set -uo pipefail
OUT=${OUT:-runs/micro-memory}
WORK=${WORK:-runs/micro-memory-work}
CONFIG=${CONFIG:-configs/chain_100m.yaml}
PRESET=${PRESET:-100m}
SFT_STEPS=${SFT_STEPS:-200}
STEPS=${STEPS:-2}
MICRO=${MICRO:-none,32,16}
RECIPE=${RECIPE:-bf16}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
EXTRA=${EXTRA:-}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
T0=$(date +%s)
rm -rf "$WORK" && mkdir -p "$OUT" "$WORK" && rm -f "$OUT/pids.txt" "$OUT/smi.csv"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"; } | tee "$OUT/env.txt"

$PY -m quads.cli pretrain --task arithmetic --difficulty 8 --preset "$PRESET" --steps "$SFT_STEPS" --lr 1e-3 \
  --max-new-tokens 400 --eval-size 0 --device "$DEVICE" --cache-dir "$WORK/warm_start" --progress false \
  > "$OUT/pretrain.log" 2>&1
CKPT=$(sed -n 's/^\(trained\|cached\) checkpoint: //p' "$OUT/pretrain.log" | tail -1)
[ -n "$CKPT" ] && [ -f "$CKPT/config.json" ] || { echo "no warm start (see $OUT/pretrain.log)"; tail -5 "$OUT/pretrain.log"; exit 1; }
echo "warm start $CKPT after $(( $(date +%s) - T0 ))s"

SMI=
if command -v nvidia-smi > /dev/null && [ "$DEVICE" != cpu ]; then
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -l 1 > "$OUT/smi.csv" 2>/dev/null &
  SMI=$!
fi
PIDS=()
for m in ${MICRO//,/ }; do
  # shellcheck disable=SC2086  # EXTRA is a list of flags
  $PY -m quads.cli train --config "$CONFIG" --model.checkpoint "$CKPT" --recipe.name "$RECIPE" --device "$DEVICE" \
    --steps "$STEPS" --eval-every 0 --eval-n 8 --log.save-every 0 --optim.micro-batch-size "$m" \
    --out-dir "$WORK/run-$m" --quiet $EXTRA > "$OUT/run-$m.log" 2>&1 &
  PIDS+=("$!")
  echo "$! $m" >> "$OUT/pids.txt"
done
for p in "${PIDS[@]}"; do wait "$p" || echo "run pid $p failed: see $OUT/run-*.log"; done
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null
for m in ${MICRO//,/ }; do cp "$WORK/run-$m/metrics.jsonl" "$OUT/run-$m.metrics.jsonl" 2>/dev/null; done

$PY - "$OUT" <<'PY' | tee "$OUT/micro_memory.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
smi = {}
if (out / "smi.csv").is_file():
    for line in (out / "smi.csv").read_text().splitlines():
        try:
            pid, mib = (int(x) for x in line.split(","))
        except ValueError:
            continue
        smi[pid] = max(smi.get(pid, 0), mib)
rows = []
for line in (out / "pids.txt").read_text().splitlines():
    pid, m = line.split()
    path = out / f"run-{m}.metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    steps = [r for r in recs if "time/step_s" in r]
    top = lambda k: max((r[k] for r in steps if k in r), default=float("nan"))  # noqa: E731
    row = {"micro_batch_size": m, "steps": len(steps), "max_mem_gib": top("perf/max_mem_gib"),
           "max_reserved_gib": top("perf/max_reserved_gib"), "smi_peak_gib": smi.get(int(pid), 0) / 1024,
           "response_len_max": top("response/len_max"), "step_s": top("time/step_s")}
    rows.append(row)
    print(f"micro_batch_size {m:>4}: {row['steps']} steps, peak allocated {row['max_mem_gib']:.2f} GiB, reserved "
          f"{row['max_reserved_gib']:.2f} GiB, nvidia-smi {row['smi_peak_gib']:.2f} GiB; longest response "
          f"{row['response_len_max']:.0f} tokens; slowest step {row['step_s']:.1f} s")
print(json.dumps({"metric": "micro_memory", "runs": rows}))
PY
echo "done in $(( $(date +%s) - T0 ))s"
