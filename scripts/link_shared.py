"""Give a new venv some of the main venv's installed distributions without installing them again.

    python scripts/link_shared.py MAIN_VENV NEW_VENV NAME[==VERSION] ...

Hard links of the files each distribution's RECORD lists inside site-packages (its packages, its
dist-info, its byte-compiled caches), so that a later ``pip install`` finds it installed at that version
and unpacks and byte-compiles only what the new venv needs beyond it (torch, triton, pyarrow, sympy, ...
are the same files in .venv, .venv-vllm and .venv-verl). Files outside site-packages (console scripts,
whose first line names the main venv's python) are not linked: the new venv gets the library, not those
commands. A distribution the main venv lacks, holds at another version than ``==VERSION`` asks (a local
label such as ``+cpu`` aside), or the new venv already has, is skipped; when pip later wants another
version it replaces the links with its own files and leaves the main venv's alone. Does nothing unless both
venvs run the same Python and sit on one file system (then pip installs everything, as without it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def site_packages(venv: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def dist_info(site: Path, name: str) -> Path | None:
    for d in site.glob("*.dist-info"):
        if norm(d.name[: -len(".dist-info")].rsplit("-", 1)[0]) == norm(name):
            return d
    return None


def link(src: Path, dst: Path, info: Path) -> bool:
    """Hard-link ``info``'s RECORD files from ``src`` into ``dst``; on failure remove what was linked."""
    done: list[Path] = []
    for line in (info / "RECORD").read_text().splitlines():
        rel = line.split(",", 1)[0]
        if not rel or rel.startswith(("../", "/")):
            continue
        if not (src / rel).exists():
            continue
        target = dst / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                target.unlink()
            os.link(src / rel, target)
            done.append(target)
        except OSError:  # another file system: undo, leave it to pip
            for t in done:
                t.unlink(missing_ok=True)
            return False
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    main_venv, new_venv = Path(argv[0]), Path(argv[1])
    if not (main_venv / "bin" / "python").exists() or not (new_venv / "bin" / "python").exists():
        return 0
    src, dst = site_packages(main_venv), site_packages(new_venv)
    if src.parent.name != dst.parent.name:  # not the same pythonX.Y
        return 0
    linked = []
    for want in argv[2:]:
        name, _, pin = want.partition("==")
        info = dist_info(src, name)
        if info is None or dist_info(dst, name) is not None:
            continue
        version = info.name[: -len(".dist-info")].rsplit("-", 1)[1]
        if pin and pin not in (version, version.split("+")[0]):
            continue
        if link(src, dst, info):
            linked.append(f"{name}=={version}")
    if linked:
        print(f"[setup] {new_venv}: linked from {main_venv}: {' '.join(linked)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as e:  # an optimisation only: pip then installs everything
        print(f"[setup] link_shared: not linking ({type(e).__name__}: {e})")
        sys.exit(0)
