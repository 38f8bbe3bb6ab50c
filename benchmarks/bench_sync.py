"""Trainer -> rollout weight sync (``quads.quant.sync.WeightSync``): its host syncs, launches, temporaries, time.

    python benchmarks/bench_sync.py [--preset 100m] [--recipes nvfp4,quads] [--device cpu|cuda]
                                    [--kernels auto|triton|reference] [--warmup 1] [--reps 5] [--json out.json]

Per recipe: a trainer model (fp32 masters, its trainer side quantized) and a rollout model (``--rollout-dtype``,
default BF16, its rollout side quantized), as ``quads train`` builds them on one device, and the sync
``WeightSync(LocalWeights(trainer), ReplicaTarget(rollout)).run()`` (copy every state-dict tensor, the
reference operands' fingerprints, the rollout re-quantization, the fingerprint check). Before each sync every
master takes an in-place no-op (``mul_(1)``: bumps the version counters as an optimizer step does, so a QAT
trainer's cached ``QDQ(W)`` is stale, as it is after a step). ``--reps`` timed syncs after ``--warmup`` untimed
ones (CUDA events on CUDA, perf_counter elsewhere; median, IQR, min in ms), then one counted sync:

- ``host_syncs``: device-to-host reads (``_local_scalar_dense``: ``int()``, ``item()``, ``bool()``; ``nonzero``;
  ``equal``; ``tolist()``, counted once per call): on a GPU each waits for the queue, which other processes
  sharing the GPU fill too; the CPU count is the same program's;
- ``host_uploads``: ``torch.tensor(value, device=...)`` calls (a host value copied to the device: on CUDA a
  copy from pageable memory, which also waits for the queue);
- ``compute_ops``: ATen ops other than views and allocations (each a kernel launch on a GPU), by op;
- ``triton_launches``: quads' Triton kernels (``--kernels triton`` on a CPU needs ``TRITON_INTERPRET=1`` and
  small sizes: ``--hidden 64 --intermediate 64 --experts 4``);
- ``alloc_bytes``: bytes of every op's outputs (the temporaries and results the sync allocates, a count
  independent of the allocator), and ``largest_alloc_bytes``, the largest single one; on CUDA also
  ``peak_extra_bytes``, the allocator's peak above the memory held before the sync.

The last line is the JSON record.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_qat_refresh import VIEW_OPS, _count_triton, env_info  # noqa: E402

from quads.bench import add_model_overrides, add_run_args, model_overrides, run_args, timer  # noqa: E402
from quads.kernels import dispatch  # noqa: E402
from quads.model import ModelConfig, MoEForCausalLM  # noqa: E402
from quads.quant import quantize_model  # noqa: E402
from quads.quant.sync import LocalWeights, ReplicaTarget, WeightSync  # noqa: E402

ALLOC_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal"}
SYNC_METHODS = {"tolist", "numpy"}  # Tensor methods that read a device tensor back to the host


def counted(fn, inside: list[bool], triton_n: collections.Counter) -> dict:
    """Host syncs, ATen compute ops, quads' Triton launches and output bytes of one ``fn()``."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    syncs: collections.Counter = collections.Counter()
    in_method, uploads = [False], [0]

    class Methods(TorchFunctionMode):
        def __torch_function__(self, func, types, a=(), kw=None):
            name = getattr(func, "__name__", "")
            if name in ("tensor", "as_tensor") and (kw or {}).get("device") is not None and not in_method[0] \
                    and not isinstance(a[0] if a else None, torch.Tensor):
                uploads[0] += 1  # a host value copied to the device: on CUDA a synchronous copy
            if name in SYNC_METHODS and not in_method[0]:
                syncs[name] += 1
                in_method[0] = True  # a tolist() on CUDA copies to the host first: not counted twice
                try:
                    return func(*a, **(kw or {}))
                finally:
                    in_method[0] = False
            return func(*a, **(kw or {}))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.bytes, self.largest = 0, 0

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            if inside[0] or in_method[0]:
                return out
            name = func.overloadpacket.__name__
            if name in SYNC_OPS:
                syncs[name] += 1
            elif name not in VIEW_OPS:
                self.ops[name] += 1
                if not name.endswith("_"):  # an in-place op (copy_, add_) allocates nothing
                    for t in (out if isinstance(out, (tuple, list)) else (out,)):
                        if isinstance(t, torch.Tensor):
                            n = t.numel() * t.element_size()
                            self.bytes += n
                            self.largest = max(self.largest, n)
            return out

    triton_n.clear()
    with Methods(), Ops() as c:
        fn()
    compute = {k: v for k, v in c.ops.items() if k not in ALLOC_OPS}
    return {"host_syncs": sum(syncs.values()), "host_uploads": uploads[0], "compute_ops": sum(compute.values()),
            "triton_launches": sum(triton_n.values()), "alloc_bytes": c.bytes, "largest_alloc_bytes": c.largest,
            "syncs_by_op": dict(syncs), "compute_by_op": dict(sorted(compute.items(), key=lambda kv: -kv[1])),
            "triton_by_kernel": dict(triton_n)}


