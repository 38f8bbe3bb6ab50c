"""End-to-end benchmarks: rollout tokens/s per recipe, and the cost of a W4A16-QAT trainer step.

    python benchmarks/bench_e2e.py [--suites rollout,trainer] [--preset 100m] [--device cuda] [--json F]
    quads bench e2e ...                                   (the same)

rollout: the rollout engine (``quads.rollout.RolloutEngine``) on MoE presets (``--preset 100m,1b``;
  random weights: the speed does not depend on them, and ``ignore_eos`` fixes every response at
  ``--new-tokens``), one model per rollout precision: BF16, FP8 W8A8, NVFP4 W4A16 (weights only), NVFP4
  W4A4, NVFP4 W4A4 + RAC 50%. ``--prompts`` x ``--n`` samples of ``--prompt-len`` tokens each; the
  median of ``--reps`` generations after one warm-up generation of the same shape (which captures the
  decode step's CUDA graph; with graphs a second one, which captures the prefill's); tokens/s counts response
  tokens over prefill + decode. Each row: the decode path
  (``--decodes``: auto = static on CUDA, eager = the reference), CUDA graphs on/off (``--graphs``), ms
  per decode step, and its floor: bytes of weights (in the recipe's storage format) + KV cache (the
  cache length the step attends over) read per step, over the copy bandwidth measured in the same
  run; ``x_floor`` = step time / floor. ``--long-tokens`` adds a longer-response row for
  ``--long-recipes`` (the KV-cache side). ``--experts grouped,loop`` times both host-dispatched expert
  paths of the eager decode (``quads.quant.grouped`` vs the loop). On Hopper every NVFP4 GEMM is
  emulated (dequantized operands, fp32 GEMM: no FP4 tensor cores), so these are the costs of this
  implementation, not the speed of FP4 hardware.
profile (``--suites profile``): torch.profiler per preset and ``--profile-recipes`` recipe, graphs on
  and off: GPU kernels, launches and host syncs per decode step (difference of a 48- and a 16-token
  generation over the 32 extra steps, so prefill and read-back cancel); the same difference per kernel (per
  ATen op on the CPU) says where a step's time goes, and the 16-token trace less its decode steps where the
  prefill's goes (``top_per_step_us``, ``top_outside_decode_ms``); on CUDA the same split of the host's
  CPU events (``host_top_*``, and ``host_outside_decode_ms`` to set against ``prefill_ms``).
vllm (``--suites vllm``, run with the vLLM environment's python, e.g. ``.venv-vllm/bin/python``): the
  quads engine and vLLM's own engine (native BF16 layers, ``enforce_eager`` as quads' vLLM backend
  starts it) on the same ``--preset`` model (random weights, saved once as a Hugging Face folder),
  the same prompts, greedy decoding, ``ignore_eos``, generations interleaved, ``--reps`` each after a
  warm-up; tokens/s of each, their ratio, and the share of samples whose greedy tokens agree. A peer
  number for the CPU (``--device cpu --preset tiny``), not a target.
trainer: one GRPO-shaped trainer step on a fixed batch (``--batch`` sequences of ``--seq-len``
  tokens) per preset: full-sequence forward of the response log-probs and entropy under BF16 autocast
  over fp32 master weights, a policy-gradient loss, backward, grad clip, AdamW step; one model per
  ``--trainer-recipes`` recipe (BF16, and W4A16-QAT: ``QDQ(W)`` in the forward, straight-through
  backward, the QDQ cached per step), all in one process, ``--warmup`` untimed steps each, then
  ``--steps`` timed steps of the recipes interleaved (``--interleave step|block``). Each step is timed
  with CUDA events (perf_counter on the CPU) from an idle device to the step's end. Per recipe: the
  median, the spread (IQR and MAD in % of the median), model TFLOP/s and MFU against the H200's BF16
  dense peak (``trainer_flops``); the ratio of medians to the first recipe with a paired bootstrap 95%
  confidence interval (``ratio_ci``); the raw step times in the JSON. ``--trainer-experts`` picks the
  expert path (``Recipe.expert_path``); ``--trainer-profile`` adds a torch.profiler summary of one more
  step per recipe (kernels, launches, host syncs, top ops). ``--trainer-compile off,on`` times every
  recipe plain and with its policy forward + backward compiled (``quads.rl.compiled``, Inductor, as
  ``quads train``'s ``trainer_compile``): rows ``<recipe>+compile`` with their ratio to the plain recipe
  too; every configuration's first step (the compile, for compiled ones) runs before the warm-up and
  is reported as ``first_step_s``. ``--trainer-phases N`` then times N more steps of every configuration,
  interleaved, phase by phase (``PHASES``: the QAT weight refresh ``refresh_stale``, BF16 has none to do;
  forward + loss; zero_grad + backward; grad clip + AdamW step), with CUDA events between the phases
  (perf_counter on the CPU; on CUDA also the host time of each phase): per phase the median and IQR, the
  step as their sum, and each phase's median paired difference to the first recipe (``delta_ms``), which
  says where a recipe's extra time goes. With ``--trainer-profile`` the profiled step is annotated per
  phase too (kernel launches, host syncs and ATen calls of each phase).
Prints a table and one JSON line at the end (hardware and versions included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quads.bench import cpu_name  # noqa: E402
from quads.bench import timer as timer_of  # noqa: E402
from quads.model import ModelConfig, MoEForCausalLM  # noqa: E402
from quads.model.tokenizer import CharTokenizer  # noqa: E402
from quads.quant import calibrate_static_channels, quantize_model  # noqa: E402
from quads.quant.layers import refresh_stale  # noqa: E402
from quads.quant.recipe import LinearSpec, Recipe  # noqa: E402
from quads.rl.compiled import CompiledForward  # noqa: E402
from quads.rl.logprobs import SequenceBatch, forward_logprobs  # noqa: E402
from quads.rollout import RolloutEngine, SamplingParams  # noqa: E402

ROLLOUT_RECIPES = {
    "bf16": LinearSpec(),
    "fp8": LinearSpec.of(weight="fp8", act="fp8"),
    "w4a16": LinearSpec.of(weight="nvfp4"),
    "w4a4": LinearSpec.of(weight="nvfp4", act="nvfp4"),
    "w4a4+rac50": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5),
    # RAC with the calibrated channel order (no per-step selection): calibrated once on the prompts, as a weight
    # sync does with the rollouts' statistics
    "w4a4+rac50-static": LinearSpec.of(weight="nvfp4", act="nvfp4", rac_ratio=0.5, rac_selection="static"),
}


def _names(recipes: str) -> list[str]:
    """The rollout recipes of a comma list, in its order."""
    return [r.strip() for r in recipes.split(",") if r.strip()]


def _quantized(model, name: str, spec: LinearSpec, prompts: list[list[int]], device: str) -> None:
    """``model`` quantized for the rollout recipe ``name``; a static-RAC recipe's orders calibrated on ``prompts``."""
    quantize_model(model, Recipe(f"bench-{name}", rollout=spec), side="rollout", verbose=False)
    if spec.static_rac:
        ids = torch.tensor(prompts, device=device)
        with torch.no_grad():
            calibrate_static_channels(model, lambda m: m(ids))


