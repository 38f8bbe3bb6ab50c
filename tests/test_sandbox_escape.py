"""Deliberate escape attempts against the full sandbox, run as the CI user (root).

Each hostile program reports every attempt it made (``BLOCKED <name> <error>`` or ``ESCAPED <name>``),
the test requires each attempt to be reported as blocked, and then checks the host: no file, no
process, no connection left behind. The answer-key read is also run at the "process" level, where it
does earn reward: proof that the attack is real and that the full level is what stops it.
"""

import json
import os
import secrets
import socket
import time

import pytest
from test_sandbox import _full_isolation_here  # noqa: F401 - the same autouse check of the machine

from quads.tasks import cgroup, sandbox
from quads.tasks.datasets import DatasetTask
from quads.tasks.sandbox import (
    SandboxLimits,
    SandboxUnavailable,
    require_isolation,
    run_python,
)

FAST = SandboxLimits(cpu_time_s=2, wall_time_s=5.0)

TRY = '''
import os, sys, json
def attempt(name, fn):
    try:
        r = fn()
    except BaseException as e:
        print("BLOCKED", name, type(e).__name__, str(e)[:80], flush=True)
        return
    print("ESCAPED", name, repr(r)[:80], flush=True)
def c_call(name, *args):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    r = getattr(libc, name)(*args)
    if r == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return r
'''


def _outcomes(res, names):
    """{name: "BLOCKED"/"ESCAPED"} for each expected attempt; fails when one was not attempted."""
    got = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in ("BLOCKED", "ESCAPED"):
            got[parts[1]] = parts[0]
    assert set(names) <= set(got), f"attempts not made: {set(names) - set(got)}\n{res.stdout}\n{res.stderr}"
    return got


def _host_cmdlines_with(token: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(d))
        except (OSError, ValueError):
            continue
    return found


def _answer_key_attack(trainer_dir, dataset_name):
    """A response that never implements f: it looks for the trainer's dataset and replays the answers."""
    return TRY + f'''
found = []
def steal(path):
    with open(path) as fh:
        for line in fh:
            found.append(json.loads(line)["extra_info"]["expected"])
    return path
attempt("ppid_cwd", lambda: steal("/proc/%d/cwd/{dataset_name}" % os.getppid()))
attempt("absolute", lambda: steal({str(trainer_dir / dataset_name)!r}))
for p in [p for p in os.listdir("/proc") if p.isdigit()]:
    attempt("proc_cwd_" + p, lambda: steal("/proc/%s/cwd/{dataset_name}" % p))
attempt("environ", lambda: [v for v in os.environ.values() if "x*7919" in v][0])
def in_proc_files():  # the answer key in any process's command line or environment, or in open files
    for p in [p for p in os.listdir("/proc") if p.isdigit()]:
        for name in ("cmdline", "environ"):
            try:
                if b"39608" in open("/proc/%s/%s" % (p, name), "rb").read():
                    return p, name
            except OSError:
                pass
        for fd in os.listdir("/proc/%s/fd" % p) if p == str(os.getpid()) else []:
            try:
                if b"39608" in os.pread(int(fd), 1 << 20, 0):
                    return p, fd
            except OSError:
                pass
    raise LookupError("not found")
attempt("proc_files", in_proc_files)
calls = [0]
def f(x):
    calls[0] += 1
    return eval(found[0][calls[0] - 1])
'''


def test_answer_key_is_out_of_reach(tmp_path, monkeypatch):
    trainer_dir = tmp_path / "trainer"
    trainer_dir.mkdir()
    record = {"prompt": "Q: def f(x): hidden\n", "answer": "x*7919+13", "data_source": "code",
              "extra_info": {"inputs": [[1], [2], [5]], "expected": ["7932", "15851", "39608"]}}
    (trainer_dir / "data.jsonl").write_text(json.dumps(record) + "\n")
    monkeypatch.chdir(trainer_dir)  # the trainer runs from the folder that holds its dataset
    monkeypatch.setenv("QUADS_ANSWER", "x*7919+13")
    task = DatasetTask("data.jsonl", test_fraction=0.5)
    example = (task.examples("train") + task.examples("test"))[0]
    attack = _answer_key_attack(trainer_dir, "data.jsonl")

    monkeypatch.setattr(sandbox, "_default_isolation", "process")
    weak = task.score(example, attack)
    assert weak.reward == 1.0, f"the attack should work without kernel isolation: {weak}"

    monkeypatch.setattr(sandbox, "_default_isolation", "full")
    full = task.score(example, attack)
    assert full.reward == 0.0 and not full.correct, full
    res = run_python(attack, limits=FAST)
    got = _outcomes(res, ["ppid_cwd", "absolute", "proc_cwd_1", "environ", "proc_files"])
    assert all(v == "BLOCKED" for v in got.values()), res.stdout
    assert "proc_cwd_3" not in got  # /proc holds only the sandbox's two processes


