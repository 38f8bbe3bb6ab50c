#!/usr/bin/env bash
# Creates the project virtual environment and installs quads with its test and oracle extras.
# A machine whose python already has a CUDA build of torch keeps it (the venv sees system packages);
# elsewhere torch==2.13.0 (CPU) is installed first, so no multi-GB CUDA wheel is pulled in.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
has_cuda_torch=$("$PYTHON" - <<'PY' 2>/dev/null || echo no
import torch
print("yes" if torch.version.cuda else "no")
PY
)
if [ ! -x "$VENV/bin/python" ]; then
  if [ "$has_cuda_torch" = "yes" ]; then
    echo "[setup] CUDA torch found in $PYTHON: creating $VENV with system site-packages"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  $PIP install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
echo "[setup] installing quads[test,oracles,kernels]"
$PIP install -q -e ".[test,oracles,kernels]" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import quads, torch; print('[setup] quads', quads.__version__, 'torch', torch.__version__)"
