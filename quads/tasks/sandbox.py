"""Run untrusted Python (model-written code) in a separate process that the kernel isolates.

``run_python(code, ...)`` runs ``code`` at one of three isolation levels (``SandboxLimits.isolation``;
``None`` takes the process default, ``"full"`` unless ``require_isolation`` set another):

``"full"`` (default): a chain of launchers, each of which the sandboxed program cannot undo:
  1. ``/bin/sh`` joins a fresh control group (``cgroup.Cgroup``): memory and process-count limits for
     the whole tree, and a kill of everything in it afterwards;
  2. ``bwrap`` (bubblewrap, run as root) makes new mount, PID, network, IPC, UTS and cgroup
     namespaces: the file system is a new empty root holding only read-only binds of ``/usr/lib``
     (shared libraries), the interpreter and its standard library (its ``site-packages`` hidden under
     an empty folder), a fresh ``/proc`` of the new PID namespace, a minimal ``/dev`` and a
     size-limited private ``/tmp`` (the working folder, gone with the namespace); the network is an
     unconfigured loopback; the environment holds ``PATH``, ``LC_ALL`` and ``HOME=/tmp`` only;
     ``--die-with-parent`` and ``--new-session``; before executing the next step it loads the
     seccomp filter of ``quads.tasks.seccomp`` (no new processes, no ptrace, no signals to other
     processes, no namespace or mount calls, no io_uring / bpf / keyrings ...);
  3. ``setpriv`` switches to the unprivileged uid/gid ``SANDBOX_UID`` (65534, ``nobody``), drops
     supplementary groups and all capabilities (also the bounding set) and sets ``no_new_privs``;
  4. ``python -I -S -B -c BOOTSTRAP`` reads its settings and the program from an inherited memfd,
     sets per-process limits (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE`` = the output cap,
     ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``), writes ``solution.py`` to ``/tmp`` and runs it.
  Nothing of the trainer (working folder, datasets, checkout, home, environment, other processes)
  exists in that view; the expected outputs of the tests never leave the parent.
``"no-cgroup"``: the same without the control group (per-process limits only; the seccomp filter
  still allows no second process). For machines without a writable cgroup file system.
``"process"``: no kernel isolation (opt-in, for machines without bubblewrap): the same bootstrap in a
  plain child process with an audit hook, socket stubs and, as root, a network namespace. It stops
  accidents, not a deliberately hostile program (see docs/TASKS.md).

``require_isolation(level)`` checks that a level can be set up here and runs a probe program that
verifies its layers, raising ``SandboxUnavailable`` (what is missing and how to get it) otherwise; a
level that cannot be set up is never silently weakened: ``run_python`` then returns a failed result.

With ``tests``, the bootstrap calls the named function on each input and prints the results as one
JSON line tagged with a random nonce after all tests ran (an early ``sys.exit`` / ``os._exit`` never
prints it). The parent enforces the wall clock (SIGKILL of the launcher, whose death takes the PID
namespace and the control group with it), reads at most ``max_output_bytes`` of each stream and
compares nothing itself: the caller compares the results with its expected values.
"""

from __future__ import annotations

import ast
import functools
import glob
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quads.tasks import cgroup, seccomp

ISOLATION_LEVELS = ("full", "no-cgroup", "process")
SANDBOX_UID = 65534  # nobody
_default_isolation = "full"
_lingering: list[cgroup.Cgroup] = []  # groups not yet removable after their run (see wait_for_cleanup)

