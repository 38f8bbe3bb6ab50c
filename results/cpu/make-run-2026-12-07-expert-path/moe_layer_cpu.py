"""One tiny-preset expert layer alone on the CPU: the loop, the padded batch ("grouped") and ``forward_static``
(the sorted experts), median of 5 calls in ms, with the largest difference from the loop. Random routing, top-2 of
8, a bf16 model. Run from the repo root:
PYTHONPATH=. .venv/bin/python results/cpu/make-run-2026-12-07-expert-path/moe_layer_cpu.py w4a4+rac50,w4a16,bf16
(the numbers in moe_layer_cpu.txt are from the code before the loop shared its W4A4 operands, tree d5e624d)."""

import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import bench_e2e as B  # noqa: E402

from quads.quant.layers import QuantizedExperts  # noqa: E402

torch.manual_seed(0)
for name in sys.argv[1].split(","):
    model = B._model("tiny", "cpu", "bfloat16").requires_grad_(False)
    B._quantized(model, name, B.ROLLOUT_RECIPES[name], [[5] * 16], "cpu")
    ex = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    E = ex.num_experts
    for T in [128, 512, 1024, 2048]:
        x = torch.randn(T, 128, dtype=torch.bfloat16)
        logits = torch.randn(T, E)
        w, idx = logits.softmax(-1).topk(2, dim=-1)
        res = {}
        for path in ["loop", "grouped", "static"]:
            ex.grouped = path == "grouped"

            def f(path=path, ex=ex, x=x, idx=idx, w=w):
                if path == "static":
                    return ex.forward_static(x, idx, w.to(x.dtype))
                return ex(x, idx, w.to(x.dtype))

            try:
                with torch.no_grad():
                    f()
                    ts = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        y = f()
                        ts.append(time.perf_counter() - t0)
                res[path] = (round(sorted(ts)[2] * 1e3, 2), y.float())
            except Exception as e:  # a path that does not run is a result too
                res[path] = (str(e)[:60], None)
        ref = res["loop"][1]
        print(name, T, {p: (v[0], None if v[1] is None or ref is None else float((v[1] - ref).abs().max()))
                        for p, v in res.items()}, flush=True)
