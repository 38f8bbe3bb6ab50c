# The preamble of a device call (sourced): PYTHONPATH, $OUT, the Inductor and Triton caches under cache/ (they stay
# on a warm machine, so a later process or call skips the cold compiles), the call's time budget (TOTAL, default
# 580 s) with `cap <s>` = min(<s>, what is left, >= 1) for each step's timeout, and the card's name in $OUT/gpu.txt.
export PYTHONPATH=.; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=$PWD/cache/inductor TRITON_CACHE_DIR=$PWD/cache/triton
T0=$(date +%s); TOTAL=${TOTAL:-580}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