def env_info(device: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    else:
        info.update(cpu=cpu_name(), cores=os.cpu_count(), threads=torch.get_num_threads())
    info["command"] = " ".join(["python", *sys.argv])
    return info


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _model(preset: str, device: str, dtype: str, seed: int = 0) -> MoEForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset(preset, vocab_size=CharTokenizer().vocab_size, dtype=dtype)
    with torch.device(device):  # initialised where it runs (a 1b model's CPU init takes longer than its run)
        return MoEForCausalLM(cfg)


def _set_experts_path(model: torch.nn.Module, path: str) -> None:
    """Rollout expert path of the host-dispatched (eager) decode: "grouped" (batched) or "loop"."""
    from quads.quant.layers import QuantizedExperts

    for m in model.modules():
        if isinstance(m, QuantizedExperts):
            m.grouped = path == "grouped"


_FORMAT_BYTES = {"nvfp4": 0.5 + 1 / 16, "fp8": 1.0}  # bytes per weight element: codes + block scales


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step must read, in the recipe's storage format: every quantized
    weight at its format's size (NVFP4: 4-bit codes + one E4M3 scale per 16; FP8: 1 byte), every other
    parameter at its dtype's size; the embedding table counts only when tied to the lm_head (a
    step reads B of its rows). The floor of the format; ``operand_bytes`` is what the layers hold."""
    from quads.quant.layers import _QuantizedBase

    counted: set[int] = set()
    total = 0.0
    for m in model.modules():
        if isinstance(m, _QuantizedBase):
            for name in m.weight_names:
                p = getattr(m, name)
                counted.add(id(p))
                per = _FORMAT_BYTES.get(m.spec.weight, float(p.element_size()))
                total += p.numel() * per
    emb = model.model.embed_tokens.weight
    for p in model.parameters():
        if id(p) in counted or (p is emb and model.lm_head.weight is not emb):
            continue
        counted.add(id(p))
        total += p.numel() * p.element_size()
    return int(total)


def operand_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weight operands the quantized layers hold for their GEMMs (what the step reads of
    them): the packed NVFP4 layout on the kernel path (W4A16, W4A4(+RAC) on a Triton device: codes,
    scales, global scales, K padded to 64), FP8 on FP8 tensor cores its E4M3 codes and row scales, else the
    dequantized ``QDQ(W)`` and its fp32 copy when made."""
    from quads.quant.layers import _QuantizedBase

    total = 0
    for m in model.modules():
        if isinstance(m, _QuantizedBase):
            for st in m.stores.values():
                if st.kernel is not None:
                    held = st.kernel.tensors()
                elif st.fp8 is not None:
                    held = (st.fp8.data, st.fp8.scale)
                else:
                    held = (st.w_q, st.w_q32)
                total += sum(t.numel() * t.element_size() for t in held if t is not None)
    return total


