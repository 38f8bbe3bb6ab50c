# The preamble of a device call (sourced): PYTHONPATH, $OUT, the Inductor, Triton and CUDA-extension caches under
# cache/ (they stay on a warm machine, so a later process or call skips the cold compiles), the call's time budget
# (TOTAL, default 580 s) with `cap <s>` = min(<s>, what is left, >= 1) for each step's timeout, and the card's name in
# $OUT/gpu.txt.
export PYTHONPATH=.; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=$PWD/cache/inductor TRITON_CACHE_DIR=$PWD/cache/triton
export TORCH_EXTENSIONS_DIR=$PWD/cache/torch_extensions  # the CUDA extensions' builds (~41 s each) with them
T0=$(date +%s); TOTAL=${TOTAL:-580}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
# `rac_select_backend <triton|cuda>`: tuning.json's rac_select cases all set to that selection backend;
# `tuning_set <kernel> <key> <json value>`: that key of every case of one kernel's entry (e.g. `tuning_set rac_operand
# backend '"cuda"'); `tuning_restore` puts back the file as this call found it (kept as /tmp/tuning_committed.json
# when lib.sh is sourced: $OUT sends back 8 files at most).
cp quads/kernels/tuning.json /tmp/tuning_committed.json
tuning_set() {
  python3 - "$1" "$2" "$3" <<'PY'
import json
import sys

p = "quads/kernels/tuning.json"
d = json.load(open(p))
for case in d[sys.argv[1]].values():
    case[sys.argv[2]] = json.loads(sys.argv[3])
json.dump(d, open(p, "w"), indent=1)
PY
}
rac_select_backend() { tuning_set rac_select select_backend "\"$1\""; }
tuning_restore() { cp /tmp/tuning_committed.json quads/kernels/tuning.json; }
# `cache_pack [parts]`: the compile caches under cache/ (Inductor, Triton) back as $OUT/cache.tgz.00, .01, ... (at most
# `parts` files of 15 MiB, default 3; none if they do not fit), their sizes in $OUT/cache_sizes.txt. Here,
# `bash scripts/device_calls/unpack_cache.sh <files_at>` puts them in cache/ (ignored); a later call that names
# "cache" in `carry` then finds them (Inductor and Triton key their caches on the code, versions and device, so
# what changed still compiles; each recipe's cold compile of the 1b model takes ~118 s, run 81).
cache_pack() {
  local parts=${1:-3}
  du -sk cache/* > "$OUT/cache_sizes.txt" 2>&1
  [ "$(left)" -gt 20 ] || return 0  # the packing's time (gzip of the caches) inside the call's budget
  tar -czf /tmp/cache.tgz cache 2>>"$OUT/cache_sizes.txt" || return 0
  ls -l /tmp/cache.tgz >> "$OUT/cache_sizes.txt"
  if [ "$(stat -c %s /tmp/cache.tgz)" -le $(( parts * 15 * 1048576 )) ]; then
    split -b 15m -d /tmp/cache.tgz "$OUT/cache.tgz."
  fi
  return 0
}