def _stats(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
    med = statistics.median(ms)
    return {"median": med, "min": min(ms), "iqr_pct": 100 * (q[2] - q[0]) / med, "n": len(ms), "raw": ms}


def build(cfg: ModelConfig, recipe: str, device: str, rollout_dtype: str) -> tuple[MoEForCausalLM, MoEForCausalLM]:
    torch.manual_seed(0)
    with torch.device(device):
        trainer = MoEForCausalLM(cfg)
        rollout = MoEForCausalLM(dataclasses.replace(cfg, dtype=rollout_dtype))
    rollout.requires_grad_(False)
    quantize_model(trainer, recipe, side="trainer", verbose=False)
    quantize_model(rollout, recipe, side="rollout", verbose=False)
    return trainer, rollout


def bench_recipe(args, cfg: ModelConfig, recipe: str, inside: list[bool], triton_n: collections.Counter) -> dict:
    trainer, rollout = build(cfg, recipe, args.device, args.rollout_dtype)
    sync = WeightSync(LocalWeights(trainer), ReplicaTarget(rollout))
    params = list(trainer.parameters())

    def bump():  # what an optimizer step does to the version counters, without moving a weight
        with torch.no_grad():
            for p in params:
                p.mul_(1.0)

    timed = timer(args.device)
    ms, reports = [], []
    for rep in range(args.warmup + args.reps):
        bump()
        t = timed(lambda: reports.append(sync.run()))
        if rep >= args.warmup:
            ms.append(t)
    bump()
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    counts = counted(lambda: reports.append(sync.run()), inside, triton_n)
    if cuda:
        counts["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
    rep = reports[-1]
    return {"ms": _stats(ms), **counts, "n_tensors": rep.n_tensors, "n_bytes": rep.n_bytes,
            "n_checked": rep.n_checked, "ok": all(r.ok for r in reports),
            "fingerprints": {k: [f.total, f.weighted] for k, f in rep.fingerprints.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="100m", help="model preset (quads.model.config.PRESETS)")
    ap.add_argument("--recipes", default="nvfp4,quads", help="comma list of recipe presets")
    add_model_overrides(ap, vocab=True)
    ap.add_argument("--rollout-dtype", default="bfloat16", help="the rollout model's dtype (quads train: dtype)")
    ap.add_argument("--kernels", default="auto", choices=dispatch.BACKENDS,
                    help="kernel backend (quads.kernels.dispatch); triton on a CPU needs TRITON_INTERPRET=1")
    add_run_args(ap, warmup=1, reps=5, warmup_help="untimed syncs first (kernel compiles)",
                 reps_help="timed syncs per recipe")
    args = ap.parse_args(argv)
    run_args(ap, args)
    over = model_overrides(args)
    cfg = ModelConfig.preset(args.preset, **{**over, "dtype": "float32"})
    triton_n: collections.Counter = collections.Counter()
    inside = [False]
    rec = {"what": "weight_sync", "info": env_info(args.device), "command": "python " + " ".join(sys.argv),
           "args": vars(args), "preset": args.preset, "overrides": over, "recipes": {}}
    with dispatch.kernels(args.kernels):
        _count_triton(triton_n, inside)
        for recipe in [r.strip() for r in args.recipes.split(",") if r.strip()]:
            r = bench_recipe(args, cfg, recipe, inside, triton_n)
            rec["recipes"][recipe] = r
            print(f"{recipe:>10}: {r['ms']['median']:9.2f} ms (IQR {r['ms']['iqr_pct']:.0f}%, min {r['ms']['min']:.2f}, "
                  f"n={r['ms']['n']})  {r['host_syncs']} host syncs, {r['host_uploads']} uploads, {r['compute_ops']} ATen compute ops, "
                  f"{r['triton_launches']} Triton launches, {r['alloc_bytes'] / 2**20:.0f} MiB allocated "
                  f"(largest {r['largest_alloc_bytes'] / 2**20:.0f} MiB); {r['n_checked']} operands checked, ok={r['ok']}",
                  flush=True)
    print(json.dumps(rec))
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1))
    return 0 if all(r["ok"] for r in rec["recipes"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
