"""Copy the Inductor-generated files that define the named Triton kernels (by name prefix) out of a cache dir.

Run on the device after a compiled run with TORCHINDUCTOR_CACHE_DIR set:
``python3 scripts/device_calls/pick_inductor_kernels.py CACHE_DIR OUT_DIR PREFIX [PREFIX ...]``. Each match is
copied once (``<kernel name>.py``), and the largest wrapper module (``def call(``: the step's launch sequence) goes
to ``wrapper.py``, so that a profile's fused kernel names can be read back as code.
"""

import pathlib
import re
import shutil
import sys

cache, out, prefixes = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
out.mkdir(parents=True, exist_ok=True)
seen, wrappers = set(), []
for f in cache.rglob("*.py"):
    try:
        text = f.read_text()
    except (OSError, UnicodeDecodeError):
        continue
    if "def call(" in text:
        wrappers.append((len(text), f))
    for name in re.findall(r"^def (triton_\w+)\(", text, flags=re.M):
        if name not in seen and any(name.startswith(p) for p in prefixes):
            seen.add(name)
            shutil.copyfile(f, out / f"{name[:120]}.py")
if wrappers:
    shutil.copyfile(max(wrappers)[1], out / "wrapper.py")
print(f"{len(seen)} kernels, {len(wrappers)} wrappers")
