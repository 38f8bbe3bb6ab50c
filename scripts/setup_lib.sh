# Sourced by the set-up scripts (setup_env.sh, setup_vllm_env.sh, setup_verl_env.sh).
# quiet CMD...: runs CMD (pip) with its "is ignored" notices filtered out and returns CMD's status, so that under
# `set -e` a failed install (a full disk, no network) stops the set-up there instead of surfacing later as a
# missing tool.
quiet() {
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  if [ -n "$out" ]; then printf '%s\n' "$out" | grep -v "is ignored" || true; fi
  return "$rc"
}
# upgrade_pip PIP...: pip's own upgrade, where a failure (no network to PyPI) leaves the venv's pip in use.
upgrade_pip() {
  quiet "$@" install -q --upgrade pip || echo "[setup] could not upgrade pip; going on with the venv's"
}
# need_disk MB DIR WHAT: stops with a clear message when DIR's file system has less than MB megabytes free.
# A full disk otherwise shows up later and elsewhere: as a failed pip install, or as tests erroring at set-up
# and "make: write error: stdout" (a fresh-clone CI run, 2026-12-07, with ~4 GB free). Sizes measured on a
# fresh clone (2026-12-07, x86_64): .venv 2.8 GB, .venv-vllm and .venv-verl 2.6 GB more (hard links into .venv
# counted once), the test suite's temp files and Inductor cache ~1.2 GB at their peak: ~7 GB for `make test`.
need_disk() {
  local free_mb
  free_mb=$(df -Pm "$2" 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ -n "$free_mb" ] && [ "$free_mb" -lt "$1" ]; then
    echo "[setup] not enough disk: $3 needs about $1 MB, and $(df -Pm "$2" | awk 'NR == 2 {print $6}')" \
         "(holding $2) has $free_mb MB free. Free some space (old clones, /tmp/torchinductor_*, ~/.cache/pip)" \
         "and run the command again." >&2
    return 1
  fi
}
