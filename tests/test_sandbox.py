"""The sandbox against runaway programs: each is contained, reported with a reason, within its limits,
and leaves no process or file behind (default level "full"; the "process" level's audit hook at the
end). Deliberate escape attempts are in tests/test_sandbox_escape.py."""

import os
import socket
import tempfile

import pytest

from quads.tasks.sandbox import SandboxLimits, missing_layers, run_python

FAST = dict(cpu_time_s=1, wall_time_s=3.0)
PROCESS = dict(limits=SandboxLimits(cpu_time_s=1, wall_time_s=3.0, isolation="process"))


@pytest.fixture(autouse=True, scope="module")
def _full_isolation_here():
    if os.geteuid() != 0:
        pytest.skip("the full sandbox runs bwrap as root (CI runs as root)")
    missing = missing_layers("full")
    assert not missing, f"full isolation is missing {missing}: run scripts/setup_env.sh as root"


# prints the process's start time (clock ticks since boot, the same in every PID namespace)
WHO = "print('PID', open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19], flush=True)\n"


def host_processes_started_at(ticks: set[str]) -> list[int]:
    """Host pids of processes running as the sandbox uid (65534) that started at one of ``ticks``."""
    found = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                start = f.read().rsplit(")", 1)[1].split()[19]
            if os.stat(f"/proc/{d}").st_uid == 65534 and start in ticks:
                found.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _run_and_check(code: str, **kw):
    """Run ``code`` (each of its processes prints its start time) and check those are gone afterwards."""
    res = run_python("import os\n" + WHO + code, **{**FAST, **kw})
    ticks = {line.split()[1] for line in res.stdout.splitlines() if line.startswith("PID ")}
    assert ticks, res
    assert host_processes_started_at(ticks) == []
    return res


def test_normal_program_and_tests():
    res = run_python("print('hi')")
    assert res.ok and res.stdout == "hi\n" and res.exit_code == 0 and res.reason == "ok"
    res = run_python("def f(a, b): return a + b", tests=[(1, 2), ("a", "b"), ([1], None)])
    assert res.test_results[:2] == [("ok", "3"), ("ok", "'ab'")]
    assert res.test_results[2][0] == "error" and "TypeError" in res.test_results[2][1]


def test_infinite_loop_hits_cpu_limit():
    res = _run_and_check("while True:\n    pass", wall_time_s=15.0)  # 1 CPU-s can take seconds on a busy machine
    assert not res.ok and "cpu time limit" in res.reason


def test_sleeping_program_hits_wall_limit():
    for kw in ({}, dict(limits=SandboxLimits(cpu_time_s=1, wall_time_s=3.0, isolation="no-cgroup"))):
        res = _run_and_check("import time\ntime.sleep(60)", **kw)  # without a cgroup: --die-with-parent
        assert not res.ok and res.reason.startswith("timeout") and res.duration < 10


def test_fork_bomb_is_blocked():
    res = _run_and_check("while True:\n    if os.fork() == 0:\n        " + WHO)
    assert not res.ok and "Operation not permitted" in res.reason and res.stdout.count("PID") == 1
    res = _run_and_check("import subprocess\nsubprocess.run(['sleep', '30'])")
    assert not res.ok and "Operation not permitted" in res.reason
    res = _run_and_check("import ctypes\nassert ctypes.CDLL(None).fork() == -1\n" + WHO)
    assert res.ok and res.stdout.count("PID") == 2  # the child would print a second line of its own


def test_memory_hog():
    res = _run_and_check("x = [0] * (10**9)", memory_mb=256)
    assert not res.ok and "memory limit" in res.reason


def test_huge_output_is_capped():
    res = _run_and_check("while True:\n    print('x' * 4096)")
    assert not res.ok and "output limit" in res.reason
    assert len(res.stdout.encode()) <= SandboxLimits().max_output_bytes