def kv_bytes(cfg, batch: int, cache_len: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one decode step reads over ``cache_len`` columns of ``batch`` rows."""
    return 2 * cfg.n_layers * batch * cfg.n_kv_heads * cache_len * cfg.head_dim * torch.finfo(dtype).bits // 8


def copy_bandwidth(device: str, mib: int = 1024) -> float:
    """Device copy bandwidth (bytes read + written per second), median of 5 copies of ``mib`` MiB."""
    n = (mib if device.startswith("cuda") else min(mib, 128)) * 2**20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    ts = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(ts)


def _configs(args) -> list[tuple[str, bool, bool]]:
    """(decode path, cuda graphs, compiled step) triples to time."""
    out = []
    compiles = [c.strip() == "on" for c in args.compile.split(",") if c.strip()]
    for decode in [d.strip() for d in args.decodes.split(",") if d.strip()]:
        graphs = [g.strip() == "on" for g in args.graphs.split(",") if g.strip()]
        if decode == "eager" or not args.device.startswith("cuda"):
            graphs = [False]
        comp = [False] if decode == "eager" else compiles
        out += [(decode, g, c) for g in dict.fromkeys(graphs) for c in dict.fromkeys(comp)]
    return out


def bench_rollout(args, rows: list) -> None:
    tok = CharTokenizer()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, tok.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    bw = copy_bandwidth(args.device)
    paths = [p.strip() for p in args.experts.split(",") if p.strip()]
    long_recipes = set(_names(args.long_recipes))
    for preset in [p.strip() for p in args.preset.split(",") if p.strip()]:
        for path in paths:
            for name in _names(args.recipes) or ROLLOUT_RECIPES:  # the order given (rows are written as they end)
                spec = ROLLOUT_RECIPES[name]
                model = _model(preset, args.device, "bfloat16").requires_grad_(False)
                _quantized(model, name, spec, prompts, args.device)
                _set_experts_path(model, path)
                wb = weight_bytes(model)
                long = min(args.long_tokens, model.config.max_seq_len - args.prompt_len)  # tiny: 496
                lengths = [args.new_tokens] + ([long] if args.long_tokens and name in long_recipes else [])
                configs = _configs(args)
                attentions = [a.strip() for a in args.decode_attention.split(",") if a.strip()]
                for decode, graphs, comp in configs:
                    for new_tokens in lengths:
                        if new_tokens != args.new_tokens and not graphs and any(g for _, g, _ in configs):
                            continue  # the longer row runs with graphs only (the engine's default)
                        for attn in attentions if decode != "eager" else ["sdpa"]:  # eager: SDPA only
                            rows.append(_time_rollout(args, model, tok, prompts, name, spec, path, decode, graphs,
                                                      new_tokens, preset, wb, bw, comp, attn))
                            print(_rollout_line(rows[-1]), flush=True)
                            _ratios(rows, paths)
                            _write_json(args, rows)  # partial results survive a time limit
                del model
    _ratios(rows, paths)


def _time_rollout(args, model, tok, prompts, name, spec, path, decode, graphs, new_tokens, preset, wb, bw,
                  comp=False, attention="sdpa") -> dict:
    row = {"suite": "rollout", "preset": preset, "recipe": name, "experts": path, "decode": decode,
           "graphs": graphs, "compile": comp, "decode_attention": attention, "spec": spec.describe(),
           "samples": len(prompts) * args.n, "new_tokens": new_tokens}  # fmt: skip
    sp = SamplingParams(n=args.n, max_new_tokens=new_tokens, ignore_eos=True, seed=0, record_routing=True,
                        stop_token_ids=stop_ids(args.stop_fraction, tok.vocab_size))
    row["stop_fraction"] = args.stop_fraction
    try:
        eng = RolloutEngine(model, tok, device=args.device, decode=decode, cuda_graphs=graphs, compile=comp,
                            compile_prefill=args.compile_prefill == "on", share_prefill=args.share_prefill == "on",
                            fuse_qkv=args.fuse_qkv == "on", decode_attention=attention)  # fmt: skip
        t0 = time.perf_counter()
        first = eng.generate(prompts, sp)  # warm-up on the timed batch shape: kernels, allocator, graph capture
        row["first_generate_s"] = time.perf_counter() - t0  # compiles included (cold or cached)
        if graphs:
            eng.generate(prompts, sp)  # the prompt block's second sight captures its prefill graph
        row["decode_attention"] = first.decode_attention  # what "auto" resolved to on this device and path
        tps, dec, pre, resp = [], [], [], []
        for _ in range(args.reps):
            b = eng.generate(prompts, sp)
            tps.append(b.stats.tokens_per_s)
            dec.append(b.stats.decode_s / max(b.stats.decode_steps, 1) * 1e3)
            pre.append(b.stats.prefill_s * 1e3)
            resp.append(b.stats.n_response_tokens / (len(prompts) * args.n))
    except Exception as e:  # a failing configuration is a result too: record it, time the others
        row["error"] = f"{type(e).__name__}: {e}"[:800]
        return row
    B = len(prompts) * args.n
    cache_len = b.cache_len or (args.prompt_len + new_tokens)
    kvb = kv_bytes(model.config, B, cache_len, model.dtype)
    floor_ms = (wb + kvb) / bw * 1e3
    ms = statistics.median(dec)
    row.update(tokens_per_s=statistics.median(tps), decode_ms_per_step=ms, prefill_ms=statistics.median(pre),
               response_tokens_mean=statistics.median(resp), decode_steps=b.stats.decode_steps,
               decode_path=b.stats.decode_path, prefill_rows=b.stats.prefill_rows,
               graph_captures_warm=b.stats.graph_captures,
               graph_captures_first=first.stats.graph_captures, weight_bytes=wb, operand_bytes=operand_bytes(model),
               kv_bytes=kvb,
               cache_len=cache_len, copy_gbps=bw / 1e9, floor_ms=floor_ms, x_floor=ms / floor_ms)
    return row


def _ratios(rows: list, paths: list[str]) -> None:
    """vs_bf16: tokens/s over the bf16 row of the same preset, path, decode, graphs, decode attention and
    length; vs_<first path>: over the same recipe on the first expert path."""
    roll = [r for r in rows if r["suite"] == "rollout" and "tokens_per_s" in r]

    def same(r, q, *keys):
        return all(r[k] == q[k] for k in keys)

    for r in roll:
        cfg = ("preset", "experts", "decode", "graphs", "compile", "decode_attention", "new_tokens")
        base = next((q for q in roll if q["recipe"] == "bf16" and same(r, q, *cfg)), None)
        if base is not None:
            r["vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r["experts"] != paths[0]:
            first = next((q for q in roll if q["experts"] == paths[0]
                          and same(r, q, "preset", "recipe", "decode", "graphs", "compile", "decode_attention",
                                   "new_tokens")), None)
            if first is not None:
                r[f"vs_{paths[0]}"] = r["tokens_per_s"] / first["tokens_per_s"]


def stop_ids(fraction: float, vocab_size: int) -> tuple[int, ...]:
    """``round(fraction * V)`` ids of the vocabulary past its 4 special ones, a fixed seeded subset: as stop ids,
    each sampled token ends its row with a probability near ``fraction`` under a flat distribution, so rows finish
    at different steps as in a real rollout (the random-weight models here rarely sample eos)."""
    count = round(fraction * vocab_size)
    if not count:
        return ()
    ids = torch.randperm(vocab_size - 4, generator=torch.Generator().manual_seed(0))[:count] + 4
    return tuple(sorted(ids.tolist()))


def _rollout_line(r: dict) -> str:
    head = (f"rollout {r['preset']:>5} {r['recipe']:>11} ({r['experts']}, {r['decode']}, "
            f"graphs {'on' if r['graphs'] else 'off'}{', compiled' if r.get('compile') else ''}"
            f"{', triton attention' if r.get('decode_attention') == 'triton' else ''}, {r['new_tokens']} tok"
            f"{', stop ' + format(r['stop_fraction'], 'g') if r.get('stop_fraction') else ''})")
    if "error" in r:
        return f"{head}: ERROR {r['error']}"
    finishing = (f"mean response {r['response_tokens_mean']:.1f} tok over {r['decode_steps']} steps  "
                 if r.get("stop_fraction") else "")
    return (f"{head}: {r['tokens_per_s']:9.0f} tok/s  {r['decode_ms_per_step']:7.2f} ms/step  {finishing}"
            f"floor {r['floor_ms']:.3f} ms ({r['x_floor']:.1f}x)  prefill {r['prefill_ms']:.1f} ms "
            f"({r['prefill_rows']} rows)  operands {r['operand_bytes'] / 2**20:.1f} MiB  "
            f"[{r['decode_path']}]")


def _trace_counts(eng, prompts, sp, device: str) -> tuple[dict, object, dict, dict]:
    """Event counts of one profiled ``generate`` (after the caller's warm-up), the time per op
    ``{name: (calls, ms)}`` of the GPU kernels on CUDA (self device time), of the ATen ops elsewhere (self
    CPU time), and the host's: every CPU event (ATen ops and CUDA runtime calls, a sync's wait included)
    by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        b = eng.generate(prompts, sp)
        _sync(device)
    ev = prof.key_averages()
    names = {
        "gpu_kernels": lambda e: e.device_type == torch.autograd.DeviceType.CUDA,
        "kernel_launches": lambda e: e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                               "cuLaunchKernelEx"),
        "graph_launches": lambda e: e.key == "cudaGraphLaunch",
        "syncs": lambda e: e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
        "memcpy": lambda e: e.key in ("cudaMemcpyAsync", "cudaMemcpy"),
    }
    counts = {k: sum(e.count for e in ev if f(e)) for k, f in names.items()}
    if cuda:
        ops = {e.key: (e.count, e.self_device_time_total / 1e3) for e in ev
               if e.device_type == torch.autograd.DeviceType.CUDA}
    else:
        ops = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in ev if e.key.startswith("aten::")}
    host = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in ev
            if e.device_type == torch.autograd.DeviceType.CPU}
    return counts, b, ops, host


