"""Run untrusted Python (model-written code) in a separate, limited process. Best effort, no containers.

``run_python(code, ...)`` starts ``python -I -S -c BOOTSTRAP`` in a new session (its own process
group) with an empty environment (``PATH`` only) and a fresh private temp folder as its cwd. The
bootstrap runs before any user code and, in this order:

1. sets resource limits: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space),
   ``RLIMIT_NPROC`` (no new processes for unprivileged users; root ignores it), ``RLIMIT_FSIZE``
   (largest file, so also the stdout/stderr files: output cap), ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``;
2. when running as root, moves itself into a new, empty network namespace (``unshare(CLONE_NEWNET)``
   through libc): no interface but a down loopback, so no connection can leave or reach the host;
3. replaces ``socket.socket`` / ``socket.create_connection`` and friends with stubs that raise;
4. installs an audit hook (``sys.addaudithook``, which user code cannot remove) that denies: sockets,
   ``subprocess``, ``os.system`` / ``exec*`` / ``spawn*`` / ``posix_spawn`` / ``fork`` / ``forkpty``,
   ``os.kill``, ``ctypes`` (which could call libc directly), any ``open`` of ``/proc`` or ``/sys``
   (the parent's ``/proc/PID/environ``), and any open for writing, remove, rename, mkdir, chmod ...
   of a path outside the temp folder;
5. clears ``sys.argv`` and runs the user code (``compile`` + ``exec`` as ``__main__``), then, when
   ``tests`` are given, calls the named function on each input and prints the results as one JSON
   line tagged with a random nonce. A program that exits early (``sys.exit``, ``os._exit``) never
   prints that line, so it cannot pass.

The parent enforces the wall-clock limit (``os.killpg(SIGKILL)`` of the whole group, also after a
normal exit), reads at most ``max_output_bytes`` of each stream and removes the temp folder.
Limits that are set in the bootstrap rather than in ``preexec_fn``: the trainer process is
multi-threaded (torch), where ``preexec_fn`` can deadlock; no user code runs before the bootstrap,
so the effect is the same.

What is not guaranteed: this is not a security boundary against a deliberately malicious program.
Without namespaces other than the network one (and without it when not root), a program can still
read any file the user can read (except ``/proc`` and ``/sys``), can find the nonce by frame
introspection, and CPython audit hooks have known bypasses. It is meant to contain the mistakes
and accidents of model-written code: loops, fork bombs, memory hogs, floods of output, stray writes
and network calls, and to keep the trainer's secrets (environment variables) out of reach.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BOOTSTRAP = r'''
import json, os, resource, sys
_cfg = json.loads(sys.argv[1])
_work = _cfg["work"]
for _name, _soft in (("RLIMIT_CPU", _cfg["cpu"]), ("RLIMIT_AS", _cfg["mem"]), ("RLIMIT_FSIZE", _cfg["fsize"]),
                     ("RLIMIT_NOFILE", _cfg["nofile"]), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", _cfg["nproc"])):
    _hard = _soft + 1 if _name == "RLIMIT_CPU" else _soft
    resource.setrlimit(getattr(resource, _name), (_soft, _hard))
if os.geteuid() == 0 and _cfg["netns"]:
    import ctypes
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
        print("sandbox: unshare(CLONE_NEWNET) failed", file=sys.stderr)
import socket, _socket
def _no_network(*a, **k):
    raise PermissionError("sandbox: network access is not allowed")
for _mod in (socket, _socket):
    for _attr in ("socket", "socketpair", "create_connection", "create_server", "fromfd", "getaddrinfo"):
        if hasattr(_mod, _attr):
            setattr(_mod, _attr, _no_network)
_DENY = ("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
         "os.forkpty", "os.kill", "os.killpg", "os.setuid", "os.setgid", "os.chroot", "ctypes.",
         "_posixsubprocess", "pty.", "os.startfile", "signal.pthread_kill", "resource.setrlimit",
         "resource.prlimit", "sys.remote_exec", "os.add_dll_directory")
_PATH_EVENTS = {"os.remove": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.rmdir": (0,), "os.chmod": (0,),
                "os.chown": (0,), "os.link": (0, 1), "os.symlink": (0, 1), "os.truncate": (0,),
                "os.utime": (0,), "os.chflags": (0,), "os.lchown": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
                "shutil.rmtree": (0,), "shutil.move": (0, 1), "shutil.copyfile": (1,),
                "shutil.copytree": (1,), "os.chdir": (0,)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_real, _fsdecode = os.path.realpath, os.fsdecode
def _inside(path):
    if isinstance(path, int):
        return True
    p = _real(_fsdecode(path))
    return p == _work or p.startswith(_work + os.sep)
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        p = _real(_fsdecode(path))
        if p in ("/proc", "/sys") or p.startswith(("/proc/", "/sys/")):
            raise PermissionError(f"sandbox: reading {p} is not allowed")
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(p):
            raise PermissionError(f"sandbox: writing outside the sandbox folder is not allowed ({p})")
    elif event in _PATH_EVENTS:
        for i in _PATH_EVENTS[event]:
            if i < len(args) and args[i] is not None and not isinstance(args[i], int) and not _inside(args[i]):
                raise PermissionError(f"sandbox: {event} outside the sandbox folder is not allowed")
sys.addaudithook(_hook)
def _main(cfg=_cfg):
    nonce, tests, func = cfg["nonce"], cfg["tests"], cfg["func"]
    with open("solution.py") as f:
        source = f.read()
    sys.argv[:] = ["solution.py"]
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        print(nonce + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    try:
        exec(code, ns)
    except SystemExit as e:
        if tests is not None:
            print(nonce + json.dumps({"error": f"the program exited (SystemExit({e.code!r})) before the tests"}),
                  flush=True)
        raise
    if tests is None:
        return
    import ast
    fn = ns.get(func)
    if not callable(fn):
        print(nonce + json.dumps({"error": f"no function named {func!r} defined"}), flush=True)
        return
    results = []
    for args in ast.literal_eval(tests):
        try:
            results.append(["ok", repr(fn(*args))])
        except BaseException as e:
            results.append(["error", f"{type(e).__name__}: {e}"[:200]])
    print(nonce + json.dumps({"results": results}), flush=True)
del _cfg
_main()
'''


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did. ``ok`` means exit code 0 and no limit was hit."""

    ok: bool
    stdout: str  # at most max_output_bytes, decoded with errors replaced
    stderr: str  # at most max_output_bytes, decoded with errors replaced
    exit_code: int | None  # negative: killed by that signal; None: the sandbox could not start
    reason: str  # "ok", "timeout (wall 2.0 s)", "cpu time limit", "output limit", "exit code 1: ..." ...
    duration: float  # wall seconds
    test_results: list[tuple[str, str]] | None = field(default=None)  # ("ok", repr) / ("error", msg) per test
    test_error: str | None = None  # why the tests did not run (syntax error, early exit, missing function)


