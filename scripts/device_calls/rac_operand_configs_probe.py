"""Issue 17 probe (a device call): rac_operand's time per launch config at the 1b decode shape K = 1024 (n = 512),
against the five launches. Prints JSON lines: (block_m, block_k, block_mr, num_warps, sort_run) -> us.
Ran (runs 67-69, docs/PERF.md) on the tree of 94f15cd; quads.kernels.rac_operand was removed after them (slower than
the five launches), so this needs `git checkout 94f15cd` to run again.
"""
import json
import sys

import torch
from quads.kernels.rac_operand import rac_operand

from benchmarks.bench_kernels import time_graph
from quads.kernels import dispatch
from quads.model.moe import static_routes
from quads.quant import factored

e, tokens, topk, k = 64, 128, 8, int(sys.argv[1]) if len(sys.argv) > 1 else 1024
g = torch.Generator().manual_seed(0)
idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).cuda()
segs = factored.Segments.of(static_routes(idx, e).expert, e)
x = torch.randn(tokens * topk, k, device="cuda").bfloat16()
out = torch.empty(tokens * topk, 2, k, dtype=torch.bfloat16, device="cuda")
with dispatch.kernels("triton"):
    print(json.dumps({"k": k, "five_launches_us": time_graph([lambda: factored.operands(
        x, segs, n=k // 2, dtype=torch.bfloat16, one_launch=False)]) * 1e6}), flush=True)
for cfg in ((4, 1024, 4, 16, None), (8, 1024, 8, None, None), (16, 1024, 16, None, None), (2, 1024, 2, None, None),
            (4, 1024, 4, 4, None), (4, 1024, 4, None, None)):
    kw = dict(zip(("block_m", "block_k", "block_mr", "num_warps", "sort_run"), cfg))
    us = time_graph([lambda kw=kw: rac_operand(x, segs.group, e, out, n=k // 2, **kw)]) * 1e6
    print(json.dumps({"k": k, "cfg": cfg, "one_launch_us": us}), flush=True)
