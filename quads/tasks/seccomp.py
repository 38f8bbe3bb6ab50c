"""A seccomp-BPF syscall filter for sandboxed programs, as the classic BPF program the kernel loads.

``sandbox_filter()`` returns the filter as bytes (an array of ``struct sock_filter``), the format
``bwrap --seccomp FD`` reads and installs right before it executes the sandboxed command; the kernel
then applies it to that process and every thread or process it starts, and it cannot be removed.

The filter (x86_64 only; any other architecture or the x32 ABI ends the process):
- allows ``clone`` only for threads (``CLONE_THREAD`` set, no namespace flag): no new processes;
- answers ``clone3`` with ``ENOSYS``, so the C library falls back to ``clone`` (checked above);
- answers ``EPERM`` to ``fork``, ``vfork``, ``ptrace``, ``process_vm_readv/writev``, ``kill``,
  ``pidfd_*``, ``rt_(tg)sigqueueinfo``, ``setns``, ``unshare``, mount calls (``mount``, ``umount2``,
  ``pivot_root``, ``chroot``, ``open_tree``, ``move_mount``, ``fsopen`` ... ``mount_setattr``),
  ``io_uring_*`` (its operations are not seen by seccomp), ``bpf``, ``perf_event_open``,
  ``userfaultfd``, keyrings, module loading, ``kexec``, ``reboot``, swap, clock and host name
  changes, ``open_by_handle_at``, ``syslog``, ``iopl``/``ioperm``, ``acct``, ``quotactl``, ``kcmp``;
- allows everything else (files, memory, threads, ``tgkill``/``tkill`` for signals to its own threads).

Written by hand (no libseccomp), the same layout libseccomp and bubblewrap's callers produce.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16
_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ, _JGE, _JSET = 0x15, 0x35, 0x45  # BPF_JMP | BPF_{JEQ,JGE,JSET} | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
CLONE_THREAD = 0x00010000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_CLONE, _CLONE3 = 56, 435

DENIED_X86_64 = {
    "fork": 57, "vfork": 58, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "kill": 62, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "pidfd_open": 434,
    "pidfd_send_signal": 424, "pidfd_getfd": 438, "setns": 308, "unshare": 272, "mount": 165,
    "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246,
    "kexec_file_load": 320, "reboot": 169, "swapon": 167, "swapoff": 168, "settimeofday": 164,
    "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305, "sethostname": 170,
    "setdomainname": 171, "open_by_handle_at": 304, "name_to_handle_at": 303, "syslog": 103,
    "iopl": 172, "ioperm": 173, "acct": 163, "quotactl": 179, "kcmp": 312, "vhangup": 153,
}


def supported() -> str | None:
    """None when this machine's architecture has a filter, else why not."""
    machine = platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return f"the seccomp filter is written for x86_64 only; this machine is {machine}"
    return None


def sandbox_filter() -> bytes:
    """The filter described in the module docstring, as ``struct sock_filter[]`` bytes."""
    why = supported()
    if why:
        raise RuntimeError(why)
    denied = sorted(DENIED_X86_64.values())
    # layout (BPF jumps only forward): header, one compare per denied syscall, clone / clone3
    # compares, ALLOW, the clone check, then the returns EPERM, ENOSYS, KILL and ALLOW (threads)
    prog: list[tuple[int, int, int, int] | tuple[str, ...]] = []
    prog.append((_LD_ABS, 0, 0, _OFF_ARCH))
    prog.append(("jeq", _AUDIT_ARCH_X86_64, "next", "kill"))
    prog.append((_LD_ABS, 0, 0, _OFF_NR))
    prog.append(("jge", _X32_BIT, "kill", "next"))
    for nr in denied:
        prog.append(("jeq", nr, "eperm", "next"))
    prog.append(("jeq", _CLONE, "clone", "next"))
    prog.append(("jeq", _CLONE3, "enosys", "next"))
    prog.append((_RET, 0, 0, _RET_ALLOW))
    labels = {"clone": len(prog)}
    prog.append((_LD_ABS, 0, 0, _OFF_ARG0))  # low 32 bits of the flags (little endian)
    prog.append(("jset", _CLONE_NS, "eperm", "next"))
    prog.append(("jset", CLONE_THREAD, "thread", "eperm"))
    labels["eperm"] = len(prog)
    prog.append((_RET, 0, 0, _RET_ERRNO | errno.EPERM))
    labels["enosys"] = len(prog)
    prog.append((_RET, 0, 0, _RET_ERRNO | errno.ENOSYS))
    labels["kill"] = len(prog)
    prog.append((_RET, 0, 0, _RET_KILL_PROCESS))
    labels["thread"] = len(prog)
    prog.append((_RET, 0, 0, _RET_ALLOW))
    out = bytearray()
    ops = {"jeq": _JEQ, "jge": _JGE, "jset": _JSET}
    for i, ins in enumerate(prog):
        if isinstance(ins[0], str):
            op, k, t, f = ins
            jt, jf = (0 if x == "next" else labels[x] - i - 1 for x in (t, f))
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise AssertionError("seccomp filter jump out of range")
            out += struct.pack("<HBBI", ops[op], jt, jf, k)
        else:
            out += struct.pack("<HBBI", *ins)
    return bytes(out)