def _op_split(o16: dict, o48: dict, steps: int, steps16: int, top: int | None = 15) -> tuple[list, list]:
    """Per op: its time per decode step (the two traces' difference / ``steps``, in us) and what the
    16-token trace spends outside its ``steps16`` decode steps (prefill, set-up, read-back; in ms), the
    ``top`` largest of each (all with None) as (name, calls, time)."""
    per_step, outside = [], []
    for k in set(o16) | set(o48):
        c16, t16 = o16.get(k, (0, 0.0))
        c48, t48 = o48.get(k, (0, 0.0))
        us = (t48 - t16) / steps * 1e3
        per_step.append((k[:80], round((c48 - c16) / steps, 2), round(us, 2)))
        outside.append((k[:80], round(c16 - steps16 * (c48 - c16) / steps, 1), round(t16 - steps16 * us / 1e3, 3)))
    largest = lambda rows: sorted(rows, key=lambda r: (-r[2], r[0]))[:top]  # noqa: E731 (ties by name)
    return largest(per_step), largest(outside)


def _profile_modes(graphs: str, compiles: str, cuda: bool) -> list[tuple[bool, bool]]:
    """The (graphs, compile) modes the profile suite traces: with ``on`` in ``graphs`` (CUDA only) the step
    in graphs for each ``compiles`` value, with ``off`` (or on the CPU) the eager step: no graph, no compile."""
    want = _on_off(graphs, "--graphs")
    modes = [(True, c) for c in _on_off(compiles, "--compile")] if cuda and True in want else []
    return modes + ([(False, False)] if False in want or not modes else [])


def profile_decode(args, rows: list) -> None:
    """torch.profiler over generations of 16 and 48 new tokens per (preset, recipe, graphs): kernels,
    launches and host syncs per decode step = the difference of the two traces / 32 steps (prefill,
    set-up and read-back cancel out); the same difference per GPU kernel (per ATen op on the CPU) gives
    where a step's time goes (``top_per_step_us``), and the 16-token trace less its decode steps where
    the prefill's goes (``top_outside_decode_ms``). On CUDA the same split of the host's CPU events
    (``host_top_per_step_us``, ``host_top_outside_decode_ms``, and ``host_outside_decode_ms``: all of
    them outside decode, to set against ``prefill_ms``: what is left is Python between the ops)."""
    tok = CharTokenizer()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, tok.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    short, long = (SamplingParams(n=args.n, max_new_tokens=m, ignore_eos=True, seed=0) for m in (16, 48))
    cuda = args.device.startswith("cuda")
    for preset in [p.strip() for p in args.preset.split(",") if p.strip()]:
        for name in _names(args.profile_recipes):
            spec = ROLLOUT_RECIPES[name]
            model = _model(preset, args.device, "bfloat16").requires_grad_(False)
            _quantized(model, name, spec, prompts, args.device)
            for graphs, comp in _profile_modes(args.graphs, args.compile, cuda):
                row = {"suite": "profile", "preset": preset, "recipe": name, "graphs": graphs, "compile": comp}
                try:
                    eng = RolloutEngine(model, tok, device=args.device, cuda_graphs=graphs, compile=comp,
                                        compile_prefill=args.compile_prefill == "on",
                                        share_prefill=args.share_prefill == "on", fuse_qkv=args.fuse_qkv == "on")
                    for _ in range(2 if graphs else 1):  # warm-up (the cache bucket serves both lengths;
                        eng.generate(prompts, long)  # the second captures the prefill graph)
                    c16, b16, o16, h16 = _trace_counts(eng, prompts, short, args.device)
                    c48, b48, o48, h48 = _trace_counts(eng, prompts, long, args.device)
                    steps = b48.stats.decode_steps - b16.stats.decode_steps
                    row.update({f"{k}_per_step": (c48[k] - c16[k]) / steps for k in c48})
                    per_step, outside = _op_split(o16, o48, steps, b16.stats.decode_steps, top=args.profile_top or None)
                    row.update(decode_path=b48.stats.decode_path, steps_diff=steps,
                               decode_ms_per_step=b48.stats.decode_s / b48.stats.decode_steps * 1e3,
                               prefill_ms=b48.stats.prefill_s * 1e3,
                               top_per_step_us=per_step, top_outside_decode_ms=outside)
                    if cuda:  # on the CPU the ops above are the host's
                        h_step, h_out = _op_split(h16, h48, steps, b16.stats.decode_steps, top=None)
                        row.update(host_top_per_step_us=h_step[:15], host_top_outside_decode_ms=h_out[:15],
                                   host_outside_decode_ms=round(sum(r[2] for r in h_out), 3))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:800]
                rows.append(row)
                print("profile " + json.dumps(row), flush=True)
                _write_json(args, rows)
            del model


H200_BF16_DENSE_FLOPS = 989e12  # H200 SXM BF16 dense tensor-core peak (the MFU denominator)


