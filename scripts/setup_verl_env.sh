#!/usr/bin/env bash
# Creates .venv-verl: verl (from the package index) beside quads, for the verl plugin tests
# (tests/test_verl_plugin.py). A separate venv because verl pins transformers <5.11 and pulls ray,
# wandb, datasets, peft, hydra and tensordict, none of which quads needs; verl is never a core
# dependency of quads (the `verl` extra only names it).
#   bash scripts/setup_verl_env.sh [all|verl|quads]
# verl: the venv with verl (needs only torch and pyarrow in the main venv: `make test` starts it while quads'
# dependencies go in there); quads: then quads (after the main venv's `pip install -e .`: both write the same
# egg-info); all (default): both.
set -euo pipefail
STAGE=${1:-all}
case "$STAGE" in all|verl|quads) ;; *) echo "usage: $0 [all|verl|quads]; got $STAGE" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
VENV=${VENV_VERL:-.venv-verl}
VERL_VERSION=${VERL_VERSION:-0.9.1}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
. "$(dirname "$0")/setup_lib.sh"
# torch and the large libraries it shares with the main venv, as hard links (scripts/link_shared.py): pip
# then unpacks and byte-compiles only the rest; the first stage links what the main venv's torch stage put there
link() {
  "$PYTHON" scripts/link_shared.py "${VENV_MAIN:-.venv}" "$VENV" "$@"
}
if [ "$STAGE" != quads ]; then
  upgrade_pip $PIP
  link torch==2.13.0 pyarrow sympy networkx
  quiet $PIP install -q "torch==2.13.0"  # linked: only its dependencies
  if ! "$VENV/bin/python" -c "import verl" 2>/dev/null; then
    need_disk 1200 "$VENV" "verl's venv (0.9 GB, part of it hard links into .venv)"
    start=$(date +%s)
    quiet $PIP install -q "verl==$VERL_VERSION"
    echo "[setup-verl] pip install verl==$VERL_VERSION took $(( $(date +%s) - start )) s"
  fi
fi
if [ "$STAGE" != verl ]; then
  link torch==2.13.0 pyarrow sympy networkx matplotlib fonttools safetensors
  quiet $PIP install -q -e ".[test]"
  "$VENV/bin/python" -c "import verl, quads, transformers; print('[setup-verl] verl', verl.__version__, 'quads', quads.__version__, 'transformers', transformers.__version__)"
fi
