"""How far torch._scaled_mm / torch._scaled_grouped_mm (FP8 rowwise, sm90) are from the exact FP8 product: the worst
|y - exact| beyond BF16 output rounding, in units of sum_k |q_x q_w| s_x s_w (u32 = 2^-24 is fp32's unit roundoff),
with use_fast_accum False and True. Prints one JSON line per case. python3 -u scripts/device_calls/fp8_accum_probe.py"""
import json

import torch

from quads.formats import fp8
from quads.model.moe import static_routes
from quads.quant import fp8_scaled
from quads.quant.recipe import LinearSpec

SPEC = LinearSpec.of(weight="fp8", act="fp8")
for M, N, K in [(128, 1024, 1024), (1024, 512, 1024), (1024, 1024, 512), (1024, 2048, 1024), (1024, 1024, 256)]:
    torch.manual_seed(4)
    x = (torch.randn(M, K, device="cuda") * 2).bfloat16()
    E, k = 64, 8
    T = M // k
    idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    routes = static_routes(idx, E)
    ws = fp8_scaled.quantize_weight(torch.randn(E, N, K, device="cuda"), SPEC, torch.bfloat16)
    xs = x[:T][routes.order // k]
    a = fp8.quantize(xs, granularity="row")
    sw = ws.scale.squeeze(-1)[routes.expert.clamp_max(E - 1)].double()
    codes = ws.data.double()
    exact = routes.unpad(torch.bmm(routes.pad(a.data.double()), codes.mT)) * a.scale.double() * sw
    mag = routes.unpad(torch.bmm(routes.pad(a.data.double().abs()), codes.abs().mT)) * a.scale.double() * sw
    out = {"M": M, "N": N, "K": K}
    for fast in (False, True):
        y = torch._scaled_grouped_mm(a.data, ws.data.transpose(-2, -1), a.scale.view(-1), ws.scale.view(E, N),
                                     offs=routes.ends, out_dtype=torch.bfloat16, use_fast_accum=fast).double()
        excess = ((y - exact).abs() - 2.0**-8 * exact.abs()).clamp_min(0) / mag.clamp_min(1e-30)
        out[f"grouped_fast{int(fast)}_excess_in_u32"] = excess.max().item() / 2.0**-24
        out[f"grouped_fast{int(fast)}_rel_err_max"] = ((y - exact).abs() / mag.clamp_min(1e-30)).max().item()
    w = fp8_scaled.quantize_weight(torch.randn(N, K, device="cuda"), SPEC, torch.bfloat16)
    a2 = fp8.quantize(x, granularity="row")
    ex2 = fp8.scaled_mm_reference(a2, w, out_dtype=torch.float64)
    mag2 = (a2.data.double().abs() @ w.data.double().abs().T) * a2.scale.double() * w.scale.double().T
    for fast in (False, True):
        y = torch._scaled_mm(a2.data, w.data.t(), scale_a=a2.scale, scale_b=w.scale.t(), out_dtype=torch.bfloat16,
                             use_fast_accum=fast).double()
        excess = ((y - ex2).abs() - 2.0**-8 * ex2.abs()).clamp_min(0) / mag2
        out[f"dense_fast{int(fast)}_excess_in_u32"] = excess.max().item() / 2.0**-24
    print(json.dumps(out), flush=True)
