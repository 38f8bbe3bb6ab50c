"""The gloo exit abort without quads: two torchrun ranks, one gloo all_reduce on an ``nn.Parameter``
(a tensor with Python state), ``wait()``, drop the tensor, exit.

After ``wait()`` returns, gloo's worker thread still holds the collective's tensors; its release of the
last reference to a tensor with Python state takes the GIL. When the main thread is already finalizing
the interpreter, CPython ends that thread with a forced unwind through a ``noexcept`` frame:
``terminate called without an active exception``, SIGABRT (pytorch/pytorch#190489). ``--end-process``
ends each rank with ``quads.rl.distributed.end_process`` instead (exit handlers, then ``os._exit``).

    python scripts/gloo_exit_abort.py --runs 10                 # aborts in some runs
    python scripts/gloo_exit_abort.py --runs 10 --end-process   # never

Prints one line per run and ends in a JSON line ``{"runs", "aborts", "failed", "end_process"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ABORT = "terminate called without an active exception"


def worker(end: bool) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.nn.Parameter(torch.ones(1 << 20), requires_grad=False)
    dist.all_reduce(t, async_op=True).wait()
    del t  # gloo's worker thread may still hold the collective's reference
    if end:
        from quads.rl.distributed import end_process

        end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--end-process", action="store_true", help="end each rank with distributed.end_process")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.end_process)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    aborts = failed = 0
    for i in range(a.runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), __file__, "--worker", *(["--end-process"] if a.end_process else [])]
        with tempfile.TemporaryFile("w+") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=120).returncode
            log.seek(0)
            aborted = ABORT in log.read()
        aborts += aborted
        failed += rc != 0
        print(f"run {i}: exit {rc}{' (gloo exit abort)' if aborted else ''}", flush=True)
    print(json.dumps({"runs": a.runs, "aborts": aborts, "failed": failed, "end_process": a.end_process}))


if __name__ == "__main__":
    main()
