"""Issue 17 probe (a device call): the W4A4 + RAC 50% decode operand at the 1b decode shapes when rows have finished
(a fixed-slot decode routes a finished row's slots to no expert: the rows of no group, sorted last). 128 tokens x
top-8 over 64 experts (M = 1,024 sorted rows), K = 1,024 n = 512 (gate_up) and K = 256 n = 128 (down), with 0%, 50%
and 90% of the tokens finished. Each form replayed in a CUDA graph (benchmarks.bench_kernels.time_graph, median of
50 replays of 8 calls over distinct data): the whole operand (``factored.operands``: row maxima, group_units, RAC's
selection and units) and RAC's residual operand alone (``rac_units``), with the CUDA selection and the Triton one.
Run it on the current tree and on the tree before the rows of no group were zero rows (the call applies
``2027-01-11_no_group_zero_rows.patch`` in reverse to a copy): that tree's selection walks every masked row in one
program. Prints JSON lines.

    PYTHONPATH=. python3 -u scripts/device_calls/masked_rows_probe.py --label now
"""

import argparse
import json

import torch

from benchmarks.bench_kernels import time_graph
from quads.kernels import rac_select
from quads.model.moe import static_routes
from quads.quant import factored

ap = argparse.ArgumentParser()
ap.add_argument("--label", default="now", help="which tree this is (a field of every row)")
label = ap.parse_args().label
e, tokens, topk, copies = 64, 128, 8, 8
g = torch.Generator().manual_seed(0)
base = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
print(json.dumps({"gpu": torch.cuda.get_device_name(), "label": label, "torch": torch.__version__}), flush=True)


def probe(group: torch.Tensor, segs: factored.Segments, k: int) -> dict:
    """One K's times with these routes."""
    n, m = k // 2, group.shape[0]
    xs = [torch.randn(m, k, generator=g).mul(torch.logspace(-3, 1, k)).bfloat16().cuda() for _ in range(copies)]
    rs = [torch.randn(m, k, generator=g).mul(torch.logspace(-3, 1, k)).cuda() for _ in range(copies)]
    outs = [torch.empty(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    row = {"k": k, "n": n}
    for backend in ("cuda", "triton"):
        row[f"rac_units_{backend}_us"] = time_graph(
            [lambda i=i, b=backend: rac_select.rac_units(rs[i], group, e, outs[i], n=n, method="sort",
                                                         select_backend=b) for i in range(copies)]) * 1e6
    row["operands_us"] = time_graph(
        [lambda i=i: factored.operands(xs[i], segs, n=n, dtype=torch.bfloat16) for i in range(copies)]) * 1e6
    return row


for finished in (0.0, 0.5, 0.9):
    idx = base.clone()
    idx[: int(tokens * finished)] = e  # finished rows: every slot to no expert
    routes = static_routes(idx.cuda(), e)
    group = routes.expert.contiguous()
    segs = factored.Segments.of(group, e, routes.offsets)
    for k in (1024, 256):
        head = {"label": label, "finished": finished, "masked_rows": int((group == e).sum())}
        print(json.dumps(head | probe(group, segs, k)), flush=True)