@dataclass(frozen=True)
class SandboxLimits:
    cpu_time_s: int = 2  # RLIMIT_CPU seconds (SIGXCPU kills the process past it)
    wall_time_s: float = 5.0  # wall clock before the whole process group gets SIGKILL
    memory_mb: int = 512  # RLIMIT_AS in MiB (the interpreter itself needs ~30 MiB)
    max_output_bytes: int = 65536  # RLIMIT_FSIZE: cap of stdout, stderr and any file written
    max_processes: int = 0  # RLIMIT_NPROC (counts all processes of the real user; root ignores it)
    max_open_files: int = 64  # RLIMIT_NOFILE
    network_namespace: bool = True  # as root, unshare(CLONE_NEWNET) before user code

    def __post_init__(self):
        if self.cpu_time_s < 1 or self.wall_time_s <= 0:
            raise ValueError(f"cpu_time_s must be >= 1 and wall_time_s > 0, got {self.cpu_time_s}, {self.wall_time_s}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (the interpreter needs ~30 MiB), got {self.memory_mb}")
        if self.max_output_bytes < 1024 or self.max_processes < 0 or self.max_open_files < 16:
            raise ValueError("max_output_bytes must be >= 1024, max_processes >= 0 and max_open_files >= 16")


def _read_head(path: Path, limit: int) -> tuple[str, int]:
    size = path.stat().st_size if path.exists() else 0
    with open(path, "rb") as f:
        data = f.read(limit)
    return data.decode("utf-8", errors="replace"), size


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(
    code: str,
    *,
    tests: list[tuple[Any, ...]] | None = None,
    func: str = "f",
    stdin: str = "",
    cpu_time_s: int = 2,
    wall_time_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    max_processes: int = 0,
    limits: SandboxLimits | None = None,
) -> SandboxResult:
    """Run ``code`` in a sandboxed interpreter; with ``tests``, call ``func(*args)`` for each args tuple.

    ``tests`` are argument tuples of Python literals (ints, strings, lists ...); each result comes back
    as ``("ok", repr(value))`` or ``("error", "TypeError: ...")`` in ``test_results``. Never raises
    for anything the code does; a ValueError only for bad limits or non-literal test inputs.
    """
    lim = limits or SandboxLimits(cpu_time_s, wall_time_s, memory_mb, max_output_bytes, max_processes)
    tests_src = None
    if tests is not None:
        tests_src = repr([tuple(t) for t in tests])
        ast.literal_eval(tests_src)  # ValueError now, not in the child, for non-literal inputs
    nonce = "@@quads-" + secrets.token_hex(8) + "@@"
    root = Path(tempfile.mkdtemp(prefix="quads-sandbox-"))
    start = time.monotonic()
    try:
        work = root / "work"
        work.mkdir()
        (work / "solution.py").write_text(code)
        out_path, err_path = root / "stdout", root / "stderr"
        cfg = {"work": os.path.realpath(work), "cpu": lim.cpu_time_s, "mem": lim.memory_mb << 20,
               "fsize": lim.max_output_bytes, "nofile": lim.max_open_files, "nproc": lim.max_processes,
               "netns": lim.network_namespace, "nonce": nonce, "tests": tests_src, "func": func}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)],
                    cwd=work, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
                    stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True, close_fds=True,
                )
            except OSError as e:
                return SandboxResult(False, "", "", None, f"could not start the sandbox: {e}", 0.0)
            timed_out = False
            try:
                proc.communicate(stdin.encode(), timeout=lim.wall_time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            except BrokenPipeError:
                proc.wait()
            finally:
                _kill_group(proc.pid)  # stragglers of the group, if any escaped the fork block
        duration = time.monotonic() - start
        stdout, out_size = _read_head(out_path, lim.max_output_bytes)
        stderr, err_size = _read_head(err_path, lim.max_output_bytes)
        rc = proc.returncode
        results, test_error = None, None
        if tests is not None:
            results, test_error = _parse_results(stdout, nonce)
            stdout = "\n".join(line for line in stdout.splitlines() if not line.startswith(nonce))
        reason = _reason(rc, timed_out, out_size, err_size, lim, stderr)
        ok = reason == "ok"
        if tests is not None and results is None and test_error is None:
            test_error = f"no test results: the program ended before the tests ran ({reason})"
        return SandboxResult(ok, stdout, stderr, rc, reason, duration, results, test_error)
    except Exception as e:  # the sandbox itself failed; never raise into a verifier
        return SandboxResult(False, "", "", None, f"sandbox error: {type(e).__name__}: {e}",
                             time.monotonic() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _parse_results(stdout: str, nonce: str) -> tuple[list[tuple[str, str]] | None, str | None]:
    lines = [line for line in stdout.splitlines() if line.startswith(nonce)]
    if not lines:
        return None, None
    payload = json.loads(lines[-1][len(nonce):])
    if "error" in payload:
        return None, payload["error"]
    return [tuple(r) for r in payload["results"]], None


def _reason(rc: int | None, timed_out: bool, out_size: int, err_size: int, lim: SandboxLimits,
            stderr: str) -> str:
    if timed_out:
        return f"timeout (wall {lim.wall_time_s:g} s)"
    if rc == -signal.SIGXCPU:
        return f"cpu time limit ({lim.cpu_time_s} s)"
    if rc == -signal.SIGKILL:
        return f"killed (cpu hard limit {lim.cpu_time_s + 1} s or out of memory)"
    if out_size >= lim.max_output_bytes or err_size >= lim.max_output_bytes or rc == -signal.SIGXFSZ:
        return f"output limit ({lim.max_output_bytes} bytes)"
    if "MemoryError" in stderr:
        return f"memory limit ({lim.memory_mb} MiB)"
    if rc != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        return f"exit code {rc}" + (f": {last[:200]}" if last else "")
    return "ok"