def test_no_new_process_by_any_route():
    token = "quads-escape-" + secrets.token_hex(6)
    child = ["/proc/self/exe", "-c", f"import time; time.sleep(20)  # {token}"]
    code = TRY + f'''
import subprocess, multiprocessing, _posixsubprocess, threading
child = {child!r}
attempt("fork", os.fork)
attempt("posix_spawn", lambda: os.posix_spawn(child[0], child, {{}}))
attempt("subprocess", lambda: subprocess.Popen(child, start_new_session=True))
r, w = os.pipe()
attempt("fork_exec", lambda: _posixsubprocess.fork_exec(child, [child[0].encode()], True, (w,), None, None,
        -1, -1, -1, -1, -1, -1, r, w, False, True, -1, None, None, None, -1, None, False))
attempt("mp_spawn", lambda: multiprocessing.get_context("spawn").Process(target=print).start())
attempt("libc_fork", lambda: c_call("fork"))
attempt("libc_vfork", lambda: c_call("vfork"))
attempt("clone_raw", lambda: c_call("syscall", 56, 17, 0, 0, 0, 0))  # clone(SIGCHLD)
attempt("clone3", lambda: c_call("syscall", 435, 0, 0))
attempt("clone_newuser", lambda: c_call("syscall", 56, 0x10000000 | 0x10000 | 0x800 | 0x100, 0, 0, 0, 0))
attempt("unshare", lambda: c_call("unshare", 0x10000000))
def sub():
    import _xxsubinterpreters as si
    return si.run_string(si.create(), "import os; os.fork()")
attempt("subinterp", sub)
t = threading.Thread(target=lambda: print("THREAD ok", flush=True)); t.start(); t.join()
'''
    res = run_python(code, limits=FAST)
    names = ["fork", "posix_spawn", "subprocess", "fork_exec", "mp_spawn", "libc_fork", "libc_vfork",
             "clone_raw", "clone3", "clone_newuser", "unshare", "subinterp"]
    got = _outcomes(res, names)
    assert all(got[n] == "BLOCKED" for n in names), res.stdout
    assert "THREAD ok" in res.stdout  # threads, which the task needs, still work
    time.sleep(0.2)
    assert _host_cmdlines_with(token) == []


