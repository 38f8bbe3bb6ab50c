"""Issue 17 probe (a device call): RAC's CUDA channel selection (quads.kernels.rac_select_cuda) against the Triton
selection it replaces, at the 1b decode shapes (128 tokens x top-8 over 64 experts, M = 1,024 sorted rows; K = 1,024
n = 512 for gate_up, K = 256 n = 128 for down), the same bits checked. Each form replayed in a CUDA graph
(benchmarks.bench_kernels.time_graph, median of 50 replays of 8 calls over distinct data): RAC's whole residual
operand (``rac_units``: selection + units kernel) and the selection alone, Triton (the tuning.json config) and CUDA
under each instantiated warp count, with the Triton units kernel after it. Prints JSON lines. Runs 79-80 (trees
1b8acbf and 729def6) also timed ``cuda_fused``, the units in the selection's blocks, removed since (slower).

    PYTHONPATH=. python3 -u scripts/device_calls/rac_select_cuda_probe.py
"""

import json
import time

import torch
import triton

from benchmarks.bench_kernels import time_graph
from quads.kernels import rac_select, rac_select_cuda, tuning
from quads.model.moe import static_routes

e, tokens, topk, copies = 64, 128, 8, 8
g = torch.Generator().manual_seed(0)
idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).cuda()
group = static_routes(idx, e).expert.contiguous()
m = tokens * topk
print(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": m, "experts": e,
                  "rows_per_expert_max": int(torch.bincount(group, minlength=e + 1)[:e].max())}), flush=True)


def probe(k: int) -> dict:
    """One K's row: the build time, the Triton and CUDA forms' times, whether each CUDA form wrote the same bits."""
    n = k // 2
    rs = [torch.randn(m, k, generator=g).mul(torch.logspace(-3, 1, k)).cuda() for _ in range(copies)]
    outs = [torch.empty(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    row = {"k": k, "n": n}
    t0 = time.time()
    rac_select_cuda.build()
    row["build_s"] = round(time.time() - t0, 1)

    def units(i, **kw):
        return rac_select.rac_units(rs[i], group, e, outs[i], n=n, method="sort", **kw)

    want = units(0, select_backend="triton")
    want = (outs[0].clone(), *want)
    row["triton_units_us"] = time_graph([lambda i=i: units(i, select_backend="triton") for i in range(copies)]) * 1e6
    kp = triton.next_power_of_2(k)
    cfg = tuning.config("rac_select", tuning.case("rac_select", f"k{kp}", "sort"))
    row["triton_config"] = cfg
    for lk, w in rac_select_cuda.CONFIGS:
        if lk != rac_select_cuda.log_kp(k):
            continue
        assert rac_select_cuda.supports(rs[0], group, w), (k, w)
        outs[0].fill_(7.0)
        got = units(0, select_backend="cuda", cuda_warps=w)
        row[f"cuda_w{w}_same_bits"] = (torch.equal(outs[0].view(torch.int16), want[0].view(torch.int16))
                                       and torch.equal(got[0].view(torch.int32), want[1].view(torch.int32))
                                       and torch.equal(got[1], want[2]))  # fmt: skip
        row[f"cuda_w{w}_units_us"] = time_graph(
            [lambda i=i, w=w: units(i, select_backend="cuda", cuda_warps=w) for i in range(copies)]) * 1e6
        bufs = (torch.empty(e, n, dtype=torch.long, device="cuda"), torch.empty(e, k, dtype=torch.int32, device="cuda"),
                torch.empty(e + 1, dtype=torch.float32, device="cuda"))  # S, rank, gmax
        row[f"cuda_w{w}_select_us"] = time_graph(
            [lambda i=i, w=w, b=bufs: rac_select_cuda.select(rs[i], group, *b, n=n, groups=e, per_token=False, warps=w)
             for i in range(copies)]) * 1e6  # fmt: skip
    return row


for k in (1024, 256):
    print(json.dumps(probe(k)), flush=True)
