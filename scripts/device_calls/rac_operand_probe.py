"""Issue 17 probe (a device call): rac_operand's compile time and its time against the five launches it replaces at
the 1b decode shapes (K = 256 first, then 1024), the same bits checked. Prints JSON lines.
Ran (runs 67-69, docs/PERF.md) on the tree of 94f15cd; quads.kernels.rac_operand was removed after them (slower than
the five launches), so this needs `git checkout 94f15cd` to run again.
"""
import json
import time

import torch
from quads.kernels.rac_operand import rac_operand

from benchmarks.bench_kernels import time_graph
from quads.kernels import dispatch
from quads.model.moe import static_routes
from quads.quant import factored

e, tokens, topk = 64, 128, 8
g = torch.Generator().manual_seed(0)
idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).cuda()
segs = factored.Segments.of(static_routes(idx, e).expert, e)
for k in (256, 1024):
    x = torch.randn(tokens * topk, k, device="cuda").bfloat16()
    out = torch.empty(tokens * topk, 2, k, dtype=torch.bfloat16, device="cuda")
    t0 = time.time()
    gg, s = rac_operand(x, segs.group, e, out, n=k // 2)
    torch.cuda.synchronize()
    row = {"k": k, "first_call_s": time.time() - t0}
    with dispatch.kernels("triton"):
        want = factored.operands(x, segs, n=k // 2, dtype=torch.bfloat16, one_launch=False)
        row["same_bits"] = bool(torch.equal(out.view(torch.int16), want.u.view(torch.int16))
                                and torch.equal(gg.view(torch.int32), want.g.view(torch.int32))
                                and torch.equal(s, want.channels))
        row["one_launch_us"] = time_graph([lambda x=x, out=out, k=k: rac_operand(x, segs.group, e, out, n=k // 2)]) * 1e6
        row["five_launches_us"] = time_graph([lambda x=x, k=k: factored.operands(x, segs, n=k // 2, dtype=torch.bfloat16,
                                                                        one_launch=False)]) * 1e6
    print(json.dumps(row), flush=True)
