"""No environment variable switches numerics or a backend: those are typed config fields, recorded in the run's
``config.yaml``. The library reads only conventional variables (its cache folder, torchrun's rank variables,
the visible GPUs); Triton's own ``TRITON_INTERPRET`` is read by Triton, never by quads."""

import re
from pathlib import Path

QUADS = Path(__file__).resolve().parents[1] / "quads"
READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*([^,)\]]*)""")  # the name argument, as written
CONVENTIONAL = {"QUADS_CACHE", "WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"}


def test_library_reads_no_switch_from_the_environment():
    reads = {}
    for path in sorted(QUADS.rglob("*.py")):
        for arg in READ.findall(path.read_text()):
            name = arg.strip().strip("\"'")  # a name held in a constant stays as written, and is not allowed
            reads.setdefault(name, []).append(str(path.relative_to(QUADS.parent)))
    assert reads, "the pattern found no environment read at all: it is broken"
    extra = {k: v for k, v in reads.items() if k not in CONVENTIONAL}
    assert not extra, f"environment switches in the library (make them typed config fields): {extra}"
