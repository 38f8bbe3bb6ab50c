"""The sandbox against hostile programs: each is contained, reported with a reason, within its limits,
and leaves no process or file behind."""

import os
import socket
import tempfile

import pytest

from quads.tasks.sandbox import SandboxLimits, run_python

FAST = dict(cpu_time_s=1, wall_time_s=3.0)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _run_and_check(code: str, **kw):
    """Run ``code`` (which prints its pid first) and check that process is gone afterwards."""
    res = run_python("import os\nprint('PID', os.getpid(), flush=True)\n" + code, **{**FAST, **kw})
    pids = [int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("PID ")]
    assert pids, res
    assert all(_pid_gone(p) for p in pids)
    return res


def test_normal_program_and_tests():
    res = run_python("print('hi')")
    assert res.ok and res.stdout == "hi\n" and res.exit_code == 0 and res.reason == "ok"
    res = run_python("def f(a, b): return a + b", tests=[(1, 2), ("a", "b"), ([1], None)])
    assert res.test_results[:2] == [("ok", "3"), ("ok", "'ab'")]
    assert res.test_results[2][0] == "error" and "TypeError" in res.test_results[2][1]


def test_infinite_loop_hits_cpu_limit():
    res = _run_and_check("while True:\n    pass")
    assert not res.ok and "cpu time limit" in res.reason


def test_sleeping_program_hits_wall_limit():
    res = _run_and_check("import time\ntime.sleep(60)", wall_time_s=1.0)
    assert not res.ok and res.reason.startswith("timeout") and res.duration < 10


def test_fork_bomb_is_blocked():
    res = _run_and_check("while True:\n    if os.fork() == 0:\n        print('PID', os.getpid(), flush=True)")
    assert not res.ok and "os.fork is not allowed" in res.reason
    res = _run_and_check("import subprocess\nsubprocess.run(['sleep', '30'])")
    assert not res.ok and "not allowed" in res.reason
    res = _run_and_check("import ctypes\nctypes.CDLL(None).fork()")
    assert not res.ok and "not allowed" in res.reason


def test_memory_hog():
    res = _run_and_check("x = [0] * (10**9)", memory_mb=256)
    assert not res.ok and "memory limit" in res.reason


def test_huge_output_is_capped():
    res = _run_and_check("while True:\n    print('x' * 4096)")
    assert not res.ok and "output limit" in res.reason
    assert len(res.stdout.encode()) <= SandboxLimits().max_output_bytes


def test_write_outside_its_folder(tmp_path):
    target = tmp_path / "escaped.txt"
    res = run_python(f"open({str(target)!r}, 'w').write('x')", **FAST)
    assert not res.ok and "writing outside the sandbox folder" in res.reason
    res = run_python(f"import os\nos.rename('a', {str(target)!r})", **FAST)
    assert not res.ok and "not allowed" in res.reason
    res = run_python(f"import os\nos.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))", **FAST)
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
        assert not res.ok and "not allowed" in res.reason
        res = run_python(f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))", **FAST)
        assert not res.ok and "not allowed" in res.reason
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection ever arrived
    finally:
        server.close()


def test_environment_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("QUADS_TEST_SECRET", "hunter2-secret")
    res = run_python("import os\nprint(dict(os.environ))", **FAST)
    assert res.ok and "hunter2-secret" not in res.stdout and "QUADS_TEST_SECRET" not in res.stdout
    res = run_python("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", **FAST)
    assert not res.ok and "hunter2-secret" not in res.stdout


def test_early_exit_and_syntax_errors_do_not_pass():
    res = run_python("import sys\nsys.exit(0)\ndef f(x): return x", tests=[(1,)], **FAST)
    assert res.test_results is None and "exited" in res.test_error
    res = run_python("import os\nos._exit(0)\ndef f(x): return x", tests=[(1,)], **FAST)
    assert res.test_results is None and "ended before the tests" in res.test_error
    res = run_python("def f(x) return x", tests=[(1,)], **FAST)
    assert res.test_results is None and "SyntaxError" in res.test_error


def test_no_temp_folder_left_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the sandbox makes its folder here
    res = run_python("open('junk.bin', 'wb').write(b'0' * 1000)", **FAST)
    assert res.ok
    run_python("while True:\n    pass", **FAST)
    assert list(tmp_path.iterdir()) == []
