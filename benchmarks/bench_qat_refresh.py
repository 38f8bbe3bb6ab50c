"""What W4A16-QAT's per-step weight cache refresh launches (issue 22): ops, Triton launches, host syncs.

    python benchmarks/bench_qat_refresh.py [--preset 100m] [--hidden H --intermediate I --experts E]
                                           [--kernels reference] [--reps 3] [--json out.json] [--tree DIR]

Builds the preset's model (fp32 masters, as the trainer holds them), quantizes its trainer side under
``w4a16-qat`` (the default targets: every layer's routed expert stacks), then ``--reps`` times: an
in-place update of every parameter (what an optimizer step does to the version counters), and one
``quads.quant.layers.refresh_stale(model)`` (the refresh the trainer runs once per optimizer step,
eagerly before its compiled forward; the plain forward makes the same calls lazily) counted under a
``TorchDispatchMode``. Reported per refresh and per weight stack:

- ``compute_ops``: ATen ops that launch work on a GPU (everything but views, ``empty*`` allocations
  and ``_local_scalar_dense``); on CUDA each is one kernel, except ``cat`` / ``stack`` / ``copy_`` with a
  dtype change over several inputs (one per input) and ``_to_copy`` (one);
- ``triton_launches``: launches of quads' Triton kernels (``--kernels triton`` on a CPU needs
  ``TRITON_INTERPRET=1``; use ``--hidden`` / ``--intermediate`` / ``--experts`` to shrink the stacks, which
  changes no count: the counts depend on the number of stacks, not their sizes);
- ``host_syncs``: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``.tolist()``) and ``nonzero``;
- ``refresh_ms``: wall time of the refresh on this machine (median; a CPU number when run on a CPU).

``--tree DIR``: import ``quads`` from another checkout (e.g. ``git worktree add /tmp/before <commit>``),
to count the code before a change with the same script. The last line is the JSON record.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

VIEW_OPS = {"view", "_unsafe_view", "reshape", "expand", "narrow", "slice", "select", "as_strided", "t",
            "transpose", "permute", "unsqueeze", "squeeze", "detach", "alias", "unbind", "split", "chunk",
            "view_as", "lift_fresh", "_reshape_alias", "unfold", "diagonal", "split_with_sizes"}
ALLOC_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero"}


def _count_triton(counter: collections.Counter, inside: list[bool]):
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="100m", help="model preset (quads.model.config.PRESETS)")
    ap.add_argument("--hidden", type=int, default=0, help="override hidden_size (0 = the preset's)")
    ap.add_argument("--intermediate", type=int, default=0, help="override moe_intermediate_size (0 = the preset's)")
    ap.add_argument("--experts", type=int, default=0, help="override n_experts (0 = the preset's)")
    ap.add_argument("--kernels", default="reference", choices=("reference", "triton", "auto"),
                    help="kernel backend (quads.kernels.dispatch); triton on a CPU needs TRITON_INTERPRET=1")
    ap.add_argument("--recipe", default="w4a16-qat", help="trainer-side recipe")
    ap.add_argument("--reps", type=int, default=3, help="refreshes timed (one counted)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default="", help="also append the record to this file (JSON lines)")
    ap.add_argument("--tree", default="", help="import quads from this checkout")
    args = ap.parse_args(argv)
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import quads
    from quads.kernels import dispatch
    from quads.model import ModelConfig, MoEForCausalLM
    from quads.quant import quantize_model
    from quads.quant.layers import _QuantizedBase, refresh_stale

    over = {k: v for k, v in (("hidden_size", args.hidden), ("moe_intermediate_size", args.intermediate),
                              ("n_experts", args.experts)) if v}
    cfg = ModelConfig.preset(args.preset, vocab_size=128, dtype="float32", **over)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = MoEForCausalLM(cfg)
    quantize_model(model, args.recipe, side="trainer", verbose=False)
    stores = [s for m in model.modules() if isinstance(m, _QuantizedBase) for s in m.stores.values()]
    shapes = collections.Counter(tuple(s.param.shape) for s in stores)
    triton_n: collections.Counter = collections.Counter()
    inside = [False]
    _count_triton(triton_n, inside)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if not inside[0]:
                self.ops[func.overloadpacket.__name__] += 1
            return func(*a, **(kw or {}))

    def step():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-4)  # bumps the version counter, as an optimizer step does

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    times, count = [], None
    with dispatch.kernels(args.kernels):
        refresh_stale(model)  # the first quantization (and kernel compiles)
        for rep in range(args.reps + 1):
            step()
            sync()
            if rep == 0:
                triton_n.clear()
                with Count() as count:
                    refresh_stale(model)
                continue
            t0 = time.perf_counter()
            refresh_stale(model)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    assert all(s.key == s._key() for s in stores), "refresh_stale left a stale cache"
    ops = count.ops
    compute = {k: v for k, v in ops.items() if k not in VIEW_OPS | ALLOC_OPS | SYNC_OPS}
    n = len(stores)
    rec = {
        "what": "qat_refresh", "preset": args.preset, "overrides": over, "recipe": args.recipe,
        "kernels": args.kernels, "device": args.device, "quads": os.path.dirname(quads.__file__),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0],
        "stacks": n, "stack_shapes": {str(k): v for k, v in shapes.items()},
        "quantized_params": sum(s.param.numel() for s in stores),
        "compute_ops": sum(compute.values()), "compute_ops_per_stack": round(sum(compute.values()) / n, 2),
        "all_aten_ops": sum(ops.values()),
        "triton_launches": sum(triton_n.values()), "host_syncs": sum(ops[k] for k in SYNC_OPS),
        "compute_by_op": dict(sorted(compute.items(), key=lambda kv: -kv[1])),
        "triton_by_kernel": dict(triton_n), "other_ops": {k: v for k, v in ops.items() if k not in compute},
        "refresh_ms": {"median": round(statistics.median(times), 2), "min": round(min(times), 2),
                       "all": [round(t, 2) for t in times]} if times else None,
    }
    print(f"{args.preset} {over or ''} kernels={args.kernels}: {n} stacks {dict(shapes)}; per refresh "
          f"{rec['compute_ops']} compute ops ({rec['compute_ops_per_stack']} per stack), "
          f"{rec['triton_launches']} Triton launches, {rec['host_syncs']} host syncs; "
          f"refresh {rec['refresh_ms']['median'] if times else '-'} ms ({args.device})")
    print(json.dumps(rec))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