_BOOTSTRAP = r'''
import json, os, resource, sys
with os.fdopen(int(sys.argv[1]), "rb") as _f:
    _cfg = json.loads(_f.read())
for _name, _soft in (("RLIMIT_CPU", _cfg["cpu"]), ("RLIMIT_AS", _cfg["mem"]), ("RLIMIT_FSIZE", _cfg["fsize"]),
                     ("RLIMIT_NOFILE", _cfg["nofile"]), ("RLIMIT_CORE", 0)) + tuple(map(tuple, _cfg["extra_limits"])):
    _hard = _soft + 1 if _name == "RLIMIT_CPU" else _soft
    resource.setrlimit(getattr(resource, _name), (_soft, _hard))
with open("solution.py", "w") as _f:
    _f.write(_cfg.pop("code"))
if _cfg["hook"]:
    _work = os.getcwd()
    if os.geteuid() == 0 and _cfg["netns"]:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
            raise SystemExit("sandbox: unshare(CLONE_NEWNET) failed; the program does not run")
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
    wall_time_s: float = 5.0  # wall clock before the whole sandbox gets SIGKILL
    memory_mb: int = 512  # RLIMIT_AS per process, and (full) the control group's limit for the whole tree
    max_output_bytes: int = 65536  # RLIMIT_FSIZE: cap of stdout, stderr and any file written
    max_processes: int = 0  # process level only: RLIMIT_NPROC (all processes of the user; root ignores it)
    max_open_files: int = 64  # RLIMIT_NOFILE
    network_namespace: bool = True  # process level only: as root, unshare(CLONE_NEWNET) before user code
    isolation: str | None = None  # "full" | "no-cgroup" | "process"; None = the process default
    max_threads: int = 16  # full: threads of the program (the control group's pids.max, plus the launchers)
    tmp_mb: int = 16  # full / no-cgroup: size of the private /tmp (the working folder)

    def __post_init__(self):
        if self.cpu_time_s < 1 or self.wall_time_s <= 0:
            raise ValueError(f"cpu_time_s must be >= 1 and wall_time_s > 0, got {self.cpu_time_s}, {self.wall_time_s}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (the interpreter needs ~30 MiB), got {self.memory_mb}")
        if self.max_output_bytes < 1024 or self.max_processes < 0 or self.max_open_files < 16:
            raise ValueError("max_output_bytes must be >= 1024, max_processes >= 0 and max_open_files >= 16")
        if self.isolation is not None and self.isolation not in ISOLATION_LEVELS:
            raise ValueError(f"isolation must be one of {ISOLATION_LEVELS} or None, got {self.isolation!r}")
        if self.max_threads < 1 or self.tmp_mb < 1:
            raise ValueError(f"max_threads and tmp_mb must be >= 1, got {self.max_threads}, {self.tmp_mb}")


class SandboxUnavailable(RuntimeError):
    """An isolation level cannot be set up on this machine (the message says what is missing)."""


_HOW_TO = ("install bubblewrap and util-linux (Debian/Ubuntu as root: apt-get install -y bubblewrap "
           "util-linux; scripts/setup_env.sh does it when apt-get is there), run as root on x86_64 "
           "with a writable /sys/fs/cgroup, or opt in to a weaker level with --task.sandbox "
           "no-cgroup (no control group) or --task.sandbox process (no kernel isolation; recorded "
           "in the run's config.yaml)")


def missing_layers(level: str, cgroup_check: bool = True) -> list[str]:
    """What this machine lacks for ``level`` (empty: it can be set up); ``cgroup_check=False`` skips
    making a test control group (``run_python`` makes its own and fails if it cannot)."""
    if level not in ISOLATION_LEVELS:
        raise ValueError(f"isolation must be one of {ISOLATION_LEVELS}, got {level!r}")
    if level == "process":
        return []
    missing = []
    if sys.platform != "linux":
        return [f"Linux namespaces (this is {sys.platform})"]
    if os.geteuid() != 0:
        missing.append("root (bwrap makes the namespaces and setpriv drops to uid "
                       f"{SANDBOX_UID}; this process runs as uid {os.geteuid()})")
    for tool, pkg in (("bwrap", "bubblewrap"), ("setpriv", "util-linux")):
        if shutil.which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin") is None:
            missing.append(f"{tool} (Debian package {pkg})")
    if (why := seccomp.supported()) is not None:
        missing.append(f"seccomp filter: {why}")
    if level == "full" and cgroup_check and not missing and (why := cgroup.available()) is not None:
        missing.append(why)
    return missing


_PROBE = r"""
import json, os, socket
out = {"uid": os.getuid(), "gid": os.getgid(), "pids": sorted(p for p in os.listdir("/proc") if p.isdigit()),
       "root": sorted(os.listdir("/"))}
st = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
out["cap_eff"], out["cap_bnd"], out["seccomp"] = st["CapEff"].strip(), st["CapBnd"].strip(), st["Seccomp"].strip()
try:
    os.fork()
    out["fork"] = "allowed"
except OSError as e:
    out["fork"] = e.errno
out["ifaces"] = sorted(name for _, name in socket.if_nameindex())
print(json.dumps(out))
"""


def _probe_problems(level: str) -> list[str]:
    """Run ``_PROBE`` at ``level`` and list every layer it did not find in place."""
    res = run_python(_PROBE, limits=SandboxLimits(isolation=level, wall_time_s=20.0))
    if not res.ok:
        return [f"the probe program failed ({res.reason}; stderr: {res.stderr.strip()[-300:]})"]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    bad = []
    if got["uid"] != SANDBOX_UID or got["gid"] != SANDBOX_UID:
        bad.append(f"uid/gid {got['uid']}/{got['gid']}, expected {SANDBOX_UID}")
    if int(got["cap_eff"], 16) or int(got["cap_bnd"], 16):
        bad.append(f"capabilities left (effective {got['cap_eff']}, bounding {got['cap_bnd']})")
    if got["seccomp"] != "2" or got["fork"] == "allowed":
        bad.append(f"seccomp filter not active (Seccomp {got['seccomp']}, fork {got['fork']})")
    if len(got["pids"]) > 2:
        bad.append(f"PID namespace: the program sees processes {got['pids']}")
    extra = sorted(set(got["root"]) - _expected_root())
    if extra:
        bad.append(f"file system view holds {extra}")
    if got["ifaces"] != ["lo"]:
        bad.append(f"network namespace: the program sees the interfaces {got['ifaces']}")
    return bad


def require_isolation(level: str) -> None:
    """Fail closed: raise ``SandboxUnavailable`` unless ``level`` is set up and verified here; then
    make it the default of ``run_python`` in this process."""
    global _default_isolation
    missing = missing_layers(level)
    if not missing and level != "process":
        missing = _probe_problems(level)
    if missing:
        raise SandboxUnavailable(f"the code sandbox cannot run at isolation level {level!r}: missing "
                                 + "; ".join(missing) + f". To fix: {_HOW_TO}.")
    _default_isolation = level


def _top_dirs() -> set[str]:
    return {Path(p).parts[1] for p in _python_paths()[0]}


def _expected_root() -> set[str]:
    """The entries of / that the probe may see, what ``_bwrap_argv`` puts there: /usr, the library folders a host
    has (/lib32 too, on a multilib host), /proc, /dev, /tmp and the interpreter's folders."""
    return {"usr", "lib", "lib64", "lib32", "proc", "dev", "tmp", *_top_dirs()}


@functools.cache
def _seccomp_filter() -> bytes:
    return seccomp.sandbox_filter()


@functools.cache
def _python_paths() -> tuple[list[str], list[str]]:
    """(read-only binds, folders hidden under an empty tmpfs) that make the interpreter run."""
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    binds = [exe, stdlib]
    libdir = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir:
        binds += sorted(glob.glob(os.path.join(os.path.realpath(libdir), "libpython*.so*")))
    binds = [exe] + [p for p in binds[1:] if not p.startswith(("/usr/lib/", "/usr/lib64/"))]  # exe first
    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    hidden = sorted(p for p in {os.path.realpath(base[k]) for k in ("purelib", "platlib")}
                    if p.startswith(stdlib + os.sep) and os.path.isdir(p))
    return binds, hidden


def _bwrap_argv(lim: SandboxLimits, seccomp_fd: int, info_fd: int) -> list[str]:
    binds, hidden = _python_paths()
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    argv = ["bwrap", "--info-fd", str(info_fd), "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup", "--hostname", "sandbox", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LC_ALL", "C.UTF-8", "--setenv", "HOME", "/tmp"]
    parents = {str(q) for p in ["/usr/lib/", *binds, setpriv] for q in Path(p).parents if str(q) != "/"}
    for d in sorted(parents, key=lambda q: q.count("/")):  # bwrap would make them 0700: not for uid 65534
        argv += ["--perms", "0755", "--dir", d]
    argv += ["--ro-bind", "/usr/lib", "/usr/lib"]
    for d in ("/usr/lib64", "/usr/lib32"):
        if os.path.isdir(d) and not os.path.islink(d):
            argv += ["--ro-bind", d, d]
    for d in ("/lib", "/lib64", "/lib32"):
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for p in [*binds, setpriv]:
        argv += ["--ro-bind", p, p]
    for p in hidden:
        argv += ["--tmpfs", p]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(lim.tmp_mb << 20), "--perms", "1777",
             "--tmpfs", "/tmp", "--chdir", "/tmp", "--seccomp", str(seccomp_fd), "--",
             setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
             "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--", binds[0]]
    return argv


# joins each control group named before "--", then executes the rest
_JOIN = 'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)  # not close-on-exec: inherited by the sandbox
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_head(f, limit: int) -> tuple[str, int]:
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace"), size


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """True when ``proc`` exits within ``timeout_s``; a pidfd wakes at once (``Popen.wait(timeout)``
    polls with sleeps of up to 50 ms)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))
    finally:
        os.close(fd)


def _wait_namespace_gone(info_fd: int, timeout_s: float = 10.0) -> None:
    """Wait until the sandbox's PID namespace init (its host pid comes from ``bwrap --info-fd``) has
    exited: it exits only after every other process of the namespace is gone. Returns as soon as it has.
    The init is identified by its ``comm`` (``/proc/<pid>/stat``): while the kernel tears the namespace
    down the init has already released its memory, so its ``cmdline`` reads empty and cannot be used."""
    try:
        os.set_blocking(info_fd, False)
        pid = int(json.loads(os.read(info_fd, 4096))["child-pid"])
        with open(f"/proc/{pid}/stat", "rb") as f:  # comm, not cmdline: an exiting process has no cmdline
            if f.read().split(b" (", 1)[1].rsplit(b")", 1)[0] != b"bwrap":
                return  # gone, and the pid already reused
        fd = os.pidfd_open(pid)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return  # no info (bwrap failed before the namespace) or the init is gone already
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)
    finally:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: Path) -> None:
    """Remove a folder that the program may have made hard to remove (deep nesting, ``chmod 0``,
    immutable files); never raises."""
    try:
        shutil.rmtree(path)
        return
    except BaseException:  # noqa: BLE001 - RecursionError on deep trees, PermissionError ...
        pass
    for argv in (["chattr", "-R", "-f", "-i", "-a", str(path)], ["chmod", "-R", "u+rwx", str(path)],
                 ["rm", "-rf", "--one-file-system", str(path)]):
        try:
            subprocess.run(argv, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
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
    """Run ``code`` in the sandbox; with ``tests``, call ``func(*args)`` for each args tuple.

    ``tests`` are argument tuples of Python literals (ints, strings, lists ...); each result comes back
    as ``("ok", repr(value))`` or ``("error", "TypeError: ...")`` in ``test_results``. Never raises
    for anything the code does; a ValueError only for bad limits or non-literal test inputs. When the
    isolation level cannot be set up, the code does not run and the result says why.
    """
    lim = limits or SandboxLimits(cpu_time_s, wall_time_s, memory_mb, max_output_bytes, max_processes)
    level = lim.isolation or _default_isolation
    tests_src = None
    if tests is not None:
        tests_src = repr([tuple(t) for t in tests])
        ast.literal_eval(tests_src)  # ValueError now, not in the child, for non-literal inputs
    nonce = "@@quads-" + secrets.token_hex(8) + "@@"
    start = time.monotonic()
    fds: list[int] = []
    info_r: int | None = None
    work: Path | None = None
    group: cgroup.Cgroup | None = None
    try:
        cfg = {"cpu": lim.cpu_time_s, "mem": lim.memory_mb << 20, "fsize": lim.max_output_bytes,
               "nofile": lim.max_open_files, "extra_limits": [], "hook": level == "process",
               "netns": lim.network_namespace, "nonce": nonce, "tests": tests_src, "func": func, "code": code}
        if level == "process":
            cfg["extra_limits"] = [["RLIMIT_NPROC", lim.max_processes]]
            work = Path(tempfile.mkdtemp(prefix="quads-sandbox-"))
            fds.append(_memfd("quads-sandbox-cfg", json.dumps(cfg).encode()))
            argv = [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, str(fds[0])]
            env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
        else:
            missing = missing_layers(level, cgroup_check=False)
            if missing:
                return SandboxResult(False, "", "", None, f"sandbox unavailable ({level}): " + "; ".join(missing),
                                     0.0)
            fds.append(_memfd("quads-sandbox-cfg", json.dumps(cfg).encode()))
            fds.append(_memfd("quads-sandbox-seccomp", _seccomp_filter()))
            info_r, info_w = os.pipe()
            fds.append(info_w)
            argv = [*_bwrap_argv(lim, fds[1], info_w), "-I", "-S", "-B", "-c", _BOOTSTRAP, str(fds[0])]
            env = {}
            if level == "full":
                group = cgroup.Cgroup.create(f"quads-sandbox-{os.getpid()}-{secrets.token_hex(6)}",
                                             lim.memory_mb << 20, lim.max_threads + 2)
            argv = ["/bin/sh", "-c", _JOIN, "sh", *(group.procs_files() if group else []), "--", *argv]
        with tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            inp.write(stdin.encode())
            inp.seek(0)
            try:
                proc = subprocess.Popen(argv, cwd=work or "/", env=env, stdin=inp, stdout=out, stderr=err,
                                        start_new_session=True, close_fds=True, pass_fds=fds)
            except OSError as e:
                return SandboxResult(False, "", "", None, f"could not start the sandbox: {e}", 0.0)
            for fd in fds:
                os.close(fd)
            fds = []
            try:
                timed_out = not _wait_exit(proc, lim.wall_time_s)
                if timed_out:
                    _kill_group(proc.pid)
                proc.wait()
            finally:
                _kill_group(proc.pid)  # the launcher's group (its sandbox dies with it: --die-with-parent)
                if info_r is not None:
                    _wait_namespace_gone(info_r)
            duration = time.monotonic() - start
            stdout, out_size = _read_head(out, lim.max_output_bytes)
            stderr, err_size = _read_head(err, lim.max_output_bytes)
        rc = proc.returncode
        if level != "process" and rc is not None and 128 < rc < 128 + 65:
            rc = 128 - rc  # bwrap reports a child killed by signal N as 128 + N
        results, test_error = None, None
        if tests is not None:
            results, test_error, stdout = _parse_results(stdout, nonce)
        reason = _reason(rc, timed_out, out_size, err_size, lim, stderr)
        ok = reason == "ok"
        if tests is not None and results is None and test_error is None:
            test_error = f"no test results: the program ended before the tests ran ({reason})"
        return SandboxResult(ok, stdout, stderr, rc, reason, duration, results, test_error)
    except Exception as e:  # the sandbox itself failed; never raise into a verifier
        return SandboxResult(False, "", "", None, f"sandbox error: {type(e).__name__}: {e}",
                             time.monotonic() - start)
    finally:
        for fd in fds + ([info_r] if info_r is not None else []):
            os.close(fd)
        if group is not None and not group.destroy():
            _lingering.append(group)  # still exiting (a busy machine): removed by a later run
        if _lingering:
            wait_for_cleanup(0.0)
        if work is not None:
            _remove_tree(work)


def wait_for_cleanup(timeout_s: float) -> bool:
    """Retry removing control groups whose processes were still exiting when their run ended;
    True when none is left."""
    for g in list(_lingering):
        if g.destroy(timeout_s):
            _lingering.remove(g)
    return not _lingering


def _parse_results(stdout: str, nonce: str) -> tuple[list[tuple[str, str]] | None, str | None, str]:
    """(results, error, stdout without the results line); the nonce may follow program output that
    did not end with a newline."""
    payload, kept = None, []
    for line in stdout.splitlines(keepends=True):
        head, sep, tail = line.partition(nonce)
        if sep:
            payload = tail
            if head:
                kept.append(head)
        else:
            kept.append(line)
    rest = "".join(kept)
    if payload is None:
        return None, None, rest
    data = json.loads(payload)
    if "error" in data:
        return None, data["error"], rest
    return [tuple(r) for r in data["results"]], None, rest


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
