"""W4A16-QAT's per-step weight cache refresh (issue 22): the per-weight refresh against the grouped one.

    python benchmarks/bench_qat_refresh.py [--preset 100m] [--device cpu|cuda] [--kernels auto|triton|reference]
                                           [--hidden H --intermediate I --experts E --layers L]
                                           [--warmup 2] [--reps 7] [--json out.json]

Builds the preset's model (fp32 masters, as the trainer holds them) and quantizes its trainer side under
``--recipe`` (default ``w4a16-qat``: every layer's routed expert stacks). Two ways to refresh every
quantized weight after an optimizer step, each timed ``--reps`` times, interleaved, after ``--warmup``
untimed rounds:

- ``per_weight``: one ``ops.quantize_weight(param, spec, dtype)`` per weight, what the trainer ran before
  (a dtype cast, a NaN-ignoring amax in fp32, a quantize writing codes and scales, a dequantize);
- ``grouped``: ``quads.quant.layers.refresh_stale(model)`` after an in-place no-op on every parameter
  (``mul_(1)``: bumps the version counters as an optimizer step does), what the trainer runs now
  (``ops.qat_weights``: on a Triton device two launches per weight shape for all layers; elsewhere the
  fused ``nvfp4.qdq`` in ~1 MiB expert chunks).

CUDA: timed with CUDA events from an idle device; elsewhere perf_counter. Reported per way: median, IQR,
min (ms); the GB/s of the refresh's least traffic (read each master twice, write each operand once:
the amax pass and the fused pass) against the device's copy bandwidth measured in the same run (read +
write), the ceiling; and, from one extra counted refresh, its ATen compute ops, quads' Triton kernel
launches (``--kernels triton`` on a CPU needs ``TRITON_INTERPRET=1`` and small ``--hidden`` /
``--intermediate`` / ``--experts``: the counts depend on the number of weights, not their sizes) and host
syncs. The grouped operands are checked bit-equal to the per-weight ones. The last line is the JSON record.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quads.bench import add_model_overrides, add_run_args, cpu_name, model_overrides, run_args, timer  # noqa: E402
from quads.kernels import dispatch  # noqa: E402
from quads.model import ModelConfig, MoEForCausalLM  # noqa: E402
from quads.quant import ops, quantize_model  # noqa: E402
from quads.quant.layers import refresh_stale, trainer_stores  # noqa: E402

VIEW_OPS = {"view", "_unsafe_view", "reshape", "expand", "narrow", "slice", "select", "as_strided", "t",
            "transpose", "permute", "unsqueeze", "squeeze", "detach", "alias", "unbind", "split", "chunk",
            "view_as", "lift_fresh", "_reshape_alias", "unfold", "diagonal", "split_with_sizes"}
ALLOC_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero"}


def _count_triton(counter: collections.Counter, inside: list[bool]) -> None:
    """Wrap every Triton kernel of ``quads.kernels`` so that each launch adds to ``counter``; ``inside[0]``
    is True during a launch (Triton's CPU interpreter runs ATen ops of its own, not counted)."""
    import importlib
    import pkgutil

    import quads.kernels as pkg

    class _Counted:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            counter[self.name] += 1
            launch = self.fn[grid]

            def run(*a, **kw):
                inside[0] = True
                try:
                    return launch(*a, **kw)
                finally:
                    inside[0] = False

            return run

    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"quads.kernels.{info.name}")
        for name, obj in list(vars(mod).items()):
            if name.endswith("_kernel") and hasattr(obj, "__getitem__") and not isinstance(obj, _Counted):
                setattr(mod, name, _Counted(name, obj))


