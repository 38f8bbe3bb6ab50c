"""One control group per sandboxed run: memory and process-count limits for the whole process tree.

``Cgroup.create(name, memory_bytes, max_pids)`` makes a child group of the calling process's own
group, on cgroup v2 (``memory.max``, ``memory.swap.max``, ``pids.max``) or, where the memory and pids
controllers are still on cgroup v1 hierarchies, one group in each (``memory.limit_in_bytes``,
``memory.memsw.limit_in_bytes``, ``pids.max``). A launcher joins it by writing its own pid to each
``procs_files()`` entry before it starts the sandbox, so every later process and thread is counted.
``destroy()`` kills whatever is still in the group (``cgroup.kill`` on v2, else SIGKILL to each listed
pid, repeated until empty) and removes the directories; it never raises.

``available()`` says why groups cannot be made here (None when they can): no cgroup file system,
controllers missing, or no permission (a non-root user needs a delegated group).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's group path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def _bases() -> tuple[str, list[Path]]:
    """("v1", [pids dir, memory dir]) or ("v2", [dir]) under which child groups are made."""
    own = _own_paths()
    v1 = [_ROOT / c / own[c].lstrip("/") for c in ("pids", "memory") if c in own]
    if len(v1) == 2 and all((d / "cgroup.procs").is_file() for d in v1):
        return "v1", v1
    if "" in own and (_ROOT / "cgroup.controllers").is_file():
        base = _ROOT / own[""].lstrip("/")
        ctrls = (base / "cgroup.controllers").read_text().split()
        missing = [c for c in ("memory", "pids") if c not in ctrls]
        if missing:
            raise OSError(f"cgroup v2 group {base} lacks the controllers {missing}")
        enabled = (base / "cgroup.subtree_control").read_text().split()
        if not {"memory", "pids"} <= set(enabled):
            (base / "cgroup.subtree_control").write_text("+memory +pids")
        return "v2", [base]
    raise OSError(f"no cgroup v2 at {_ROOT} with memory and pids controllers, nor v1 pids and memory hierarchies")


class Cgroup:
    def __init__(self, version: str, dirs: list[Path]):
        self.version, self.dirs = version, dirs

    @classmethod
    def create(cls, name: str, memory_bytes: int, max_pids: int) -> Cgroup:
        version, bases = _bases()
        dirs = [b / name for b in bases]
        made: list[Path] = []
        try:
            for d in dirs:
                d.mkdir()
                made.append(d)
            group = cls(version, dirs)
            if version == "v2":
                d = dirs[0]
                (d / "memory.max").write_text(str(memory_bytes))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(max_pids))
            else:
                pids_dir, mem_dir = dirs
                (pids_dir / "pids.max").write_text(str(max_pids))
                (mem_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
                if (mem_dir / "memory.memsw.limit_in_bytes").exists():
                    (mem_dir / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
            return group
        except BaseException:
            cls("", made).destroy()
            raise

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(out)

    def destroy(self, timeout_s: float = 2.0) -> bool:
        """Kill every process in the group and remove it; True when it is gone."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            if (d / "cgroup.kill").exists():
                try:
                    (d / "cgroup.kill").write_text("1")
                except OSError:
                    pass
        gone = True
        for d in self.dirs:
            while d.exists():
                for pid in self.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        gone = False
                        break
                    time.sleep(0.002)
        return gone


def available() -> str | None:
    """None when a group with memory and pids limits can be made here, else why not."""
    try:
        Cgroup.create(f"quads-probe-{os.getpid()}", 64 << 20, 8).destroy()
    except OSError as e:
        return f"cannot create a control group with memory and pids limits ({e})"
    return None
