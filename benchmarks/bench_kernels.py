"""NVFP4 kernel benchmarks on a CUDA GPU, against cuBLAS BF16 and FP8 measured in the same run.

Method (docs/PERF.md): every timed call is replayed from a CUDA graph that walks through several
distinct weight sets (more than 1 GB in all, so the 60 MB L2 cannot serve them); a time is the median
over many replays divided by the calls per replay. Ceilings measured in the same run: a device-to-
device copy (bytes read + written) and the BF16 ``torch.mm`` / FP8 ``torch._scaled_mm`` they compete
with. Prints hardware and versions, a table, and one JSON line at the end.

    python benchmarks/bench_kernels.py [--quick] [--json out.json]      (or: quads bench kernels)

Suite "tune" (not in the default list): the config sweep of every tuned kernel, each config passed to
its launcher as explicit arguments; ``--tuning-out FILE`` writes the fastest config of each case in
the form of ``quads/kernels/tuning.json`` (the launch configs the launchers read; copy the file over
it to adopt them, then rerun the other suites). Run it as a script: its configs are compiled by
``--workers`` spawned processes first. ``--tune-kinds moe`` sweeps the grouped MoE kernel alone
(Qwen3-30B-A3B's gate_up at T = 1, 16, 64 and the 1b preset's decode GEMMs); the table's shared "decode"
entry comes from a sweep of every shape, and each 1b shape gets its own ``n{N}_k{K}_decode`` entry where its
fastest config differs (``--tune-moe-shapes 1b``: those entries alone).
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
    from quads.kernels import nvfp4_quant
    from quads.prototype.kernels import rac

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
    t = time_plain(lambda: nvfp4_quant.row_amax(x), reps=10)  # the amax pass of per-tensor, alone
    rows.append({"bench": "row_amax (read only)", "shape": f"{t_}x{k} bf16", "us": t * 1e6,
                 "eff_TBps": x.numel() * 2 / t / 1e12, "frac_copy": x.numel() * 2 / t / copy_bw})  # fmt: skip
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
    """``quads.kernels.w4a16.gemm`` (packed weights) against cuBLAS BF16 ``torch.mm`` and FP8
    ``_scaled_mm``: the launcher's choice (``us``; ``tuning.json`` ``w4a16_dispatch.dense``), the tiled
    ``tl.dot`` kernel at every M (``fused_us``) and the GEMV kernel at M <= 16 (``gemv_us``), side by
    side; weight bytes read per second and as a fraction of the copy (of the launcher's choice); at M <= 64
    every CUDA grouped-kernel config on the weights as one-expert stacks (rows of their own)."""
    from quads.kernels import tuning, w4a16

    nan = float("nan")
    shapes = [(8192, 8192), (28672, 4096)]
    ms = [1, 4, 16, 64, 256, 1024, 4096] if not quick else [1, 16, 64, 1024]
    if MS:
        ms = MS
    for n, k in shapes:
        nsets = max(4, int(3 * GB // (n * k * 2)))  # ~3 GB of BF16 weights, ~0.85 GB of NVFP4
        bf, fp4, fp8w = _weight_sets(n, k, nsets)
        packed = [w4a16.pack(q) for q in fp4]
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            mp = max(16, m)
            x8 = torch.randn(mp, k, device="cuda").to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            t_bf = time_graph([lambda w=w: torch.mm(x, w.T) for w in bf])
            t_f8 = time_graph([lambda w=w: torch._scaled_mm(x8, w[0].T, one, w[1], out_dtype=torch.bfloat16)
                               for w in fp8w])  # fmt: skip
            t_fused = time_graph([lambda p=p: w4a16.gemm(x, p, kernel="tiled") for p in packed])
            t_gemv = time_graph([lambda p=p: w4a16.gemm(x, p, kernel="gemv") for p in packed]) if m <= 16 else nan
            # the launcher's own choice (w4a16_dispatch.dense: the CUDA kernel, GEMV, tiled, or dequantize_bf16 +
            # cuBLAS), timed as the launcher runs it
            dense = tuning.config("w4a16_dispatch", "dense")
            t = time_graph([lambda p=p: w4a16.gemm(x, p) for p in packed])
            wbytes = n * k // 2 + n * k // 16
            if m <= 64:  # the CUDA grouped decode kernel on the weight as a one-expert stack (ends = [M])
                ones = [(None, p.as_stack()) for p in packed]
                ends = torch.full((1,), m, dtype=torch.int32, device="cuda")
                _bench_cuda_rows(rows, x, ones, ends, n, k, f"M={m} N={n} K={k}", t, t_bf, wbytes, copy_bw,
                                bench="W4A16 GEMM cuda (one-expert stack)")
            rows.append({"bench": "W4A16 GEMM", "shape": f"M={m} N={n} K={k}", "us": t * 1e6,
                         "fused_us": t_fused * 1e6, "gemv_us": t_gemv * 1e6, "gemv_x_vs_bf16": t_bf / t_gemv,
                         "fused_x_vs_bf16": t_bf / t_fused,
                         "dequant_mm_us": t * 1e6 if m > dense["fused_max_m"] else nan,
                         "bf16_us": t_bf * 1e6, "fp8_us": t_f8 * 1e6, "x_vs_bf16": t_bf / t, "x_vs_fp8": t_f8 / t,
                         "w_TBps": wbytes / t / 1e12, "frac_copy": wbytes / t / copy_bw,
                         "bf16_w_TBps": 2 * n * k / t_bf / 1e12, "TFLOPs": 2 * m * n * k / t / 1e12})  # fmt: skip
        del bf, fp4, fp8w, packed
        torch.cuda.empty_cache()


# (experts, N, K, tokens, top-k, what): Qwen3-30B-A3B's gate_up at decode, and the 1b preset's expert
# GEMMs at its decode batch (128 rows x top-8 = 1024 routed rows, ~16 per expert)
MOE_SHAPES = [(128, 1536, 2048, t, 8, "qwen3-30b gate_up") for t in (1, 4, 16, 64)] + [
    (64, 512, 1024, 128, 8, "1b gate_up"), (64, 1024, 256, 128, 8, "1b down")]


def _routed(e: int, tokens: int, topk: int, dev: str = "cuda", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert for ``tokens`` x top-``topk`` random routes: (counts [E], ends [E] int32)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).flatten().to(dev)
    counts = torch.bincount(ids, minlength=e)
    return counts, torch.cumsum(counts, 0).to(torch.int32)


def _expert_stacks(e: int, n: int, k: int) -> list[tuple[torch.Tensor, object]]:
    """(BF16 stack [E, N, K], its packed NVFP4 ``W4A16Weight``) pairs, >= 1.5 GB of BF16 in all (cold in the L2)."""
    from quads.kernels import nvfp4_quant, w4a16

    sets = []
    for _ in range(max(2, int(1.5 * GB // (e * n * k * 2)))):
        w = (torch.randn(e, n, k, device="cuda") * 0.02).bfloat16()
        amax = w.float().abs().amax(dim=(-2, -1), keepdim=True)
        sets.append((w, w4a16.pack(nvfp4_quant.nvfp4_quantize(w, amax=amax))))
    return sets


def bench_moe(rows: list, quick: bool, copy_bw: float) -> None:
    """``quads.kernels.w4a16.grouped_gemm`` (packed expert stacks, device offsets) against
    ``torch._grouped_mm`` over the BF16 stacks, at ``MOE_SHAPES``."""
    from quads.kernels import w4a16

    for e, n, k, tokens, topk, what in MOE_SHAPES[::2] if quick else MOE_SHAPES:
        sets = _expert_stacks(e, n, k)
        counts, ends = _routed(e, tokens, topk)
        x = torch.randn(tokens * topk, k, device="cuda").bfloat16()
        t_q = time_graph([lambda p=p: w4a16.grouped_gemm(x, p, ends) for _, p in sets])
        t_bf = time_graph([lambda w=w: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends) for w, _ in sets])
        active = int((counts > 0).sum())
        wbytes = active * (n * k // 2 + n * k // 16)
        rows.append({"bench": "grouped MoE W4A16", "shape": f"{what} T={tokens} top{topk} E={e} N={n} K={k} "
                     f"active={active}", "us": t_q * 1e6, "bf16_us": t_bf * 1e6, "x_vs_bf16": t_bf / t_q,
                     "baseline": "torch._grouped_mm bf16", "w_TBps": wbytes / t_q / 1e12,
                     "frac_copy": wbytes / t_q / copy_bw, "bf16_w_TBps": active * n * k * 2 / t_bf / 1e12})  # fmt: skip
        _bench_cuda_rows(rows, x, sets, ends, n, k, f"{what} T={tokens} top{topk} E={e} N={n} K={k}", t_q, t_bf, wbytes,
                        copy_bw)  # fmt: skip
        del sets
        torch.cuda.empty_cache()


# the 1b preset's expert GEMMs at its prefill (128 rows x 16 prompt tokens x top-8 = 16,384 routed rows, ~256 per
# expert), where the launcher dequantizes the stack to BF16 for torch._grouped_mm (above fused_max_rows_per_expert)
MOE_PREFILL_SHAPES = [(64, 512, 1024, 2048, 8, "1b gate_up prefill"), (64, 1024, 256, 2048, 8, "1b down prefill")]
# the fused kernel's launch configs timed there beside the table's (block_m, block_n, block_k, num_warps, num_stages):
# an expert's ~256 rows in fewer M tiles (each M tile decodes its K tiles again), wider N tiles
MOE_PREFILL_CONFIGS = [(128, 64, 128, 4, 3), (128, 64, 128, 8, 3), (256, 64, 128, 8, 3), (128, 128, 128, 8, 3),
                       (64, 128, 128, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 4, 4), (64, 64, 128, 4, 4)]


def bench_moe_prefill(rows: list, copy_bw: float) -> None:
    """At ``MOE_PREFILL_SHAPES``: the launcher's choice (``us``; ``w4a16_dispatch.grouped.fused_max_rows_per_expert``
    picks), the fused tiled kernel with the prefill config (``fused_us``), the dequant path (``dequant_path_us``:
    dequantize_bf16 + ``torch._grouped_mm`` + the zeroed rows past the last offset), the dequantize alone
    (``dequant_us``) and ``torch._grouped_mm`` on the BF16 stacks; then a row per
    fused-kernel config in ``MOE_PREFILL_CONFIGS`` (bits checked equal to the table config's)."""
    from quads.kernels import w4a16

    for e, n, k, tokens, topk, what in MOE_PREFILL_SHAPES:
        sets = _expert_stacks(e, n, k)
        _, ends = _routed(e, tokens, topk)
        x = torch.randn(tokens * topk, k, device="cuda").bfloat16()
        t_q = time_graph([lambda p=p: w4a16.grouped_gemm(x, p, ends) for _, p in sets])
        t_fused = time_graph([lambda p=p: w4a16.grouped_gemm(x, p, ends, fused_max_rows_per_expert=1 << 30)
                              for _, p in sets])  # fmt: skip
        t_dqp = time_graph([lambda p=p: w4a16.grouped_gemm(x, p, ends, fused_max_rows_per_expert=0) for _, p in sets])
        t_dq = time_graph([lambda p=p: w4a16.dequantize_bf16(p) for _, p in sets])
        t_bf = time_graph([lambda w=w: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends) for w, _ in sets])
        wbytes = e * (n * k // 2 + n * k // 16)
        row = {"bench": "grouped MoE W4A16 prefill", "shape": f"{what} T={tokens} top{topk} E={e} N={n} K={k}",
               "us": t_q * 1e6, "fused_us": t_fused * 1e6, "dequant_path_us": t_dqp * 1e6, "dequant_us": t_dq * 1e6,
               "bf16_us": t_bf * 1e6,
               "x_vs_bf16": t_bf / t_q, "fused_x_vs_bf16": t_bf / t_fused,
               "dequant_frac_copy": (wbytes + e * n * k * 2) / t_dq / copy_bw}  # fmt: skip
        rows.append(row)
        print("row", json.dumps(row), flush=True)
        want = w4a16.grouped_gemm(x, sets[0][1], ends, fused_max_rows_per_expert=1 << 30)
        for bm, bn, bk, warps, stages in MOE_PREFILL_CONFIGS:
            cfg = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=1,
                       fused_max_rows_per_expert=1 << 30)
            row = {"bench": "grouped MoE W4A16 prefill config", "shape": f"{what} T={tokens} top{topk} E={e} N={n} "
                   f"K={k}", "cfg": [bm, bn, bk, warps, stages], "table_fused_us": t_fused * 1e6}  # fmt: skip
            try:
                row["same_bits"] = bool(torch.equal(w4a16.grouped_gemm(x, sets[0][1], ends, **cfg), want))
                t = time_graph([lambda p=p: w4a16.grouped_gemm(x, p, ends, **cfg) for _, p in sets])
                row.update(us=t * 1e6, x_vs_bf16=t_bf / t, x_vs_table=t_fused / t)
            except Exception as err:  # noqa: BLE001 - recorded, the other configs still run
                row["error"] = f"{type(err).__name__}: {str(err)[-500:]}"
            rows.append(row)
            print("row", json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()


def _bench_cuda_rows(rows, x, sets, ends, n, k, shape, t_triton, t_bf, wbytes, copy_bw,
                    bench="grouped MoE W4A16 cuda") -> None:
    """The CUDA grouped decode kernel (``w4a16_cuda``, each compiled config that takes the shape) on the same
    weight sets and routes as the Triton row beside it (``x_vs_triton``: against ``t_triton``, the Triton
    launcher's time; ``x_vs_bf16`` against ``t_bf``, cuBLAS or ``torch._grouped_mm``); a failed build or launch is
    a row with its error."""
    from quads.kernels import w4a16, w4a16_cuda

    if not w4a16_cuda.available():
        return
    want = w4a16.grouped_gemm(x, sets[0][1], ends, backend="triton")  # the Triton kernel's output, once
    for ng, nt, warps, ksplit in w4a16_cuda.CONFIGS:
        if not w4a16_cuda.supports(x, n, k, ng, warps, ksplit):
            continue
        row = {"bench": bench, "shape": shape, "cfg": [ng, nt, warps, ksplit]}
        try:
            fns = [lambda p=p: w4a16_cuda.grouped_gemm(x, p.codes, p.scales, p.global_scale, ends, n, k, ng=ng, nt=nt,
                                                       warps=warps, ksplit=ksplit) for _, p in sets]  # fmt: skip
            got = fns[0]()
            t = time_graph(fns)
            row.update({"us": t * 1e6, "triton_us": t_triton * 1e6, "bf16_us": t_bf * 1e6, "x_vs_bf16": t_bf / t,
                        "x_vs_triton": t_triton / t, "w_TBps": wbytes / t / 1e12, "frac_copy": wbytes / t / copy_bw,
                        "max_rel_vs_triton": float((got.double() - want.double()).abs().max()
                                                    / want.double().abs().max().clamp_min(1e-30))})  # fmt: skip
        except Exception as err:  # noqa: BLE001 - recorded, the other rows still run
            row["error"] = f"{type(err).__name__}: {str(err)[-2000:]}"
        rows.append(row)
        print("row", json.dumps(row), flush=True)


def bench_w4a4(rows: list) -> None:
    from quads.prototype.kernels import gemm, linear, rac

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
            res[f"e2e{ratio}"] = time_graph([lambda w=w: linear.w4a4_linear(x, w, rac_channels=nsel, act_scale="token")
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


ATTN_SHAPES = [(128, 4, 4, 64, "1b"), (128, 4, 2, 64, "100m")]  # decode batch B, nkv, g, D, preset


def bench_attention(rows: list, copy_bw: float) -> None:
    """Decode attention at the engine's fixed-shape decode step (128 rows, a cache of S columns of which
    ``length`` are written): ``decode_attention`` (reads the written columns only) against the engine's
    SDPA call over the whole cache with the key mask, and the floor of reading the written keys and
    values once at the measured copy bandwidth. Several caches per timed replay (cold in the L2)."""
    import torch.nn.functional as F

    from quads.kernels import decode_attention as da

    for b, h, g, d, preset in ATTN_SHAPES:
        for s, lengths in ((128, (80, 128)), (544, (272, 544)), (4096, (1024, 2048, 4096))):
            nsets = max(2, int(1.0 * GB // (2 * b * h * s * d * 2)))
            sets = [(torch.randn(b, h, g, d, device="cuda").bfloat16(), torch.randn(b, h, s, d, device="cuda").bfloat16(),
                     torch.randn(b, h, s, d, device="cuda").bfloat16()) for _ in range(nsets)]  # fmt: skip
            for n in lengths:
                mask = torch.zeros(b, s, dtype=torch.bool, device="cuda")
                mask[:, :n] = True
                last = torch.tensor([n - 1], device="cuda")  # n columns written
                t_sdpa = time_graph([lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
                                     for q, k, v in sets])  # fmt: skip
                t_da = time_graph([lambda q=q, k=k, v=v: da.decode_attention(q, k, v, mask, last) for q, k, v in sets])
                floor = 2 * b * h * n * d * 2 / copy_bw  # written keys + values read once, at the copy rate
                rows.append({"bench": "decode attention", "shape": f"{preset} B={b} nkv={h} g={g} D={d} S={s} length={n}",
                             "us": t_da * 1e6, "sdpa_us": t_sdpa * 1e6, "x_vs_sdpa": t_sdpa / t_da,
                             "floor_us": floor * 1e6, "x_floor": t_da / floor})  # fmt: skip
            del sets
            torch.cuda.empty_cache()


def bench_routes(rows: list) -> None:
    """The MoE slots sorted by expert (``quads::expert_routes``, one launch) against its torch reference
    (``expert_routes_reference``: the counting sort and ``expert_slots``) compiled by Inductor, CUDA-graph
    replays: the 1b decode step (128 tokens x top-8 of 64, a quarter of the rows finished), Qwen3-30B-A3B's
    (128 experts) and a prefill (2,048 tokens). Each checks the kernel's integers against the reference's."""
    from quads.kernels import expert_routes as er

    ref = torch.compile(er.expert_routes_reference, dynamic=False, fullgraph=True)
    for t, k, e, what in ((128, 8, 64, "1b decode"), (128, 8, 128, "qwen3 decode"), (2048, 8, 64, "1b prefill")):
        g = torch.Generator().manual_seed(0)
        sets = []
        for _ in range(4):
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            ids[: t // 4] = e  # finished rows: every slot masked
            sets.append(ids.cuda())
        same = all(torch.equal(a, b) for a, b in zip(er.expert_routes_op(sets[0], e), ref(sets[0], e)))
        t_kernel = time_graph([lambda x=x: er.expert_routes_op(x, e) for x in sets])
        t_inductor = time_graph([lambda x=x: ref(x, e) for x in sets])
        rows.append({"bench": "expert routes (sort slots by expert)", "shape": f"{what} T={t} k={k} E={e}",
                     "us": t_kernel * 1e6, "inductor_us": t_inductor * 1e6, "x_vs_inductor": t_inductor / t_kernel,
                     "same_as_reference": same})  # fmt: skip


def bench_prologue(rows: list) -> None:
    """The decode step's attention prologue at the engine's shapes (128 rows, one new token, a cache of S
    columns): ``decode_qkv`` (q/k norm, RoPE, the cache write in one kernel) against the same operations
    (``decode_qkv_reference``, the model's eager code) compiled by Inductor, as the compiled decode step
    runs them without the kernel, and eager. Several layers' operands per timed replay."""
    from quads.kernels import decode_qkv as dq

    for b, h, g, d, preset in ATTN_SHAPES:
        for s in (128, 640):
            nh = h * g
            sets = []
            for _ in range(8):
                a = {"q": torch.randn(b, nh * d), "k": torch.randn(b, h * d), "v": torch.randn(b, h * d),
                     "q_weight": 1 + 0.1 * torch.randn(d), "k_weight": 1 + 0.1 * torch.randn(d),
                     "cos": torch.rand(b, d), "sin": torch.rand(b, d),
                     "k_cache": torch.randn(b, h, s, d), "v_cache": torch.randn(b, h, s, d)}
                sets.append({n: t.to("cuda", torch.bfloat16) for n, t in a.items()})
            pos = torch.tensor([s // 2], device="cuda")
            ref = torch.compile(dq.decode_qkv_reference, dynamic=False, fullgraph=True)
            t_kernel = time_graph([lambda a=a: dq.decode_qkv_op(**a, eps=1e-6, pos=pos) for a in sets])
            t_inductor = time_graph([lambda a=a: ref(**a, eps=1e-6, pos=pos) for a in sets])
            t_eager = time_graph([lambda a=a: dq.decode_qkv_reference(**a, eps=1e-6, pos=pos) for a in sets])
            rows.append({"bench": "decode prologue", "shape": f"{preset} B={b} nh={nh} nkv={h} D={d} S={s}",
                         "us": t_kernel * 1e6, "inductor_us": t_inductor * 1e6, "eager_us": t_eager * 1e6,
                         "x_vs_inductor": t_inductor / t_kernel})  # fmt: skip


RAC_SHAPES = [(1024, "gate_up"), (256, "down")]  # the 1b's expert projections: K, name
RAC_SELECT_WARPS = (None, 16)  # rac_units' select_warps (None: its default, KP / 128 within 4..16)
RAC_SORT_RUNS = (None, 256, 128)  # rac_units' sort_run (None: one sorted run of all K; runs of 64 spill at K = 1024)


# group_units launch configs (block_m, block_k, cols, num_warps); the first is its default. (Run 73 timed the group
# amaxes by one program per group, slower in the 1b step; until 2026-12-07 (j) they were an atomic max per row into a
# zero-filled buffer, two launches in front of the quantize.)
GROUP_UNITS_CONFIGS = [(8, 128, None, 4), (16, 128, None, 4), (4, 128, None, 4), (8, 64, None, 4),
                       (16, 256, None, 4), (8, 256, None, 4), (4, 64, None, 2), (8, 128, 256, 4)]


def bench_rac(rows: list) -> None:
    """``factored.operands`` (W4A4 + RAC 50%, dynamic selection) at the 1b decode shapes: 128 tokens x
    top-8 over 64 experts (M = 1024 sorted rows), the residual operand by the fused ``quads::rac_units``
    with each selection method (``sort``: a bitonic sort per expert; ``count``: K x K rank counting; ``us``
    is the default method's) against the step-by-step path (same Triton quantize kernels, torch
    selection), W4A4 alone (``w4a4_us``: the decode operand, ``factored_quant.group_units`` after the row maxima;
    ``w4a4_steps_us``: row amax, group max and quantize as three steps), RAC 50% with a calibrated channel order
    (``static_us``: ``quads::rac_static_units`` and the norms it observes), the residual operand alone on W4A4's
    residual per sorted run and warps of the select kernel (``residual_sort_run_us``: ``[sort_run, select_warps,
    us]``, ``RAC_SORT_RUNS`` x ``RAC_SELECT_WARPS``),
    and ``group_units`` alone per launch
    config (``GROUP_UNITS_CONFIGS``, the first its default: ``group_units_us``; the fastest:
    ``group_units_best_us``)."""
    from quads.kernels import dispatch
    from quads.kernels.factored_quant import group_units
    from quads.kernels.rac_select import default_method, rac_units
    from quads.model.moe import static_routes
    from quads.quant import factored

    e, tokens, topk = 64, 128, 8
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).cuda()
    routes = static_routes(idx, e)
    segs = factored.Segments.of(routes.expert, e, routes.offsets)
    cases = (("sort", None, True, "sort", True), ("count", None, True, "count", True),
             ("unfused", None, False, None, True), ("w4a4", 0, True, None, True),
             ("w4a4_steps", 0, True, None, False))  # name, n (None: K/2), fused RAC, selection method, fused amax
    for k, what in RAC_SHAPES:
        xs = [torch.randn(tokens * topk, k, device="cuda").bfloat16() for _ in range(4)]
        t = {}
        with dispatch.kernels("triton"):
            for name, n, fused, method, one in cases:
                n = k // 2 if n is None else n
                t[name] = time_graph([lambda x=x: factored.operands(x, segs, n=n, dtype=torch.bfloat16, fused_rac=fused,
                                                                    rac_method=method, fused_amax=one) for x in xs])  # fmt: skip
            # RAC 50% with a calibrated order (no sort), observing the norms as the rollout does
            order = torch.stack([torch.randperm(k, device="cuda") for _ in range(e)])
            t["static"] = time_graph([lambda x=x: factored.operands(x, segs, n=k // 2, dtype=torch.bfloat16,
                                                                    selection="static", static_order=order,
                                                                    observe=lambda r, norms: None) for x in xs])  # fmt: skip
            # the residual operand alone (quads::rac_units' sort path on W4A4's residual), its select kernel's channels
            # sorted in one run or in runs merged by binary search (sort_run)
            rs = [x.float() - factored.operands(x, segs, n=0, dtype=torch.float32).dequantized() for x in xs]
            res_out = torch.empty(tokens * topk, k, dtype=torch.bfloat16, device="cuda")
            for run in RAC_SORT_RUNS:
                for warps in RAC_SELECT_WARPS:
                    if run is None or run < k:
                        t[("residual", run, warps)] = time_graph([
                            lambda r=r, run=run, w=warps: rac_units(r, segs.group, e, res_out, n=k // 2, method="sort",
                                                                    sort_run=run, select_warps=w)
                            for r in rs])  # fmt: skip
            # the W4A4 operand's quantize alone (the group amaxes from given row maxima), per launch config
            out = torch.empty(tokens * topk, k, dtype=torch.bfloat16, device="cuda")
            rmax, offs = [factored.row_amax(x) for x in xs], segs.row_offsets()
            for cfg in GROUP_UNITS_CONFIGS:
                kw = dict(zip(("block_m", "block_k", "cols", "num_warps"), cfg))
                t[cfg] = time_graph([lambda x=x, m=m, kw=kw: group_units(x, m, segs.group, offs, e, out, **kw)
                                     for x, m in zip(xs, rmax, strict=True)])  # fmt: skip
        default = default_method(k)
        rows.append({"bench": "RAC 50% operands (1b decode)", "shape": f"{what} M={tokens * topk} E={e} K={k} "
                     f"n={k // 2}", "us": t[default] * 1e6, "method": default, "sort_us": t["sort"] * 1e6,
                     "count_us": t["count"] * 1e6, "unfused_us": t["unfused"] * 1e6, "w4a4_us": t["w4a4"] * 1e6,
                     "static_us": t["static"] * 1e6,
                     "residual_sort_run_us": [[key[1], key[2], v * 1e6] for key, v in t.items()
                                              if isinstance(key, tuple) and key[0] == "residual"],
                     "w4a4_steps_us": t["w4a4_steps"] * 1e6, "group_units_us": t[GROUP_UNITS_CONFIGS[0]] * 1e6,
                     "group_units_best_us": min(t[c] for c in GROUP_UNITS_CONFIGS) * 1e6,
                     "group_units_cfg_us": [[list(c), t[c] * 1e6] for c in GROUP_UNITS_CONFIGS],
                     "count_over_sort": t["count"] / t["sort"], "x_vs_unfused": t["unfused"] / t[default]})  # fmt: skip


# the select kernel's configs the rac_select suite times: (sort_run, select_warps, select_rows, split_runs), None =
# tuning.json's rac_select; the split ones (a program per run, two launches) first, then the one-program ones
RAC_SELECT_CONFIGS = ((None, None, None, None), (256, None, None, True), (128, None, None, True), (64, None, None, True),
                      (128, None, 16, True), (64, 2, 16, True), (None, None, 8, None), (None, None, 16, None),
                      (None, 16, None, None), (None, 16, 16, None), (256, None, None, None), (128, 16, None, None),
                      (128, 16, 16, None))


def bench_rac_select(rows: list) -> None:
    """RAC's residual operand alone (``rac_units``' sort path: the select kernel + the units kernel) on W4A4's
    residual at the 1b decode shapes (as ``bench_rac``), per select-kernel config in ``RAC_SELECT_CONFIGS``
    (``sort_run``, ``select_warps``, ``select_rows``; the same bits in each): one row per shape and config, so
    that a run cut short keeps what it timed; the first config is the default."""
    from quads.kernels import dispatch
    from quads.kernels.rac_select import rac_units
    from quads.model.moe import static_routes
    from quads.quant import factored

    e, tokens, topk = 64, 128, 8
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).cuda()
    segs = factored.Segments.of(static_routes(idx, e).expert, e)
    for k, what in RAC_SHAPES:
        xs = [torch.randn(tokens * topk, k, device="cuda").bfloat16() for _ in range(4)]
        with dispatch.kernels("triton"):
            rs = [x.float() - factored.operands(x, segs, n=0, dtype=torch.float32).dequantized() for x in xs]
        out = torch.empty(tokens * topk, k, dtype=torch.bfloat16, device="cuda")
        ref = None
        for run, warps, sel_rows, split in RAC_SELECT_CONFIGS:
            if run is not None and run >= k:
                continue
            call = [lambda r=r: rac_units(r, segs.group, e, out, n=k // 2, method="sort", sort_run=run,
                                          select_warps=warps, select_rows=sel_rows, split_runs=split) for r in rs]  # fmt: skip
            call[0]()
            same = True
            if ref is None:
                ref = out.clone()
            else:
                same = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
            us = time_graph(call) * 1e6
            rows.append({"bench": "RAC 50% residual operand (1b decode)", "shape": f"{what} M={tokens * topk} E={e} "
                         f"K={k} n={k // 2}", "us": us, "sort_run": run, "select_warps": warps,
                         "select_rows": sel_rows, "split_runs": split, "same_bits_as_default": same})  # fmt: skip
            print("timed", json.dumps(rows[-1]), flush=True)  # as each is timed (the compiles are long); "row" at the end


# ------------------------------------------------------------------------------------------ tune
# Config sweep of every tuned kernel in one device call. The configs are compiled first by worker
# processes in parallel (Triton's on-disk cache is shared), then timed one by one in this process.

TUNE_SHAPES = [(8192, 8192), (28672, 4096)]
# the grouped kernel's tune shapes: (group, (E, N, K, top-k), weight sets, token counts, row label)
TUNE_MOE_SETS = [("1b", (64, 512, 1024, 8), 8, (128,), "1b gate_up "), ("1b", (64, 1024, 256, 8), 8, (128,), "1b down "),
                 ("qwen3", (128, 1536, 2048, 8), 4, (1, 16, 64), "")]  # fmt: skip


def tune_space() -> list[tuple]:
    """(kind, key, config) for every config the sweep times (config tuples in launcher-argument order,
    see ``_tune_call``)."""
    out: list[tuple] = []
    for m in (1, 16):  # the dense tiled kernel (the 6th element: sub_k, the K tile decoded in parts)
        for bn in (32, 64, 128):
            for bk in (128, 256):
                for sk in (1, 2, 4, 8):
                    for nw, ns in ((4, 3), (4, 5), (8, 4)):
                        out.append(("w4a16", m, (bn, bk, sk, nw, ns, None)))
            for sk in (1, 2, 4):
                for nw, ns in ((4, 2), (4, 3)):
                    out.append(("w4a16", m, (bn, 256, sk, nw, ns, 64)))
    for bn in (32, 64, 128):
        for bk in (64, 128):
            for sk in (1, 2, 4):
                for nw, ns in ((4, 3), (8, 3)):
                    out.append(("w4a16", 64, (bn, bk, sk, nw, ns, None)))
        for sk in (1, 2):
            out.append(("w4a16", 64, (bn, 128, sk, 4, 3, 64)))
    # occupancy first (Nsight Compute, 1b decode: 225 registers, 2 blocks of 4 warps per SM): the K tile decoded
    # 64 columns at a time (sub_k, the 8th element), smaller decoded tiles (block_k 64), fewer stages, and a
    # register cap (the 7th, PTX .maxnreg); then the grid of run 6 (block_n, block_k, warps and stages,
    # split-K, M tile)
    moe = []
    for bn in (32, 64):  # the K tile decoded 64 columns at a time (the last element, sub_k)
        for bk in (128, 256):
            for nw, ns in ((4, 2), (4, 3), (8, 2), (8, 3)):
                for bm in (None, 16):
                    moe.append((bn, bk, nw, ns, None, bm, None, 64))
    for bn in (32, 64):
        for bk in (64, 128):
            for nw, ns in ((4, 2), (4, 3), (8, 2), (8, 3)):
                for bm in (None, 16):
                    for reg in (None, 128, 168):
                        moe.append((bn, bk, nw, ns, None, bm, reg, None))
    for bn in (16, 32, 64, 128):
        for bk in (128, 256):
            for nw, ns in ((4, 3), (4, 4), (8, 3)):
                for sk in (None, 1, 2):  # None: the launcher's split heuristic
                    for bm in (None, 16, 32):  # None: twice the mean rows per expert
                        moe.append((bn, bk, nw, ns, sk, bm, None, None))
    out += [("moe", 0, c) for c in dict.fromkeys(moe)]
    for cfg in ((1, None, 2), (1, None, 4), (1, None, 8), (2, None, 4), (2, 1024, 8), (2, 512, 4), (1, 1024, 4)):
        out.append(("quant_row", 0, cfg))
    for cfg in ((1, 2048, 8), (2, 1024, 8), (4, 256, 4), (8, 512, 8), (1, 1024, 4), (2, 2048, 8), (2, 512, 2)):
        out.append(("quant_amax_tile", 0, cfg))
    for cfg in ((4, 1024, 4), (2, 1024, 4), (8, 1024, 8), (4, 512, 4), (2, 2048, 8)):
        out.append(("row_amax", 0, cfg))
    for cfg in ((16, 64, 4, 2048), (16, 64, 4, 4096), (8, 64, 4, 2048), (32, 64, 4, 2048), (16, 128, 4, 2048)):
        out.append(("rac_pass2", 0, cfg))
    for cfg in ((2, 512, 4), (1, 512, 4), (1, 1024, 4), (1, 1024, 8), (2, 1024, 8), (4, 512, 8), (1, 2048, 8)):
        out.append(("rac_pass4", 0, cfg))
    return out


def _tune_call(kind: str, key, cfg, data: dict):
    """A closure running one config on ``data`` (built by ``_tune_data``) once."""
    from quads.kernels import nvfp4_quant, w4a16
    from quads.prototype.kernels import rac

    if kind == "w4a16":
        bn, bk, sk, nw, ns, sub = (*cfg, None)[:6]  # 5-tuples: rows of sweeps before sub_k
        x = data["x"][key]
        return [lambda q=q: w4a16.gemm(x, q, kernel="tiled", block_n=bn, block_k=bk, split_k=sk, num_warps=nw,
                                       num_stages=ns, sub_k=sub) for q in data["fp4"]]  # fmt: skip
    if kind == "moe":
        bn, bk, nw, ns, sk, bm, reg, sub = cfg
        x, ends = data["moe_x"][key]
        return [lambda q=q: w4a16.grouped_gemm(x, q, ends, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                                               split_k=sk, block_m=bm, max_registers=reg, sub_k=sub)
                for q in data["moe_w"]]  # fmt: skip
    xq = data["xq"]
    if kind == "quant_row":
        if cfg[1] is None:
            return lambda: nvfp4_quant.nvfp4_quantize(xq, per_token=True, block_m=cfg[0], num_warps=cfg[2])
        return lambda: nvfp4_quant.nvfp4_quantize(
            xq, per_token=True, block_m=cfg[0], block_k=cfg[1], num_warps=cfg[2]
        )
    if kind == "quant_amax_tile":
        return lambda: nvfp4_quant.nvfp4_quantize(
            xq, amax=4.0, block_m=cfg[0], block_k=cfg[1], num_warps=cfg[2]
        )
    if kind == "row_amax":
        return lambda: nvfp4_quant.row_amax(xq, block_m=cfg[0], block_k=cfg[1], num_warps=cfg[2])
    n = xq.shape[1] // 2
    if kind == "rac_pass2":
        return lambda: rac.rac_quantize(xq, n, act_scale=key or "token", pass2=cfg)
    if kind == "rac_pass4":
        return lambda: rac.rac_quantize(xq, n, act_scale=key or "token", pass4=cfg)
    raise ValueError(kind)


def _tune_data(n: int, k: int, nsets: int, quant_rows: int, ms=(1, 16, 64), dev: str = "cuda") -> dict:
    from quads.kernels import nvfp4_quant, w4a16

    fp4 = [w4a16.pack(nvfp4_quant.nvfp4_quantize((torch.randn(n, k, device=dev) * 0.02).bfloat16()))
           for _ in range(nsets)]  # fmt: skip
    return {"fp4": fp4, "x": {m: torch.randn(m, k, device=dev).bfloat16() for m in ms},
            "xq": torch.randn(quant_rows, 8192 if dev == "cuda" else 256, device=dev).bfloat16()}  # fmt: skip


def _moe_data(
    nsets: int, dev: str = "cuda", e: int = 128, n: int = 1536, k: int = 2048, topk: int = 8, tokens=(1, 16, 64)
) -> dict:
    from quads.kernels import nvfp4_quant, w4a16

    ws = []
    for _ in range(nsets):
        w = (torch.randn(e, n, k, device=dev) * 0.02).bfloat16()
        ws.append(w4a16.pack(nvfp4_quant.nvfp4_quantize(w, amax=w.float().abs().amax(dim=(-2, -1), keepdim=True))))
    xs = {}
    for t in tokens:
        _, ends = _routed(e, t, topk, dev, seed=t)
        xs[t] = (torch.randn(t * topk, k, device=dev).bfloat16(), ends)
    return {"moe_w": ws, "moe_x": xs, "moe_ends": {t: ends for t, (x, ends) in xs.items()}}


def _tune_warm(items: list, dev: str = "cuda", moe_groups: frozenset = frozenset({"1b", "qwen3"})) -> int:
    """Worker: compile (run once) each config of ``items`` on minimal data (the grouped kernel's at the shapes
    of ``moe_groups``). Returns the failures."""
    torch.manual_seed(0)
    bad = 0
    small = dev != "cuda"
    data = {}
    for kind, key, cfg in items:
        try:
            if kind == "w4a16":
                for n, k in TUNE_SHAPES[:1] if not small else [(64, 256)]:
                    if "fp4" not in data:
                        data.update(_tune_data(n, k, 1, 64 if small else 16, dev=dev))
                    fns = _tune_call(kind, key, cfg, data)
                    fns[0]()
            elif kind == "moe":
                if "moe_w" not in data:
                    data.update(_moe_data(1, dev, *((8, 32, 128, 2) if small else ())))
                    # the 1b shapes (their M tile and split-K differ from the Qwen3 ones: other compiles)
                    data["moe_1b"] = [] if small else [_moe_data(1, dev, e, n, k, topk, tokens)
                                                       for group, (e, n, k, topk), _, tokens, _ in TUNE_MOE_SETS
                                                       if group == "1b"]  # fmt: skip
                for t in (1, 16, 64) if "qwen3" in moe_groups or small else ():
                    _tune_call(kind, t, cfg, data)[0]()
                for d1b in data["moe_1b"] if "1b" in moe_groups else ():
                    _tune_call(kind, 128, cfg, d1b)[0]()
            else:
                if "xq" not in data:
                    data.update(_tune_data(64, 256, 1, 64 if small else 256, dev=dev))
                for key2 in ("tensor", "token") if kind.startswith("rac") else (key,):
                    _tune_call(kind, key2, cfg, data)()
        except Exception as e:
            bad += 1
            print(f"warm {kind} {key} {cfg}: {type(e).__name__}: {e}"[:300], file=sys.stderr, flush=True)
    if dev == "cuda":
        torch.cuda.synchronize()
    return bad


def tuning_from_rows(rows: list) -> dict:
    """The fastest config of each case among the tune rows, as a table in the form of
    ``quads/kernels/tuning.json`` (cases that were not timed keep the current file's entry)."""
    from quads.kernels import tuning

    def best(kind: str, shapes: list[str] | None = None):
        """The config with the least summed time over ``shapes`` (all timed rows of ``kind`` if None)."""
        tot: dict = {}
        for r in rows:
            if r["bench"] == kind and (shapes is None or r["shape"] in shapes):
                tot.setdefault(tuple(r["cfg"]), []).append(r["us"])
        n = max((len(v) for v in tot.values()), default=0)
        full = {c: sum(v) for c, v in tot.items() if len(v) == n}
        return min(full, key=full.get) if full else None

    table = json.loads(json.dumps(tuning.table()))  # a deep copy
    gemm_t = table["w4a16_gemm"]
    for m, buckets in ((1, (1, 4)), (16, (16,)), (64, (32, 64))):
        shapes = [f"M={m} N={n} K={k}" for n, k in TUNE_SHAPES]
        c = best("tune w4a16", shapes)
        if c is not None:
            for b in buckets:
                gemm_t[f"m{b}"] = dict(zip(("block_n", "block_k", "split_k", "num_warps", "num_stages", "sub_k"), c))
        for (n, k), sh in zip(TUNE_SHAPES, shapes):
            cs = best("tune w4a16", [sh])
            for b in buckets:
                key = f"n{n}_k{k}_m{b}"
                if cs is not None and cs != c:
                    gemm_t[key] = dict(zip(("block_n", "block_k", "split_k", "num_warps", "num_stages", "sub_k"), cs))
                elif c is not None:
                    gemm_t.pop(key, None)
    # every timed shape has <= 16 routed rows per expert: the launcher's "decode" case (prefill is not timed). The
    # shared entry only from a sweep of every shape (a sweep of the 1b alone must not move Qwen3's); then each 1b
    # shape's own entry (n{N}_k{K}_decode, the Triton kernel) where its fastest config is not the shared one
    names = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "block_m", "max_registers", "sub_k")
    grouped = table["w4a16_grouped_gemm"]
    moe_timed = {r["shape"] for r in rows if r["bench"] == "tune moe"}
    every = [f"{label}T={t}" for _, _, _, tokens, label in TUNE_MOE_SETS for t in tokens]
    c = best("tune moe", every) if moe_timed >= set(every) else None
    if c is not None:
        grouped["decode"].update(zip(names, c))
    shared = grouped["decode"]
    for group, (_, n, k, _), _, tokens, label in TUNE_MOE_SETS:
        shapes = [f"{label}T={t}" for t in tokens]
        cs = best("tune moe", shapes) if group == "1b" and moe_timed >= set(shapes) else None
        if cs is None:
            continue
        if shared["backend"] == "triton" and cs == tuple(shared[x] for x in names):
            grouped.pop(f"n{n}_k{k}_decode", None)
        else:
            grouped[f"n{n}_k{k}_decode"] = {**shared, **dict(zip(names, cs)), "backend": "triton"}
    for kind, case in (("tune quant_row", "per_token"), ("tune quant_amax_tile", "amax_known"),
                       ("tune row_amax", "row_amax")):  # fmt: skip
        c = best(kind)
        if c is not None:
            table["nvfp4_quantize"][case] = dict(zip(("block_m", "block_k", "num_warps"), c))
    for kind, case, names in (("tune rac_pass2", "pass2", ("block_m", "block_k", "num_warps", "target_programs")),
                              ("tune rac_pass4", "pass4", ("block_m", "block_s", "num_warps"))):  # fmt: skip
        c = best(kind, ["16384x8192 token", "16384x8192 tensor"])
        if c is not None:
            table["rac_quantize"][case] = dict(zip(names, c))
    return table


def bench_tune(rows: list, workers: int = 12, tuning_out: str | None = None, kinds: str = "",
               moe_shapes: str = "") -> None:
    """Time every config of ``tune_space`` (only those of ``kinds``, a comma list such as "moe", when
    given; the grouped kernel's only at the shapes named in ``moe_shapes``, "qwen3" and/or "1b", when
    given) and print the fastest per case as a table of tuning.json's form (also to ``tuning_out``)."""
    import concurrent.futures as cf
    import functools
    import multiprocessing as mp
    import os
    import time

    def add(row: dict) -> None:
        rows.append(row)
        print("tune", json.dumps(row), flush=True)

    moe_only = {v for v in moe_shapes.split(",") if v}
    if moe_only - {group for group, *_ in TUNE_MOE_SETS}:
        raise ValueError(f"moe shapes {sorted(moe_only)}: the grouped kernel's shape groups are 1b and qwen3")
    want = {k for k in kinds.split(",") if k}
    space = [c for c in tune_space() if not want or c[0] in want]
    if not space:
        raise ValueError(f"--tune-kinds {kinds!r} selects no config; kinds: {sorted({c[0] for c in tune_space()})}")
    timed = {c[0] for c in space}
    t0 = time.time()
    if __name__ != "__main__":  # loaded by `quads bench kernels`: spawned workers could not import us
        workers = 0
    if workers > 0:
        chunks = [space[i::workers] for i in range(workers)]
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            groups = frozenset(moe_only or {group for group, *_ in TUNE_MOE_SETS})
            bad = sum(ex.map(functools.partial(_tune_warm, moe_groups=groups), chunks))
        print(f"tune: compiled {len(space)} configs in {time.time() - t0:.0f} s ({bad} failed)", flush=True)
    wait = os.environ.get("TUNE_WAIT")  # a file that appears when the tests running beside us are done
    while wait and not os.path.exists(wait) and time.time() - t0 < 150:
        time.sleep(1)
    for n, k in TUNE_SHAPES if "w4a16" in timed else ():
        nsets = max(4, int(3 * GB // (n * k * 2)))
        data = _tune_data(n, k, nsets, 16)
        for m in (1, 16, 64):
            w16 = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(nsets)]
            x = data["x"][m]
            t_bf = time_graph([lambda w=w: torch.mm(x, w.T) for w in w16])
            del w16
            add({"bench": "tune base bf16", "shape": f"M={m} N={n} K={k}", "us": t_bf * 1e6})
            for kind, key, cfg in space:
                if kind != "w4a16" or key != m:
                    continue
                try:
                    t = time_graph(_tune_call(kind, key, cfg, data))
                except Exception as e:
                    print(f"tune {kind} {m} {cfg}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
                    continue
                add({"bench": "tune w4a16", "shape": f"M={m} N={n} K={k}", "cfg": list(cfg), "us": t * 1e6,
                             "x_vs_bf16": t_bf / t})  # fmt: skip
        del data
        torch.cuda.empty_cache()
    # the 1b preset's expert GEMMs at its decode step, then Qwen3-30B-A3B's gate_up at T = 1, 16, 64
    for (e, n, k, topk), nsets, tokens, label in [(shape, nsets, tokens, label)
                                                  for group, shape, nsets, tokens, label in TUNE_MOE_SETS
                                                  if "moe" in timed and (not moe_only or group in moe_only)]:
        moe = _moe_data(nsets, "cuda", e, n, k, topk, tokens)
        for t_rows in tokens:
            x, ends = moe["moe_x"][t_rows]
            wb = [(torch.randn(e, n, k, device="cuda") * 0.02).bfloat16() for _ in range(nsets)]
            t_bf = time_graph([lambda w=w: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends) for w in wb])
            del wb
            add({"bench": "tune base grouped_mm", "shape": f"{label}T={t_rows}", "us": t_bf * 1e6})
            for kind, _key, cfg in space:
                if kind != "moe":
                    continue
                try:
                    t = time_graph(_tune_call(kind, t_rows, cfg, moe))
                except Exception as ex:
                    print(f"tune moe {label}{t_rows} {cfg}: {type(ex).__name__}: {ex}"[:300], file=sys.stderr)
                    continue
                add({"bench": "tune moe", "shape": f"{label}T={t_rows}", "cfg": list(cfg), "us": t * 1e6,
                     "x_vs_bf16": t_bf / t})  # fmt: skip
        del moe
        torch.cuda.empty_cache()
    data = {"xq": torch.randn(16384, 8192, device="cuda").bfloat16()}
    out_b = 16384 * 8192 // 2 + 16384 * 8192 // 16
    min_bytes = data["xq"].numel() * 2 + out_b
    for kind, key, cfg in space:
        if not kind.startswith(("quant", "row_amax", "rac")):
            continue
        for key2 in ("token", "tensor") if kind.startswith("rac") else (key,):
            try:
                fn = _tune_call(kind, key2, cfg, data)
                t = time_plain(fn, reps=10)
            except Exception as e:
                print(f"tune {kind} {cfg}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
                continue
            moved = data["xq"].numel() * 2 if kind == "row_amax" else min_bytes
            row = {"bench": f"tune {kind}", "shape": f"16384x8192 {key2 or ''}".strip(), "cfg": list(cfg), "us": t * 1e6,
                   "TBps": moved / t / 1e12}  # fmt: skip
            if kind.startswith("rac"):
                ev: dict = {}
                from quads.prototype.kernels import rac

                n = 4096
                rac.rac_quantize(data["xq"], n, act_scale=key2, timings=ev, **{kind[4:]: cfg})
                torch.cuda.synchronize()
                names = list(ev)
                row["stages_us"] = {a: ev[a].elapsed_time(ev[b]) * 1e3 for a, b in zip(names, names[1:])}
            add(row)
    print(f"tune: done in {time.time() - t0:.0f} s", flush=True)
    table = tuning_from_rows(rows)
    print("tuning " + json.dumps(table), flush=True)
    if tuning_out:
        with open(tuning_out, "w") as f:
            json.dump(table, f, indent=2)
            f.write("\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--only", default="quantize,w4a16,moe,w4a4,rac,attention,prologue", help="comma list of suites (and: rac_select, routes, moe_prefill, tune)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--ms", default="", help="comma list of W4A16 token counts (default: all)")
    ap.add_argument(
        "--workers", type=int, default=12, help="tune suite: parallel compile processes (0: none)"
    )
    ap.add_argument("--tuning-out", default=None,
                    help="tune suite: write the fastest configs here, in the form of quads/kernels/tuning.json")
    ap.add_argument("--tune-moe-shapes", default="",
                    help="tune suite: the grouped kernel's shapes, a comma list of 1b (the 1b decode GEMMs) and "
                         "qwen3 (Qwen3-30B-A3B gate_up at T = 1, 16, 64); default: both")
    ap.add_argument("--tune-kinds", default="",
                    help="tune suite: only these config kinds, a comma list (w4a16, moe, quant_row, quant_amax_tile, "
                         "row_amax, rac_pass2, rac_pass4; default: all)")
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
               "w4a16": lambda: bench_w4a16(rows, copy_bw, args.quick),
               "moe": lambda: bench_moe(rows, args.quick, copy_bw),
               "moe_prefill": lambda: bench_moe_prefill(rows, copy_bw), "w4a4": lambda: bench_w4a4(rows),
               "rac": lambda: bench_rac(rows), "rac_select": lambda: bench_rac_select(rows), "attention": lambda: bench_attention(rows, copy_bw),
               "prologue": lambda: bench_prologue(rows), "routes": lambda: bench_routes(rows),
               "tune": lambda: bench_tune(rows, args.workers, args.tuning_out, args.tune_kinds,
                                          args.tune_moe_shapes)}  # fmt: skip
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
        "unfused_us",
        "x_vs_unfused",
        "sort_us",
        "count_us",
        "w4a4_us",
        "w4a4_steps_us",
        "static_us",
        "group_units_us",
        "group_units_best_us",
        "fused_us",
        "gemv_us",
        "gemv_x_vs_bf16",
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
