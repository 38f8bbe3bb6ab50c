"""Issue 17 probe (a device call): the W4A4 + RAC 50% decode operand as one CUDA launch (``rac_operand_cuda``)
against the launches it replaces (``factored.operands`` with ``operand_backend="launches"``: the row maxima,
``group_units``, RAC's CUDA selection and its units kernel), at the 1b decode shapes: 128 tokens x top-8 over 64
experts (M = 1,024 sorted rows), K = 1,024 n = 512 (gate_up) and K = 256 n = 128 (down), with 0% and 50% of the
tokens finished (their slots: the rows of no group). Each form replayed in a CUDA graph
(``benchmarks.bench_kernels.time_graph``: median of 50 replays of 8 calls over distinct data); the one launch at
every instantiated warp count of the K. In the compiled step Inductor computes the row maxima inside the kernel that
makes the rows, so ``launches_no_rowmax_us`` times the launches given the row maxima as well, and
``w4a4_only_no_rowmax_us`` plain W4A4's operand (``group_units`` alone): RAC's own cost is the difference. Prints JSON
lines.

    PYTHONPATH=. python3 -u scripts/device_calls/rac_operand_cuda_probe.py
"""

import json

import torch

from benchmarks.bench_kernels import time_graph
from quads.kernels import rac_operand_cuda
from quads.kernels.factored_quant import group_units_op, rac_units_op
from quads.kernels.rac_select_cuda import log_kp
from quads.model.moe import static_routes
from quads.quant import factored

e, tokens, topk, copies = 64, 128, 8, 8
g = torch.Generator().manual_seed(0)
base = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)


def probe(segs: factored.Segments, k: int) -> dict:
    n, m = k // 2, segs.group.shape[0]
    xs = [torch.randn(m, k, generator=g).mul(torch.logspace(-3, 1, k)).bfloat16().cuda() for _ in range(copies)]
    row = {"k": k, "n": n}
    row["launches_us"] = time_graph([lambda i=i: factored.operands(xs[i], segs, n=n, dtype=torch.bfloat16,
                                                                   operand_backend="launches")
                                     for i in range(copies)]) * 1e6  # fmt: skip
    rmax = [factored.row_amax(x) for x in xs]
    offs = segs.row_offsets()
    bufs = [torch.empty(m, 2, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]

    def launches(i):
        gx, r = group_units_op(xs[i], rmax[i], segs.group, offs, e, bufs[i], 0, residual=True)
        gr, s = rac_units_op(r, segs.group, e, bufs[i], 1, n=n, per_token=False)
        return torch.stack([gx, gr], dim=1), s

    row["launches_no_rowmax_us"] = time_graph([lambda i=i: launches(i) for i in range(copies)]) * 1e6
    # plain W4A4's operand (group_units alone, given the row maxima): what RAC's operand adds to the step is the
    # difference
    row["w4a4_only_no_rowmax_us"] = time_graph(
        [lambda i=i: group_units_op(xs[i], rmax[i], segs.group, offs, e, bufs[i], 0) for i in range(copies)]) * 1e6
    for lk, warps in rac_operand_cuda.CONFIGS:
        if lk == log_kp(k):
            row[f"one_launch_w{warps}_us"] = time_graph(
                [lambda i=i, w=warps: rac_operand_cuda.operand(xs[i], offs, e, bufs[i], n=n, warps=w)
                 for i in range(copies)]) * 1e6  # fmt: skip
    # the same bits, once more here (the tests cover it in full)
    a = factored.operands(xs[0], segs, n=n, dtype=torch.bfloat16, operand_backend="launches")
    b = factored.operands(xs[0], segs, n=n, dtype=torch.bfloat16, operand_backend="cuda")
    row["same_bits"] = bool(torch.equal(a.u.view(torch.int16), b.u.view(torch.int16)) and torch.equal(a.g, b.g)
                            and torch.equal(a.channels, b.channels))  # fmt: skip
    return row


for finished in (0.0, 0.5):
    idx = base.clone()
    idx[: int(tokens * finished)] = e  # finished rows: every slot to no expert
    routes = static_routes(idx.cuda(), e)
    segs = factored.Segments.of(routes.expert.contiguous(), e, routes.offsets)
    for k in (1024, 256):
        head = {"finished": finished, "masked_rows": int((segs.group == e).sum())}
        print(json.dumps(head | probe(segs, k)), flush=True)