def timing_stats(samples: list[float]) -> dict:
    """Median and spread of step times (any unit): ``iqr_pct`` = (q75 - q25) / median and ``mad_pct`` =
    median |t - median| / median, both in % of the median (quartiles by linear interpolation)."""
    if not samples:
        raise ValueError("timing_stats: expected at least one sample, got none")
    xs = sorted(samples)
    med = statistics.median(xs)
    q25, q75 = (statistics.quantiles(xs, n=4, method="inclusive")[i] for i in (0, 2)) if len(xs) > 1 else (med, med)
    mad = statistics.median(abs(x - med) for x in xs)
    return {"n": len(xs), "median": med, "mean": statistics.fmean(xs), "min": xs[0], "max": xs[-1],
            "q25": q25, "q75": q75, "iqr_pct": 100 * (q75 - q25) / med, "mad_pct": 100 * mad / med}


def ratio_ci(num: list[float], den: list[float], n_boot: int = 2000, level: float = 0.95,
             seed: int = 0) -> dict:
    """Ratio of medians ``median(num) / median(den)`` with a paired bootstrap confidence interval: the
    pairs (num[i], den[i]) (step i of each recipe, timed next to each other) are resampled with
    replacement ``n_boot`` times; the interval is the ``level`` percentile range of the resampled
    ratios. Also the median of the per-pair ratios."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio_ci: expected two equally long non-empty lists, got {len(num)} and {len(den)}")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(num), (n_boot, len(num)), generator=g)
    a, b = torch.tensor(num, dtype=torch.float64)[idx], torch.tensor(den, dtype=torch.float64)[idx]
    boots = (a.median(dim=1).values / b.median(dim=1).values).sort().values
    lo = boots[int((1 - level) / 2 * (n_boot - 1))].item()
    hi = boots[int((1 + level) / 2 * (n_boot - 1) + 0.5)].item()
    return {"ratio": statistics.median(num) / statistics.median(den), "ci_lo": lo, "ci_hi": hi, "level": level,
            "pair_median": statistics.median(x / y for x, y in zip(num, den))}


def trainer_flops(cfg, batch: int, seq_len: int, response_len: int) -> float:
    """Model FLOPs of one trainer step (forward + backward = 3x the forward's 2 FLOPs per MAC): every
    matmul weight a token touches (attention projections, router, its k experts, the shared expert) for
    all ``batch * seq_len`` tokens, the lm_head for the ``response_len`` columns it computes, and causal
    attention (QK^T and PV over the ``seq_len``-token prefix: 6 * layers * heads * head_dim * seq_len^2
    per sequence). Embedding lookups, norms and the optimizer are not counted."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.n_heads * D, cfg.n_kv_heads * D
    per_layer = (2 * H * q + 2 * H * kv + H * cfg.n_experts + 3 * H * cfg.moe_intermediate_size * cfg.top_k
                 + 3 * H * cfg.shared_expert_intermediate_size + (H if cfg.shared_expert_gate else 0))
    body = 6 * cfg.n_layers * per_layer * batch * seq_len
    head = 6 * cfg.vocab_size * H * batch * response_len
    attn = 6 * cfg.n_layers * cfg.n_heads * D * seq_len**2 * batch
    return float(body + head + attn)


TRAINER_RECIPES = {"bf16": LinearSpec(), "w4a16-qat": LinearSpec.of(weight="nvfp4")}


class _PhaseTimer:
    """One step phase by phase: CUDA events between the phases (one synchronize at the end; the device
    time from the end of the previous phase's work to the end of this one's), perf_counter on the CPU;
    on CUDA also the host time of each phase (what issuing it costs the CPU)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, phases: dict) -> tuple[dict[str, float], dict[str, float]]:
        """``({phase: ms}, {phase: host ms})`` of one run of ``phases`` (the device idle before it)."""
        if self.cuda:
            torch.cuda.synchronize()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(phases) + 1)]
            events[0].record()
        host = [time.perf_counter()]
        for i, fn in enumerate(phases.values()):
            fn()
            if self.cuda:
                events[i + 1].record()
            host.append(time.perf_counter())
        host_ms = {n: (host[i + 1] - host[i]) * 1e3 for i, n in enumerate(phases)}
        if not self.cuda:
            return host_ms, host_ms
        events[-1].synchronize()
        return {n: events[i].elapsed_time(events[i + 1]) for i, n in enumerate(phases)}, host_ms


def phase_stats(runs: list[tuple[dict[str, float], dict[str, float]]], cuda: bool) -> dict:
    """Per phase the statistics of ``runs`` (``_PhaseTimer`` results, one per step), the step as the sum
    of its phases, and the sum of the phase medians (the step's median need not equal it)."""
    names = list(runs[0][0])
    raw = {n: [r[0][n] for r in runs] for n in names}
    totals = [sum(r[0].values()) for r in runs]
    out = {"steps": len(runs), "timer": "cuda_events" if cuda else "perf_counter", "ms": {n: timing_stats(raw[n]) for n in names},
           "step": timing_stats(totals), "sum_of_medians_ms": sum(statistics.median(raw[n]) for n in names),
           "raw_ms": raw, "step_raw_ms": totals}
    if cuda:
        out["host_ms"] = {n: timing_stats([r[1][n] for r in runs]) for n in names}
    return out


def phase_deltas(runs: dict, base: dict) -> dict[str, float]:
    """Median paired difference per phase and of the step, ``runs`` minus ``base`` (``phase_stats`` of two
    configurations whose steps were timed next to each other), in ms."""
    d = {n: statistics.median(a - b for a, b in zip(runs["raw_ms"][n], base["raw_ms"][n], strict=True))
         for n in runs["raw_ms"]}
    d["step"] = statistics.median(a - b for a, b in zip(runs["step_raw_ms"], base["step_raw_ms"], strict=True))
    return d


PHASES = ("refresh", "forward", "backward", "optimizer")  # one trainer step, in order (module docstring)


def _trainer_step(args, preset: str, spec: LinearSpec, batch: SequenceBatch, adv: torch.Tensor, compile: bool):
    """(model, step function, its phases ``{name: fn}`` in ``PHASES`` order) of one trainer step with the
    trainer side under ``spec``; same init for all. ``compile``: the policy forward (and its backward)
    through ``quads.rl.compiled.CompiledForward`` (Inductor), as ``quads train`` runs it with
    ``trainer_compile``. The step is its phases run in order: the QAT weight refresh first (what the
    compiled forward does before its region and the plain one in its first quantized layer)."""
    model = _model(preset, args.device, "float32")
    quantize_model(model, Recipe("bench", trainer=spec, expert_path=args.trainer_experts), side="trainer",
                   verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    forward = CompiledForward() if compile else None
    held: list[torch.Tensor] = []  # the loss, from the forward phase to the backward phase

    def forward_loss():
        with torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16):
            res = forward_logprobs(model, batch, None, 1.0, return_entropy=True, forward=forward)
        held.append(-(res.logprobs * adv).sum() / batch.response_mask.sum() + res.aux_loss - 1e-3 * res.entropy.mean())

    def backward():
        opt.zero_grad(set_to_none=True)
        held.pop().backward()

    def optimizer():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    phases = dict(zip(PHASES, (lambda: refresh_stale(model), forward_loss, backward, optimizer), strict=True))

    def step():
        for fn in phases.values():
            fn()

    return model, step, phases


def _on_off(value: str, flag: str) -> list[bool]:
    """``on`` / ``off`` / ``off,on`` -> [False] / [True] / [False, True] (order kept, repeats dropped)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or set(items) - {"on", "off"}:
        raise ValueError(f"{flag}: expected on, off or a comma list of them; got {value!r}")
    return list(dict.fromkeys(v == "on" for v in items))


def bench_trainer(args, rows: list) -> None:
    """Per preset: one model per recipe (same init), ``--warmup`` steps each, then ``--steps`` timed
    steps of every recipe interleaved (``--interleave step``: b, q, b, q, ...; ``block``: blocks of
    ``--block`` steps, alternating), so drift of the machine hits both recipes alike."""
    tok = CharTokenizer()
    B, S, P = args.batch, args.seq_len, args.seq_len // 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, tok.vocab_size, (B, S), generator=g).to(args.device)
    batch = SequenceBatch(ids, torch.ones(B, S, dtype=torch.bool, device=args.device), P,
                          torch.ones(B, S - P, dtype=torch.bool, device=args.device))
    adv = torch.randn(B, 1, generator=g).to(args.device)
    timer = timer_of(args.device)
    recipes = [n.strip() for n in args.trainer_recipes.split(",") if n.strip()]
    bad = set(recipes) - set(TRAINER_RECIPES)
    if bad:
        raise ValueError(f"--trainer-recipes: unknown {sorted(bad)}; valid: {', '.join(TRAINER_RECIPES)}")
    compiles = _on_off(args.trainer_compile, "--trainer-compile")
    # one timed configuration per (compile, recipe); "+compile" names the compiled ones
    configs = {f"{r}+compile" if c else r: (r, c) for c in compiles for r in recipes}
    names = list(configs)
    for preset in [p.strip() for p in args.preset.split(",") if p.strip()]:
        steps, phases, n_params, cfg, compile_s = {}, {}, 0, None, {}
        for name, (recipe, comp) in configs.items():
            model, steps[name], phases[name] = _trainer_step(args, preset, TRAINER_RECIPES[recipe], batch, adv, comp)
            cfg, n_params = model.config, sum(p.numel() for p in model.parameters())
            compile_s[name] = timer(steps[name]) / 1e3  # the first step (with compile: tracing + Inductor)
            for _ in range(args.warmup):
                timer(steps[name])
        block = 1 if args.interleave == "step" else args.block
        ms: dict[str, list[float]] = {n: [] for n in names}
        while len(ms[names[-1]]) < args.steps:
            for name in names:
                for _ in range(min(block, args.steps - len(ms[name]))):
                    ms[name].append(timer(steps[name]))
        phase_runs: dict[str, list] = {n: [] for n in names}
        ptimer = _PhaseTimer(args.device)
        for _ in range(args.trainer_phases):
            for name in names:
                phase_runs[name].append(ptimer(phases[name]))
        prof = {name: _profile_step(phases[name], args.device) for name in names} if args.trainer_profile else {}
        del steps, phases, model
        flops = trainer_flops(cfg, B, S, S - P)
        base = names[0]
        rows_phases: dict[str, dict] = {}
        for name in names:
            recipe, comp = configs[name]
            st = timing_stats(ms[name])
            row = {"suite": "trainer", "preset": preset, "recipe": recipe, "compile": comp, "config": name,
                   "first_step_s": compile_s[name], "experts": args.trainer_experts,
                   "step_ms": st["median"], "iqr_pct": st["iqr_pct"], "mad_pct": st["mad_pct"], "stats": st,
                   "batch": B, "seq_len": S, "params": n_params, "active_params": cfg.num_params()["active"],
                   "model_tflop_per_step": flops / 1e12, "tflops": flops / (st["median"] * 1e-3) / 1e12,
                   "interleave": args.interleave, "warmup": args.warmup, "timer": "cuda_events"
                   if args.device.startswith("cuda") else "perf_counter", "raw_ms": ms[name]}
            if args.device.startswith("cuda"):
                row["mfu_h200_bf16"] = row["tflops"] * 1e12 / H200_BF16_DENSE_FLOPS
            if name in prof:
                row["profile"] = prof[name]
            if args.trainer_phases:
                row["phases"] = phase_stats(phase_runs[name], ptimer.cuda)
                if name != base:
                    row["phases"][f"vs_{base}_delta_ms"] = phase_deltas(row["phases"], rows_phases[base])
                rows_phases[name] = row["phases"]
            for ref in _ratio_refs(name, names, configs):
                r = ratio_ci(ms[name], ms[ref])
                row.update({f"vs_{ref}": r["ratio"], f"vs_{ref}_ci": [r["ci_lo"], r["ci_hi"]],
                            f"vs_{ref}_pair_median": r["pair_median"]})
            rows.append(row)
            print(_trainer_line(row), flush=True)
            if "phases" in row:
                print(_phases_line(row), flush=True)
        _write_json(args, rows)


def _ratio_refs(name: str, names: list[str], configs: dict[str, tuple[str, bool]]) -> list[str]:
    """The configurations a trainer row's time is divided by: the first one (plain first recipe); for a
    compiled row also its own recipe plain and the first recipe compiled (QAT's cost under compile)."""
    base = names[0]
    if name == base:
        return []
    recipe, comp = configs[name]
    refs = [base] + ([recipe] if comp and recipe in configs and recipe != base else [])
    return refs + [n for n in names if n not in refs and n != name and configs[n] == (configs[base][0], comp)]


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _profile_step(phases: dict, device: str, top: int = 15) -> dict:
    """torch.profiler over one more step, each phase under ``record_function("phase/<name>")``: kernels,
    launches and host syncs, the ``top`` ops by device (CPU: host) self time, ``(name, calls, ms)``, and per
    phase the kernel launches, host syncs and ATen calls (nested ones included) that start inside it, on
    any thread (the autograd engine's too), and its host ms."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for name, fn in phases.items():
            with record_function(f"phase/{name}"):
                fn()
        _sync(device)
    ev = prof.key_averages()
    t = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    out = {"gpu_kernels": sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA),
           "kernel_launches": sum(e.count for e in ev if e.key in _LAUNCHES),
           "syncs": sum(e.count for e in ev if e.key in _SYNCS),
           "memcpy": sum(e.count for e in ev if e.key in ("cudaMemcpyAsync", "cudaMemcpy"))}
    out["top"] = [(e.key[:80], e.count, round(t(e) / 1e3, 3)) for e in sorted(ev, key=lambda e: -t(e))[:top]]
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    spans = {e.name.removeprefix("phase/"): e.time_range for e in events if e.name.startswith("phase/")}
    out["phases"] = {}
    for name, span in spans.items():
        inside = [e for e in events if span.start <= e.time_range.start < span.end]
        out["phases"][name] = {"kernel_launches": sum(e.name in _LAUNCHES for e in inside),
                               "syncs": sum(e.name in _SYNCS for e in inside),
                               "aten_calls": sum(e.name.startswith("aten::") for e in inside),
                               "host_ms": round((span.end - span.start) / 1e3, 3)}
    return out


def _trainer_line(r: dict) -> str:
    vs = [k for k in r if k.startswith("vs_") and not k.endswith(("_ci", "_pair_median"))]
    extra = "".join(f"  {r[k]:.3f}x {k[3:]} (95% CI {r[k + '_ci'][0]:.3f}-{r[k + '_ci'][1]:.3f})" for k in vs)
    mfu = f"  MFU {100 * r['mfu_h200_bf16']:.1f}%" if "mfu_h200_bf16" in r else ""
    return (f"trainer {r['preset']:>5} {r.get('config', r['recipe']):>18} ({r['experts']}): {r['step_ms']:8.2f} ms/step "
            f"(IQR {r['iqr_pct']:.1f}%, MAD {r['mad_pct']:.1f}%, n={r['stats']['n']}, {r['batch']}x{r['seq_len']} tok)  "
            f"{r['tflops']:.1f} TFLOP/s{mfu}{extra}")


def _phases_line(r: dict) -> str:
    ph = r["phases"]
    parts = "  ".join(f"{n} {st['median']:.2f} (IQR {st['iqr_pct']:.0f}%)" for n, st in ph["ms"].items())
    delta = next((v for k, v in ph.items() if k.endswith("_delta_ms")), None)
    extra = "" if delta is None else "  delta " + " ".join(f"{n} {v:+.2f}" for n, v in delta.items())
    return (f"phases  {r['preset']:>5} {r.get('config', r['recipe']):>18}: {parts}  ms; sum of medians "
            f"{ph['sum_of_medians_ms']:.2f}, step {ph['step']['median']:.2f} ms (n={ph['steps']}){extra}")


def bench_vllm(args, rows: list) -> None:
    """quads' engine against vLLM's on one model, greedy, interleaved (module docstring)."""
    import tempfile

    from quads.model.hf import save_hf_model
    from quads.rollout.vllm.engine import VLLMEngineConfig, VLLMRolloutEngine

    tok = CharTokenizer()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, tok.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    sp = SamplingParams(n=args.n, temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0,
                        record_routing=False)  # the vLLM backend sends one request per greedy sample
    for preset in [p.strip() for p in args.preset.split(",") if p.strip()]:
        model = _model(preset, args.device, "bfloat16").requires_grad_(False)
        row = {"suite": "vllm", "preset": preset, "samples": len(prompts) * args.n, "new_tokens": args.new_tokens,
               "threads": torch.get_num_threads()}
        with tempfile.TemporaryDirectory() as d:
            folder = save_hf_model(model, tok, Path(d) / "policy")
            ec = VLLMEngineConfig(dtype="bfloat16", max_num_seqs=len(prompts) * args.n,
                                  max_model_len=args.prompt_len + args.new_tokens)
            engines = {"quads": RolloutEngine(model, tok, device=args.device),
                       "vllm": VLLMRolloutEngine(folder, tok, "bf16", ec)}
            first = {name: eng.generate(prompts, sp) for name, eng in engines.items()}  # warm-up
            tps: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(args.reps):
                for name, eng in engines.items():
                    _sync(args.device)
                    b = eng.generate(prompts, sp)
                    tps[name].append(b.stats.n_response_tokens / max(b.stats.prefill_s + b.stats.decode_s, 1e-9))
            del engines
        same = sum(a == b for a, b in zip(first["quads"].response_ids, first["vllm"].response_ids))
        row.update(quads_tokens_per_s=statistics.median(tps["quads"]), vllm_tokens_per_s=statistics.median(tps["vllm"]),
                   greedy_agree=same / len(first["quads"].response_ids))
        row["quads_vs_vllm"] = row["quads_tokens_per_s"] / row["vllm_tokens_per_s"]
        rows.append(row)
        print(f"vllm {preset:>5}: quads {row['quads_tokens_per_s']:8.0f} tok/s  vllm {row['vllm_tokens_per_s']:8.0f} "
              f"tok/s  quads/vllm {row['quads_vs_vllm']:.2f}x  greedy samples identical {same}/"
              f"{len(first['quads'].response_ids)}", flush=True)
        _write_json(args, rows)
        del model


def _write_json(args, rows: list) -> None:
    if args.json:
        path = Path(args.json)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"info": env_info(args.device), "args": vars(args), "rows": rows}, indent=1))
        tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", default="rollout,trainer", help="comma list: rollout, trainer, profile, vllm")
    ap.add_argument("--preset", default="100m", help="model preset(s) (quads.model.PRESETS), comma list")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16, help="rollout: prompts per generation")
    ap.add_argument("--n", type=int, default=8, help="rollout: samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=16, help="rollout: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64,
                    help="rollout: response tokens (eos ignored; at most this many with --stop-fraction)")
    ap.add_argument("--experts", default="grouped",
                    help="rollout expert paths of the host-dispatched decode, comma list: grouped (batched), "
                         "loop (one GEMM pair per expert)")
    ap.add_argument("--recipes", default="",
                    help="rollout: only these recipes, comma list, run in this order (default: all)")
    ap.add_argument("--decodes", default="auto",
                    help="rollout decode paths, comma list: auto (static on CUDA), static, eager (the reference)")
    ap.add_argument("--graphs", default="on,off", help="static decode on CUDA: CUDA graphs on, off or on,off "
                    "(profile suite: on = the compiled step(s) in graphs, off = the eager step)")
    ap.add_argument("--compile", default="on", help="static decode on CUDA: torch.compile of the step: on, off or on,off")
    ap.add_argument("--compile-prefill", default="on", choices=["on", "off"],
                    help="rollout and profile suites, static decode on CUDA: torch.compile of the prefill too (RolloutEngine "
                         "compile_prefill; the row's decode_path says +compiled-prefill)")
    ap.add_argument("--share-prefill", default="on", choices=["on", "off"],
                    help="rollout and profile suites, static decode: prefill each prompt once for its --n samples "
                         "(RolloutEngine share_prefill; the row's prefill_rows says how many rows the prefill ran)")
    ap.add_argument("--fuse-qkv", default="on", choices=["on", "off"],
                    help="rollout and profile suites, static decode: one GEMM by the stacked q/k/v weights instead of "
                         "three (RolloutEngine fuse_qkv; the row's decode_path says +fused-qkv)")
    ap.add_argument("--inductor-pdl", default="off", choices=["on", "off"],
                    help="rollout and profile suites: Inductor's programmatic dependent launch "
                         "(torch._inductor.config.triton.enable_pdl; sm_90+): its kernels let the next kernel start early")
    ap.add_argument("--decode-attention", default="auto",
                    help="rollout: the static step's attention, auto (the engine's default: triton on CUDA), sdpa, "
                         "triton, or a comma list such as sdpa,triton (RolloutEngine.decode_attention)")
    ap.add_argument("--long-tokens", type=int, default=512, help="rollout: the longer-response row (0 = none)")
    ap.add_argument("--stop-fraction", type=float, default=0.0,
                    help="rollout: this fraction of the vocabulary's ids (a fixed seeded subset) end a sample, so rows "
                         "finish at different steps as in a real rollout and their slots stay masked until the "
                         "batch ends (0: every row runs its new tokens; eos is ignored either way)")
    ap.add_argument("--long-recipes", default="bf16,w4a4+rac50", help="recipes that get the longer-response row")
    ap.add_argument("--profile-recipes", default="bf16,w4a4+rac50", help="profile suite: recipes to trace")
    ap.add_argument("--profile-top", type=int, default=15,
                    help="profile suite: the largest N kernels a step and outside decode (0: all of them)")
    ap.add_argument("--batch", type=int, default=64, help="trainer: sequences per step")
    ap.add_argument("--seq-len", type=int, default=128, help="trainer: tokens per sequence")
    ap.add_argument("--reps", type=int, default=5, help="rollout: timed generations (median)")
    ap.add_argument("--trainer-recipes", default="bf16,w4a16-qat",
                    help="trainer: recipes, comma list (bf16, w4a16-qat); ratios are against the first")
    ap.add_argument("--warmup", type=int, default=5, help="trainer: untimed steps per recipe first")
    ap.add_argument("--steps", type=int, default=30, help="trainer: timed steps per recipe (>= 20 to trust)")
    ap.add_argument("--interleave", choices=("step", "block"), default="step",
                    help="trainer: alternate the recipes every step, or every --block steps")
    ap.add_argument("--block", type=int, default=5, help="trainer: steps per block with --interleave block")
    ap.add_argument("--trainer-profile", action="store_true",
                    help="trainer: also profile one step per recipe (kernels, launches, syncs, top ops) into the JSON")
    ap.add_argument("--trainer-phases", type=int, default=0, metavar="N",
                    help="trainer: then N more steps per configuration, interleaved, timed phase by phase (QAT weight "
                         "refresh, forward + loss, backward, optimizer): median and IQR per phase into the JSON")
    ap.add_argument("--trainer-compile", default="off",
                    help="trainer: torch.compile of the policy forward + backward (quads.rl.compiled, as quads train's "
                         "trainer_compile): off, on, or off,on to time both interleaved")
    ap.add_argument("--trainer-experts", choices=("auto", "grouped", "loop"), default="auto",
                    help="trainer: expert path (Recipe.expert_path; auto = grouped GEMMs on CUDA, the loop on CPU)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.block < 1 or args.trainer_phases < 0:
        ap.error(f"expected --steps >= 1, --warmup >= 0, --block >= 1, --trainer-phases >= 0; got {args.steps}, "
                 f"{args.warmup}, {args.block}, {args.trainer_phases}")
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    bad = set(suites) - {"rollout", "trainer", "profile", "vllm"}
    if bad:
        ap.error(f"unknown suite(s) {sorted(bad)}; valid: rollout, trainer, profile, vllm")
    if not 0 <= args.stop_fraction < 1:
        ap.error(f"--stop-fraction must be in [0, 1), got {args.stop_fraction}")
    for flag, names in (("--recipes", args.recipes), ("--profile-recipes", args.profile_recipes),
                        ("--long-recipes", args.long_recipes)):
        unknown = [n for n in _names(names) if n not in ROLLOUT_RECIPES]
        if unknown:
            ap.error(f"{flag}: unknown recipe(s) {unknown}; valid: {', '.join(ROLLOUT_RECIPES)}")
    if args.inductor_pdl == "on":
        import torch._inductor.config as inductor_config

        inductor_config.triton.enable_pdl = True
    rows: list = []
    info = env_info(args.device)
    print("# " + json.dumps(info))
    if "rollout" in suites:
        bench_rollout(args, rows)
    if "trainer" in suites:
        bench_trainer(args, rows)
    if "profile" in suites:
        profile_decode(args, rows)
    if "vllm" in suites:
        bench_vllm(args, rows)
    for r in rows:
        if r["suite"] == "rollout":
            extra = "".join(f"  {v:.2f}x {k[3:]}" for k, v in r.items() if k.startswith("vs_"))
            print(_rollout_line(r) + extra)
        elif r["suite"] == "trainer":
            print(_trainer_line(r))
            if "phases" in r:
                print(_phases_line(r))
    out = {"info": info, "args": vars(args), "rows": rows}
    _write_json(args, rows)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
