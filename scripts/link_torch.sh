#!/usr/bin/env bash
# Gives a new venv the main venv's torch without installing it again: hard links of the installed files
# (torch, functorch, torchgen, their dist-info and byte-compiled caches), so `pip install torch==...`
# after it only adds torch's small dependencies, and the set-up of .venv-vllm / .venv-verl skips the
# ~30 s of CPU that unpacking and byte-compiling torch cost each time (42 s -> 13 s wall measured). Does nothing (and the caller installs torch with pip) unless
# both venvs run the same Python, the main venv has torch $TORCH_VERSION, and the two folders are on one
# file system.
#   bash scripts/link_torch.sh MAIN_VENV NEW_VENV
set -uo pipefail
SRC=$1
DST=$2
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
[ -x "$SRC/bin/python" ] && [ -x "$DST/bin/python" ] || exit 0
"$DST/bin/python" -c "import torch" 2>/dev/null && exit 0
site() { "$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
S=$(site "$SRC") D=$(site "$DST")
[ "$(basename "$(dirname "$S")")" = "$(basename "$(dirname "$D")")" ] || exit 0  # the same pythonX.Y
have=$("$SRC/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null) || exit 0
[ "$have" = "$TORCH_VERSION" ] || exit 0
items=$(cd "$S" && ls -d torch functorch torchgen torch-"$TORCH_VERSION"*.dist-info 2>/dev/null)
for it in $items; do
  if ! cp -al "$S/$it" "$D/$it" 2>/dev/null; then  # another file system: leave it to pip
    for x in $items; do rm -rf "${D:?}/$x"; done
    exit 0
  fi
done
echo "[setup] $DST: torch $TORCH_VERSION linked from $SRC"
