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