def test_no_way_out_for_root_escapes(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    port = server.getsockname()[1]
    token = "quads-escape-" + secrets.token_hex(6)
    host_files = [f"/tmp/{token}", f"/root/{token}", str(tmp_path / token), f"/dev/shm/{token}", f"/var/tmp/{token}"]
    code = TRY + f'''
import socket, signal
me = {os.getpid()}
attempt("setns_open", lambda: os.open("/proc/1/ns/net", os.O_RDONLY))
attempt("setns_call", lambda: c_call("setns", os.open("/proc/self/ns/net", os.O_RDONLY), 0))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1))
attempt("ptrace", lambda: c_call("ptrace", 16, 1, 0, 0))  # PTRACE_ATTACH to pid 1
attempt("ptrace_me", lambda: c_call("ptrace", 0, 0, 0, 0))  # PTRACE_TRACEME
attempt("mem_init", lambda: open("/proc/1/mem", "rb"))
attempt("mem_trainer", lambda: open("/proc/%d/mem" % me, "rb"))
attempt("vm_readv", lambda: c_call("syscall", 310, 1, 0, 0, 0, 0, 0))
attempt("kill_trainer", lambda: os.kill(me, signal.SIGKILL))
attempt("kill_init", lambda: os.kill(1, signal.SIGKILL))
attempt("kill_all", lambda: os.kill(-1, signal.SIGKILL))
attempt("pidfd", lambda: c_call("syscall", 434, 1, 0))
attempt("mount", lambda: c_call("mount", b"none", b"/tmp", b"tmpfs", 0, None))
attempt("chroot", lambda: c_call("chroot", b"/tmp"))
attempt("setuid0", lambda: os.setuid(0))
attempt("dirfd_write", lambda: os.open("escaped", os.O_CREAT | os.O_WRONLY, dir_fd=os.open("/usr/lib", os.O_RDONLY)))
attempt("sys", lambda: os.listdir("/sys"))
for i, p in enumerate({host_files!r}):
    def write(p=p):
        with open(p, "w") as fh:
            fh.write("x")
        return os.path.exists(p)
    attempt("write_%d" % i, write)
'''
    try:
        res = run_python(code, limits=FAST)
        names = ["setns_open", "setns_call", "tcp", "ptrace", "ptrace_me", "mem_init", "mem_trainer", "vm_readv",
                 "kill_trainer", "kill_init", "kill_all", "pidfd", "mount", "chroot", "setuid0", "dirfd_write", "sys"]
        got = _outcomes(res, names + [f"write_{i}" for i in range(len(host_files))])
        assert all(got[n] == "BLOCKED" for n in names), res.stdout
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection ever arrived
    finally:
        server.close()
    # /tmp and /dev/shm are the sandbox's own: a write there may succeed, but never reaches the host
    assert [p for p in host_files if os.path.exists(p)] == []


def test_aggregate_memory_limit():
    lim = SandboxLimits(cpu_time_s=5, wall_time_s=10.0, memory_mb=96, tmp_mb=1024, max_output_bytes=1 << 20)
    # tmpfs pages are not in any process's address space (RLIMIT_AS misses them); the cgroup counts them
    code = "for i in range(400):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (1 << 20))\n    print(i, flush=True)"
    res = run_python(code, limits=lim)
    written = [int(x) for x in res.stdout.split()]
    assert not res.ok and "killed" in res.reason and written and max(written) < 120, (res.reason, written[-1:])


def test_thread_limit_of_the_whole_tree():
    code = """import threading, time
n = 0
try:
    for _ in range(64):
        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
        n += 1
except RuntimeError as e:
    print("STOPPED", n, e)
"""
    res = run_python(code, limits=SandboxLimits(max_threads=8))
    assert "STOPPED" in res.stdout and int(res.stdout.split()[1]) <= 8, res


def test_clean_up_cannot_be_defeated(tmp_path, monkeypatch):
    token = "quads-escape-" + secrets.token_hex(6)
    hostile = f"""import os, fcntl, _posixshmem
base = os.getcwd()
os.mkdir("{token}")
os.chdir("{token}")
for _ in range(1500):
    os.mkdir("d")
    os.chdir("d")
os.chdir(base)
os.mkdir("locked")
open("locked/x", "w").write("x")
os.chmod("locked", 0)
with open("immutable", "w") as fh:
    try:
        fcntl.ioctl(fh.fileno(), 0x40086602, bytearray((0x10).to_bytes(8, "little")))  # FS_IOC_SETFLAGS immutable
        print("IMMUTABLE set")
    except OSError as e:
        print("IMMUTABLE", e)
try:
    _posixshmem.shm_open("/{token}", os.O_CREAT | os.O_RDWR, 0o600)
    print("SHM made")
except OSError as e:
    print("SHM", e)
print("DONE")
"""
    res = run_python(hostile, limits=FAST)
    assert res.ok and "DONE" in res.stdout, res
    assert [p for p in os.listdir("/tmp") + os.listdir("/dev/shm") if token in p] == []
    assert sandbox.wait_for_cleanup(30.0) and _sandbox_cgroups() == set()
    # the process level keeps a host folder: its removal must survive the same program and never raise
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    res = run_python(hostile, limits=SandboxLimits(cpu_time_s=5, wall_time_s=20.0, isolation="process"))
    assert "DONE" in res.stdout and "IMMUTABLE set" in res.stdout, res
    assert list(tmp_path.iterdir()) == []
    for name in os.listdir("/dev/shm"):
        if token in name:
            os.unlink(f"/dev/shm/{name}")  # the process level cannot contain POSIX shared memory (documented)


def _sandbox_cgroups() -> set[str]:
    """This process's sandbox control groups (other test workers make their own meanwhile)."""
    out = set()
    for root, _dirs, _files in os.walk("/sys/fs/cgroup"):
        if os.path.basename(root).startswith(f"quads-sandbox-{os.getpid()}-"):
            out.add(root)
    return out


def test_fails_closed_when_a_layer_is_missing(monkeypatch):
    monkeypatch.setattr(sandbox, "_default_isolation", "full")  # restored after the test
    real_which = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None if name == "bwrap" else
                        real_which(name, path=path))
    with pytest.raises(SandboxUnavailable, match=r"bwrap \(Debian package bubblewrap\).*apt-get install"):
        require_isolation("full")
    res = run_python("print('ran')")
    assert not res.ok and res.stdout == "" and res.reason.startswith("sandbox unavailable (full)"), res
    monkeypatch.setattr(sandbox.shutil, "which", real_which)

    monkeypatch.setattr(cgroup, "available", lambda: "cannot create a control group (test)")
    with pytest.raises(SandboxUnavailable, match="control group"):
        require_isolation("full")
    require_isolation("no-cgroup")  # the explicit opt-in still has every other layer
    assert sandbox._default_isolation == "no-cgroup"