def _counts(fn, inside: list[bool], triton_n: collections.Counter) -> dict:
    """ATen compute ops, quads' Triton launches and host syncs of one ``fn()``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if not inside[0]:
                self.ops[func.overloadpacket.__name__] += 1
            return func(*a, **(kw or {}))

    triton_n.clear()
    with Count() as c:
        fn()
    compute = {k: v for k, v in c.ops.items() if k not in VIEW_OPS | ALLOC_OPS | SYNC_OPS}
    return {"compute_ops": sum(compute.values()), "triton_launches": sum(triton_n.values()),
            "host_syncs": sum(c.ops[k] for k in SYNC_OPS),
            "compute_by_op": dict(sorted(compute.items(), key=lambda kv: -kv[1])), "triton_by_kernel": dict(triton_n)}


def copy_bandwidth(device: str, mib: int = 512) -> float:
    """Bytes read + written per second by a device copy of ``mib`` MiB (median of 5)."""
    n = (mib if device.startswith("cuda") else min(mib, 128)) * 2**20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    timed = timer(device)
    b.copy_(a)
    return 2 * n / (statistics.median(timed(lambda: b.copy_(a)) for _ in range(5)) * 1e-3)


def _stats(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
    med = statistics.median(ms)
    return {"median": med, "min": min(ms), "iqr_pct": 100 * (q[2] - q[0]) / med, "n": len(ms), "raw": ms}


def env_info(device: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
            "threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0]}
    if device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    else:
        info.update(cpu=cpu_name(), cores=os.cpu_count())
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="100m", help="model preset (quads.model.config.PRESETS)")
    add_model_overrides(ap)
    ap.add_argument("--kernels", default="auto", choices=dispatch.BACKENDS,
                    help="kernel backend (quads.kernels.dispatch); triton on a CPU needs TRITON_INTERPRET=1")
    ap.add_argument("--recipe", default="w4a16-qat", help="trainer-side recipe")
    add_run_args(ap, warmup=2, reps=7, warmup_help="untimed rounds of both first",
                 reps_help="timed refreshes of each, interleaved")
    args = ap.parse_args(argv)
    run_args(ap, args)
    over = model_overrides(args)
    cfg = ModelConfig.preset(args.preset, vocab_size=128, dtype="float32", **over)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = MoEForCausalLM(cfg)
    quantize_model(model, args.recipe, side="trainer", verbose=False)
    stores = trainer_stores(model)
    params = list(model.parameters())
    timed = timer(args.device)

    def per_weight():
        return [ops.quantize_weight(s.param, s.spec, s.dtype) for s in stores]

    def bump():  # what an optimizer step does to the version counters, without moving a weight
        with torch.no_grad():
            for p in params:
                p.mul_(1.0)

    times: dict[str, list[float]] = {"per_weight": [], "grouped": []}
    with dispatch.kernels(args.kernels):
        refresh_stale(model)  # the first quantization (and kernel compiles)
        triton_used = dispatch.use_triton(stores[0].param)
        same = all(torch.equal(s.w_q, w_q) for s, (w_q, _) in zip(stores, per_weight(), strict=True))
        for rep in range(args.warmup + args.reps):
            t_old = timed(per_weight)
            bump()
            t_new = timed(lambda: refresh_stale(model))
            if rep >= args.warmup:
                times["per_weight"].append(t_old)
                times["grouped"].append(t_new)
        triton_n: collections.Counter = collections.Counter()
        inside = [False]
        _count_triton(triton_n, inside)  # after the timing: the wrappers cost a little per launch
        counts = {"per_weight": _counts(per_weight, inside, triton_n)}
        bump()
        counts["grouped"] = _counts(lambda: refresh_stale(model), inside, triton_n)
    assert all(not s.stale() for s in stores), "refresh_stale left a stale cache"
    elements = sum(s.param.numel() for s in stores)
    least = sum(s.param.numel() * (2 * s.param.element_size() + s.w_q.element_size()) for s in stores)
    bw = copy_bandwidth(args.device)
    shapes = collections.Counter(str(tuple(s.param.shape)) for s in stores)
    rec = {"what": "qat_refresh", "info": env_info(args.device), "command": "python " + " ".join(sys.argv),
           "args": vars(args), "preset": args.preset, "overrides": over, "recipe": args.recipe,
           "kernel_backend": args.kernels, "uses_triton": triton_used,
           "weights": len(stores), "weight_shapes": dict(shapes), "quantized_elements": elements,
           "least_bytes": least, "copy_gbps": bw / 1e9, "grouped_equals_per_weight": same}
    for way in times:
        st = _stats(times[way])
        rec[way] = {"ms": st, "gbps_of_least_bytes": least / (st["median"] * 1e-3) / 1e9, **counts[way]}
    rec["speedup"] = rec["per_weight"]["ms"]["median"] / rec["grouped"]["ms"]["median"]
    for way in times:
        r = rec[way]
        print(f"{way:>10}: {r['ms']['median']:9.2f} ms (IQR {r['ms']['iqr_pct']:.0f}%, min {r['ms']['min']:.2f}, "
              f"n={r['ms']['n']})  {r['gbps_of_least_bytes']:7.1f} GB/s of the least traffic (copy {bw / 1e9:.0f} GB/s)  "
              f"{r['compute_ops']} ATen compute ops, {r['triton_launches']} Triton launches, {r['host_syncs']} host syncs")
    print(f"{args.preset} {over or ''} {args.device} kernels={args.kernels}: {len(stores)} weights {dict(shapes)}; "
          f"grouped {rec['speedup']:.2f}x faster; bit-equal: {same}")
    print(json.dumps(rec))
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
