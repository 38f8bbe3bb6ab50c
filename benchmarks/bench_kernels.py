"""NVFP4 kernel benchmarks on a CUDA GPU, against cuBLAS BF16 and FP8 measured in the same run.

Method (docs/PERF.md): every timed call is replayed from a CUDA graph that walks through several
distinct weight sets (more than 1 GB in all, so the 60 MB L2 cannot serve them); a time is the median
over many replays divided by the calls per replay. Ceilings measured in the same run: a device-to-
device copy (bytes read + written) and the BF16 ``torch.mm`` / FP8 ``torch._scaled_mm`` they compete
with. Prints hardware and versions, a table, and one JSON line at the end.

    python benchmarks/bench_kernels.py [--quick] [--json out.json]      (or: quads bench kernels)
"""

# ruff: noqa: B023  (closures in loops are captured into a CUDA graph at once, before the loop moves on)
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys

import torch

GB = 1e9
MS: list[int] = []  # --ms: the W4A16 token counts (default: all)


def _events_ms(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def time_graph(calls, reps: int = 50, warmup: int = 3) -> float:
    """Median seconds per call of ``calls`` (a list of closures over distinct data) replayed in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    return statistics.median(_events_ms(g.replay, reps)) / 1e3 / len(calls)


def time_plain(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    return statistics.median(_events_ms(fn, reps)) / 1e3


def env_info() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "sm": f"{p.major}.{p.minor}",
        "sms": p.multi_processor_count,
        "mem_gb": round(p.total_memory / GB, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = time_plain(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() / t


# ------------------------------------------------------------------------------------------ cases


def bench_quantize(rows: list, copy_bw: float, quick: bool) -> None:
    from quads.kernels import nvfp4_quant, rac

    t_, k = (8192, 8192) if quick else (16384, 8192)  # 128 / 256 MB of BF16
    x = torch.randn(t_, k, device="cuda").bfloat16()
    out_b = t_ * k // 2 + t_ * k // 16
    min_bytes = x.numel() * 2 + out_b
    cases = {
        "quantize per-token (1 pass)": (lambda: nvfp4_quant.nvfp4_quantize(x, per_token=True), min_bytes),
        "quantize per-tensor (amax pass + quantize)": (
            lambda: nvfp4_quant.nvfp4_quantize(x),
            min_bytes + 2 * x.numel(),
        ),
        "quantize given amax (1 pass)": (lambda: nvfp4_quant.nvfp4_quantize(x, amax=4.0), min_bytes),
        "RAC 0.5 quantize per-token": (lambda: rac.rac_quantize(x, k // 2, act_scale="token"), None),
        "RAC 0.5 quantize per-tensor": (lambda: rac.rac_quantize(x, k // 2, act_scale="tensor"), None),
    }
    for bm in (8, 16, 32):  # row-block sweep of the per-token quantize (tile = bm x 256)
        t = time_plain(lambda bm=bm: nvfp4_quant.nvfp4_quantize(x, per_token=True, block_m=bm), reps=10)
        rows.append({"bench": f"quantize per-token block_m={bm}", "shape": f"{t_}x{k} bf16", "us": t * 1e6,
                     "eff_TBps": min_bytes / t / 1e12, "frac_copy": min_bytes / t / copy_bw})  # fmt: skip
    for name, (fn, moved) in cases.items():
        t = time_plain(fn, reps=10)
        eff = min_bytes if "RAC" not in name else min_bytes + t_ * (k // 2) // 2 + t_ * (k // 2) // 16
        rows.append({"bench": name, "shape": f"{t_}x{k} bf16", "us": t * 1e6, "eff_TBps": eff / t / 1e12,
                     "frac_copy": eff / t / copy_bw, "moved_TBps": (moved / t / 1e12) if moved else None})  # fmt: skip


def _weight_sets(n: int, k: int, nsets: int):
    from quads.formats import nvfp4
    from quads.kernels import nvfp4_quant

    bf, fp4, fp8w = [], [], []
    for _ in range(nsets):
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        bf.append(w)
        fp4.append(nvfp4_quant.nvfp4_quantize(w))
        s = w.float().abs().amax() / 448.0
        fp8w.append(((w.float() / s).to(torch.float8_e4m3fn), s.reshape(()).float()))
        assert isinstance(fp4[-1], nvfp4.NVFP4Tensor)
    return bf, fp4, fp8w


def bench_w4a16(rows: list, copy_bw: float, quick: bool) -> None:
    from quads.kernels import gemm, nvfp4_quant

    shapes = [(8192, 8192), (28672, 4096)]
    ms = [1, 4, 16, 64, 256, 1024, 4096] if not quick else [1, 16, 64, 1024]
    if MS:
        ms = MS
    for n, k in shapes:
        nsets = max(4, int(3 * GB // (n * k * 2)))  # ~3 GB of BF16 weights, ~0.85 GB of NVFP4
        bf, fp4, fp8w = _weight_sets(n, k, nsets)
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            mp = max(16, m)
            x8 = torch.randn(mp, k, device="cuda").to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            t_bf = time_graph([lambda w=w: torch.mm(x, w.T) for w in bf])
            t_f8 = time_graph([lambda w=w: torch._scaled_mm(x8, w[0].T, one, w[1], out_dtype=torch.bfloat16)
                               for w in fp8w])  # fmt: skip
            t_fused = (
                time_graph([lambda q=q: gemm.w4a16_gemm(x, q) for q in fp4]) if m <= 1024 else float("nan")
            )
            impls = {}
            for impl in ("gemv", "dot", "tile") if m <= 64 else ():
                if impl == "gemv" and m > 8:
                    continue
                impls[impl] = time_graph([lambda q=q: gemm.w4a16_gemm(x, q, impl=impl) for q in fp4]) * 1e6
            t_fb = (time_graph([lambda q=q: x @ nvfp4_quant.nvfp4_dequantize(q, torch.bfloat16).T for q in fp4])
                    if m >= 256 else float("nan"))  # fmt: skip
            best = min(t for t in (t_fused, t_fb) if t == t)
            wbytes = n * k // 2 + n * k // 16
            rows.append({"bench": "W4A16 GEMM", "shape": f"M={m} N={n} K={k}", "us": best * 1e6,
                         "fused_us": t_fused * 1e6, "dequant_mm_us": t_fb * 1e6, "bf16_us": t_bf * 1e6,
                         "fp8_us": t_f8 * 1e6, "impl_us": impls, "x_vs_bf16": t_bf / best, "x_vs_fp8": t_f8 / best,
                         "w_TBps": wbytes / best / 1e12, "frac_copy": wbytes / best / copy_bw,
                         "TFLOPs": 2 * m * n * k / best / 1e12})  # fmt: skip
        del bf, fp4, fp8w
        torch.cuda.empty_cache()


def bench_w4a16_sweep(rows: list) -> None:
    """Config sweep of the word-decode W4A16 kernels at decode (8192x8192) to pick the defaults."""
    from quads.kernels import gemm

    n, k = 8192, 8192
    _, fp4, _ = _weight_sets(n, k, 16)
    configs = {
        1: [("gemv", bn, bk, sk, nw) for bn, bk, sk, nw in
            [(64, 256, None, 4), (128, 256, None, 4), (64, 512, None, 4), (32, 256, None, 4), (32, 512, None, 4),
             (128, 512, None, 8), (64, 256, 1, 4), (16, 512, 1, 4), (64, 256, None, 8)]]
           + [("dot", 64, 256, None, 4), ("dot", 128, 256, None, 4)],
        16: [("dot", bn, bk, sk, nw) for bn, bk, sk, nw in
             [(64, 256, None, 4), (128, 256, None, 4), (64, 512, None, 4), (128, 128, None, 4), (64, 128, None, 4),
              (128, 256, None, 8), (64, 256, 1, 4), (128, 512, None, 8)]],
    }  # fmt: skip
    for m, cfgs in configs.items():
        x = torch.randn(m, k, device="cuda").bfloat16()
        for impl, bn, bk, sk, nw in cfgs:
            try:
                t = time_graph(
                    [
                        lambda q=q: gemm.w4a16_gemm(
                            x, q, impl=impl, block_n=bn, block_k=bk, split_k=sk, num_warps=nw
                        )
                        for q in fp4
                    ]
                )
            except Exception as e:  # a config that does not compile is skipped, and said so
                print(f"sweep M={m} {impl} bn={bn} bk={bk} split={sk} nw={nw}: {type(e).__name__}: {e}"[:300],
                      file=sys.stderr)  # fmt: skip
                continue
            rows.append({"bench": "W4A16 sweep", "shape": f"M={m} N={n} K={k} {impl} bn={bn} bk={bk} split={sk} nw={nw}",
                         "us": t * 1e6})  # fmt: skip
    del fp4
    torch.cuda.empty_cache()


def bench_moe(rows: list, quick: bool) -> None:
    from quads.kernels import gemm, nvfp4_quant

    e, n, k, topk = 128, 1536, 2048, 8  # Qwen3-30B-A3B gate_up
    nsets = 2 if quick else 4
    for tokens in (1, 16, 64):
        sets = []
        for _ in range(nsets):
            w = (torch.randn(e, n, k, device="cuda") * 0.02).bfloat16()
            amax = w.float().abs().amax(dim=(-2, -1), keepdim=True)
            sets.append((w, nvfp4_quant.nvfp4_quantize(w, amax=amax)))
        ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(tokens)]).flatten()
        counts = torch.bincount(ids, minlength=e)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        offs = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), ends])
        x = torch.randn(ids.numel(), k, device="cuda").bfloat16()
        t_q = time_graph([lambda q=q: gemm.w4a16_grouped_gemm(x, q, offs) for _, q in sets])
        impls = {}
        for impl, bn in (("gemv", 64), ("gemv", 32), ("dot", 64), ("dot", 32), ("tile", 64)):
            try:
                impls[f"{impl} bn={bn}"] = (
                    time_graph(
                        [
                            lambda q=q: gemm.w4a16_grouped_gemm(x, q, offs, impl=impl, block_n=bn)
                            for _, q in sets
                        ]
                    )
                    * 1e6
                )
            except Exception as ex:
                print(f"moe {impl} bn={bn}: {type(ex).__name__}: {ex}"[:300], file=sys.stderr)
        try:
            t_bf = time_graph(
                [lambda w=w: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends) for w, _ in sets]
            )
            base = "torch._grouped_mm bf16"
        except Exception as ex:
            print(
                f"torch._grouped_mm unavailable ({type(ex).__name__}: {ex}); per-expert torch.mm loop",
                file=sys.stderr,
            )
            o = offs.tolist()
            live = [i for i in range(e) if o[i + 1] > o[i]]
            t_bf = time_graph(
                [lambda w=w: [torch.mm(x[o[i] : o[i + 1]], w[i].T) for i in live] for w, _ in sets]
            )
            base = "per-expert torch.mm bf16"
        active = int((counts > 0).sum())
        wbytes = active * (n * k // 2 + n * k // 16)
        rows.append({"bench": "grouped MoE W4A16", "shape": f"T={tokens} top{topk} E={e} N={n} K={k} active={active}",
                     "us": t_q * 1e6, "impl_us": impls, "bf16_us": t_bf * 1e6, "x_vs_bf16": t_bf / t_q, "baseline": base,
                     "w_TBps": wbytes / t_q / 1e12})  # fmt: skip
        del sets
        torch.cuda.empty_cache()


def bench_w4a4(rows: list) -> None:
    from quads.kernels import dispatch, gemm, nvfp4_quant, rac

    n, k = 8192, 8192
    _, fp4, _ = _weight_sets(n, k, 16)
    for m in (1, 16, 64):
        x = torch.randn(m, k, device="cuda").bfloat16()
        res = {}
        for ratio in (0.0, 0.5):
            nsel = int(ratio * k)
            q = rac.rac_quantize(x, nsel, act_scale="token", scatter=nsel > 0)
            rs = None if q.residual is None else q.residual.global_scale
            res[f"gemm{ratio}"] = time_graph([lambda w=w: gemm.w4a4_gemm(q.x, w, residual=q.scattered, residual_scale=rs)
                                              for w in fp4])  # fmt: skip
            res[f"e2e{ratio}"] = time_graph([lambda w=w: dispatch.w4a4_linear(x, w, rac_channels=nsel, act_scale="token")
                                             for w in fp4])  # fmt: skip
        x16 = torch.randn(m, k, device="cuda").bfloat16()
        w16 = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(8)]
        t_bf = time_graph([lambda w=w: torch.mm(x16, w.T) for w in w16])
        rows.append({"bench": "W4A4 GEMM (emulated)", "shape": f"M={m} N={n} K={k}",
                     "us": res["gemm0.0"] * 1e6, "rac_us": res["gemm0.5"] * 1e6,
                     "rac_over_plain": res["gemm0.5"] / res["gemm0.0"], "x_vs_bf16": t_bf / res["gemm0.0"]})  # fmt: skip
        rows.append({"bench": "W4A4 linear incl. act quantize", "shape": f"M={m} N={n} K={k} token scale",
                     "us": res["e2e0.0"] * 1e6, "rac_us": res["e2e0.5"] * 1e6,
                     "rac_over_plain": res["e2e0.5"] / res["e2e0.0"]})  # fmt: skip
    _ = nvfp4_quant


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--only", default="quantize,w4a16,moe,w4a4,sweep", help="comma list of suites")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--ms", default="", help="comma list of W4A16 token counts (default: all)")
    args = ap.parse_args(argv)
    MS[:] = [int(v) for v in args.ms.split(",") if v]
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU; none found", file=sys.stderr)
        return 2
    info = env_info()
    print("hardware/versions:", json.dumps(info))
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)")
    rows: list[dict] = []
    suites = args.only.split(",")
    runners = {"quantize": lambda: bench_quantize(rows, copy_bw, args.quick),
               "w4a16": lambda: bench_w4a16(rows, copy_bw, args.quick), "sweep": lambda: bench_w4a16_sweep(rows),
               "moe": lambda: bench_moe(rows, args.quick), "w4a4": lambda: bench_w4a4(rows)}  # fmt: skip
    for s in suites:
        n0 = len(rows)
        try:
            runners[s]()
        except Exception as e:  # one broken suite must not lose the others' numbers; it is reported
            import traceback

            traceback.print_exc()
            rows.append({"bench": f"{s} FAILED", "shape": f"{type(e).__name__}: {e}"[:200]})
        for r in rows[n0:]:  # as they come, so that a run cut short still reports
            print("row", json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    keys = [
        "us",
        "x_vs_bf16",
        "x_vs_fp8",
        "eff_TBps",
        "frac_copy",
        "w_TBps",
        "rac_over_plain",
        "fused_us",
        "dequant_mm_us",
    ]
    print()
    print(f"{'bench':42s} {'shape':44s} " + " ".join(f"{k:>13s}" for k in keys))
    for r in rows:
        print(
            f"{r['bench'][:42]:42s} {r.get('shape', '')[:44]:44s} "
            + " ".join(f"{_fmt(r.get(k, '')):>13s}" for k in keys)
        )
    result = {"info": info, "copy_TBps": copy_bw / 1e12, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
