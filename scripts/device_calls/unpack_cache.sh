#!/usr/bin/env bash
# Unpack the compile caches a device call sent back (lib.sh's cache_pack: <files_at>/cache.tgz.00, .01, ...) into
# cache/ of this checkout (ignored), for a later call's `carry: ["cache"]`. Usage: bash scripts/device_calls/unpack_cache.sh <files_at>
set -euo pipefail
src=${1:?usage: unpack_cache.sh <files_at folder of a device call>}
ls "$src"/cache.tgz.* > /dev/null 2>&1 || { echo "no cache.tgz.* in $src (too large to come back? see cache_sizes.txt)"; exit 1; }
rm -rf cache && cat "$src"/cache.tgz.* | tar -xz
du -sh cache
