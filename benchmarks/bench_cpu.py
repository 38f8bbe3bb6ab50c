"""CPU timings of the main job's hot ops, natively and with the instruction set forced down to AVX2.

Each (ISA, what) pair runs in its own process, so the ISA switches of the libraries take effect at
load: ``--isa avx2`` sets ``ATEN_CPU_CAPABILITY=avx2`` (torch's vectorized kernels),
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL) and ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN) for that process, which
emulates an AVX2-only x86 CPU on an AVX-512 one (the CPU feature flags themselves still say AVX-512).

    python benchmarks/bench_cpu.py [--isa native,avx2] [--what micro,step] [--steps 2] [--profile]
                                   [--json out.jsonl] [--label after] [--tree DIR]

``--tree DIR``: import ``quads`` from another checkout (e.g. ``git archive <commit>`` unpacked), to time
the code before a change with the same script.

``micro``: one thread, the fastest and the median of ``--reps`` calls (the fastest is the one to
compare on a shared machine): ``nvfp4.quantize`` / ``nvfp4.qdq`` of a 4096x128
fp32 tensor, a 4096x128 @ 128x256 matmul in fp32 and bf16. ``step``: the default ``quads train``
config (warm start from the cache, ``QUADS_CACHE``), ``--threads`` torch threads, ``--steps`` GRPO steps
timed one by one (the first one included). ``--profile``: torch.profiler over the last step, the
top ops by self CPU time. One JSON line per (ISA, what) on stdout and appended to ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ISA_ENV = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _times_ms(fn, reps: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"min": round(min(times), 3), "median": round(statistics.median(times), 3)}


def micro(reps: int) -> dict:
    import torch

    from quads.formats import nvfp4

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 128, generator=g)
    w = torch.randn(128, 256, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    out = {}
    try:  # the GEMM route of quads.model.gemm (absent from older trees)
        from quads.model import gemm

        wt = wb.T.contiguous()
        out["matmul_bf16_quads_ms"] = _times_ms(lambda: gemm.linear(xb, wt), reps)
        out["native_bf16_gemm"] = gemm.native_bf16_gemm()
    except ImportError:
        pass
    return out | {
        "quads": os.path.dirname(os.path.dirname(nvfp4.__file__)),
        "nvfp4_quantize_ms": _times_ms(lambda: nvfp4.quantize(x), reps),
        "nvfp4_qdq_ms": _times_ms(lambda: nvfp4.qdq(x), reps),
        "nvfp4_qdq_bf16_ms": _times_ms(lambda: nvfp4.qdq(xb), reps),
        "matmul_fp32_ms": _times_ms(lambda: x @ w, reps),
        "matmul_bf16_ms": _times_ms(lambda: xb @ wb, reps),
    }


def step(n_steps: int, profile: bool, threads: int) -> dict:
    import torch

    from quads.rl.config import TrainConfig
    from quads.rl.trainer import GRPOTrainer

    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        cfg = TrainConfig()
        cfg.out_dir = os.path.join(d, "run")
        cfg.log.progress = False
        cfg.log.tensorboard = False
        cfg.threads = threads
        t0 = time.perf_counter()
        tr = GRPOTrainer(cfg, quiet=True)
        tr.setup()
        out["setup_s"] = time.perf_counter() - t0
        out["threads"] = torch.get_num_threads()
        out["quads"] = os.path.dirname(sys.modules["quads"].__file__)
        steps = []
        for s in range(1, n_steps + 1):
            if profile and s == n_steps:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as prof

                with prof(activities=[ProfilerActivity.CPU]) as p:
                    t0 = time.perf_counter()
                    m = tr.step(s)
                    steps.append(time.perf_counter() - t0)
                ka = sorted(p.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
                out["profile_top"] = [
                    {"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1), "calls": e.count} for e in ka[:25]
                ]
            else:
                t0 = time.perf_counter()
                m = tr.step(s)
                steps.append(time.perf_counter() - t0)
            out.setdefault("parts", []).append(
                {k: round(v, 3) for k, v in m.items() if k.startswith("time/")})
        out["step_s"] = [round(t, 3) for t in steps]
    return out


def child(args) -> None:
    import torch

    rec = {
        "label": args.label,
        "isa": args.isa,
        "what": args.what,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ.get(k) for k in ISA_ENV["avx2"]},
        "load_avg_1m": os.getloadavg()[0],
    }
    if args.what == "micro":
        rec.update(micro(args.reps))
    else:
        rec.update(step(args.steps, args.profile, args.threads))
    rec["load_avg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(rec), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="native,avx2", help="comma list of: native, avx2")
    ap.add_argument("--what", default="micro,step", help="comma list of: micro, step")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="step: torch threads (0: torch's default)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None, help="append the JSON lines to this file")
    ap.add_argument("--tree", default=None, help="import quads from this checkout")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    for isa in args.isa.split(","):
        if isa not in ISA_ENV:
            sys.exit(f"bench_cpu: unknown --isa {isa!r}; valid: {', '.join(ISA_ENV)}")
        for what in args.what.split(","):
            if what not in ("micro", "step"):
                sys.exit(f"bench_cpu: unknown --what {what!r}; valid: micro, step")
            env = {k: v for k, v in os.environ.items() if k not in ISA_ENV["avx2"]}
            env.update(ISA_ENV[isa])
            if args.tree:
                env["PYTHONPATH"] = os.path.abspath(args.tree)
            cmd = [sys.executable, __file__, "--child", "--isa", isa, "--what", what, "--steps", str(args.steps),
                   "--reps", str(args.reps), "--label", args.label, "--threads", str(args.threads)] + (["--profile"] if args.profile else [])
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode:
                sys.stderr.write(res.stderr)
                sys.exit(f"bench_cpu: the {isa}/{what} run failed (exit {res.returncode})")
            line = res.stdout.strip().splitlines()[-1]
            rec = json.loads(line)
            rec["command"] = " ".join(["python", "benchmarks/bench_cpu.py"] + sys.argv[1:])
            line = json.dumps(rec)
            print(line, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
