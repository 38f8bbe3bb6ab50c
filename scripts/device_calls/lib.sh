# The preamble of a device call (sourced): PYTHONPATH, $OUT, the Inductor and Triton caches under cache/ (they stay
# on a warm machine, so a later process or call skips the cold compiles), the call's time budget (TOTAL, default
# 580 s) with `cap <s>` = min(<s>, what is left, >= 1) for each step's timeout, and the card's name in $OUT/gpu.txt.
export PYTHONPATH=.; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=$PWD/cache/inductor TRITON_CACHE_DIR=$PWD/cache/triton
T0=$(date +%s); TOTAL=${TOTAL:-580}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
# `rac_select_backend <triton|cuda>`: tuning.json's rac_select cases all set to that selection backend (the committed
# file kept as $OUT/tuning_committed.json); `tuning_restore` puts the committed file back.
rac_select_backend() {
  cp quads/kernels/tuning.json "$OUT/tuning_committed.json"
  python3 - "$1" <<'PY'
import json
import sys

p = "quads/kernels/tuning.json"
d = json.load(open(p))
for case in d["rac_select"].values():
    case["select_backend"] = sys.argv[1]
json.dump(d, open(p, "w"), indent=1)
PY
}
tuning_restore() { cp "$OUT/tuning_committed.json" quads/kernels/tuning.json; }