def test_write_outside_its_folder(tmp_path):
    target = tmp_path / "escaped.txt"
    for kw in (FAST, PROCESS):
        res = run_python(f"open({str(target)!r}, 'w').write('x')", **kw)
        assert not res.ok and ("writing outside the sandbox folder" in res.reason
                               or "No such file or directory" in res.reason), res.reason
        res = run_python(f"import os\nos.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))", **kw)
        assert not res.ok and ("not allowed" in res.reason or "No such file or directory" in res.reason)
    res = run_python(f"import os\nos.rename('a', {str(target)!r})", **PROCESS)
    assert not res.ok and "not allowed" in res.reason
    assert not target.exists()
    assert run_python("open('inside.txt', 'w').write('x')\nprint(open('inside.txt').read())").stdout == "x\n"


def test_network_is_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        res = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", **FAST)
        assert not res.ok and "Connection refused" in res.reason  # its own loopback: nobody listens
        res = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", **PROCESS)
        assert not res.ok and "not allowed" in res.reason
        res = run_python(f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))", **PROCESS)
        assert not res.ok and "not allowed" in res.reason
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection ever arrived
    finally:
        server.close()


def test_environment_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("QUADS_TEST_SECRET", "hunter2-secret")
    res = run_python("import os\nprint(dict(os.environ))", **FAST)
    assert res.ok and "hunter2-secret" not in res.stdout and "QUADS_TEST_SECRET" not in res.stdout
    for kw in (FAST, PROCESS):
        res = run_python("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", **kw)
        assert not res.ok and "hunter2-secret" not in res.stdout and "ermission" in res.reason


def test_early_exit_and_syntax_errors_do_not_pass():
    res = run_python("import sys\nsys.exit(0)\ndef f(x): return x", tests=[(1,)], **FAST)
    assert res.test_results is None and "exited" in res.test_error
    res = run_python("import os\nos._exit(0)\ndef f(x): return x", tests=[(1,)], **FAST)
    assert res.test_results is None and "ended before the tests" in res.test_error
    res = run_python("def f(x) return x", tests=[(1,)], **FAST)
    assert res.test_results is None and "SyntaxError" in res.test_error


def test_no_temp_folder_left_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the sandbox makes its folder here
    for kw in (FAST, PROCESS):
        res = run_python("open('junk.bin', 'wb').write(b'0' * 1000)", **kw)
        assert res.ok
        run_python("while True:\n    pass", **kw)
        assert list(tmp_path.iterdir()) == []


def test_stdin_reaches_the_program():
    for kw in (FAST, PROCESS):
        assert run_python("print(input()[::-1])", stdin="abc\n", **kw).stdout == "cba\n"


def test_output_without_a_trailing_newline_keeps_its_results():
    res = run_python("print('hi', end='')\ndef f(x): return x + 1", tests=[(1,)], **FAST)
    assert res.ok and res.test_results == [("ok", "2")] and res.stdout == "hi"


def test_process_level_audit_hook_blocks_fork_and_ctypes():
    res = run_python("import os\nos.fork()", **PROCESS)
    assert not res.ok and "os.fork is not allowed" in res.reason
    res = run_python("import ctypes\nctypes.CDLL(None).fork()", **PROCESS)
    assert not res.ok and "not allowed" in res.reason


def test_the_probe_expects_every_top_folder_the_sandbox_mounts():
    """The isolation probe refuses a view holding an unexpected entry of /, so everything _bwrap_argv mounts at the
    top must be in its expected set, on any host (a /lib32 on multilib hosts once failed it: c617fea)."""
    import shutil

    from quads.tasks import sandbox

    if shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin") is None:
        pytest.skip("no setpriv (util-linux): the sandbox's command line cannot be built here")
    argv = sandbox._bwrap_argv(SandboxLimits(), 3, 4)
    argv = argv[: argv.index("--")]
    mounted = set()
    for i, a in enumerate(argv):
        if a in ("--ro-bind", "--bind", "--symlink"):
            mounted.add(argv[i + 2])
        elif a in ("--dir", "--tmpfs", "--proc", "--dev"):
            mounted.add(argv[i + 1])
    tops = {os.path.normpath(d).split(os.sep)[1] for d in mounted if d.startswith("/")}
    assert tops and tops <= sandbox._expected_root(), sorted(tops - sandbox._expected_root())