@pytest.mark.parametrize("drop, complaint", [
    (("--unshare-net",), "network namespace"),
    (("--unshare-pid",), "PID namespace"),
    (("--seccomp",), "seccomp filter not active"),
    (("--clear-groups", "--reuid=65534", "--regid=65534"), "uid/gid"),
])
def test_start_up_probe_notices_a_missing_layer(monkeypatch, drop, complaint):
    real = sandbox._bwrap_argv

    def weakened(*args):
        argv = real(*args)
        if "--seccomp" in drop:
            i = argv.index("--seccomp")
            return argv[:i] + argv[i + 2:]
        return [a for a in argv if a not in drop]

    monkeypatch.setattr(sandbox, "_bwrap_argv", weakened)
    monkeypatch.setattr(sandbox, "_default_isolation", "full")  # restored after the test
    with pytest.raises(SandboxUnavailable, match=complaint):
        require_isolation("full")
    assert sandbox._default_isolation == "full"


def test_train_refuses_code_task_without_its_sandbox(monkeypatch):
    from quads.rl.build import build_task
    from quads.rl.config import TaskSection, TrainConfig

    monkeypatch.setattr(sandbox, "_default_isolation", "full")  # restored after the test
    monkeypatch.setattr(cgroup, "available", lambda: "cannot create a control group (test)")
    with pytest.raises(ValueError, match="task.sandbox: the code sandbox cannot run at isolation level 'full'"):
        build_task(TrainConfig(task=TaskSection(name="code")))
    assert build_task(TrainConfig(task=TaskSection(name="arithmetic"))).name == "arithmetic"
    build_task(TrainConfig(task=TaskSection(name="code", sandbox="no-cgroup")))
    assert sandbox._default_isolation == "no-cgroup"


def test_eval_refuses_code_task_without_its_sandbox(monkeypatch, tmp_path, capsys):
    """quads eval on a code task checks its sandbox level before any scoring, as train does."""
    from quads import evaluate
    from quads.model.checkpoint import save_checkpoint
    from quads.model.config import ModelConfig
    from quads.model.tokenizer import CharTokenizer
    from quads.model.transformer import MoEForCausalLM

    monkeypatch.setattr(sandbox, "_default_isolation", "full")
    monkeypatch.setattr(cgroup, "available", lambda: "cannot create a control group (test)")
    tok = CharTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=16, n_experts=4, top_k=2, moe_intermediate_size=32, max_seq_len=64)
    save_checkpoint(MoEForCausalLM(cfg), tmp_path / "ckpt", tokenizer=tok)
    scored = []
    monkeypatch.setattr(evaluate, "evaluate_model", lambda *a, **k: scored.append(1))
    from quads.cli import main

    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--task", "code", "--n-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert "sandbox: the code sandbox cannot run at isolation level 'full'" in err and not scored
