"""The rollout engine: batched sampling with a KV cache, log-probs and routing of the sampled tokens.

Recipe: every prompt is repeated ``n`` times (samples of one prompt are contiguous: one GRPO group),
all samples are left-padded to a common prompt width ``P`` and prefilled in one forward, then decoded
one token per step. This path (prefill + incremental decode) is deliberately different from the
trainer's one full-sequence forward (``quads.rl.logprobs``); their disagreement is the engine-drift floor.

Two decode paths (``RolloutEngine(decode=...)``; the batch records which one ran, ``RolloutBatch.decode``):
- ``static`` (default on CUDA): fixed batch slots for the whole generation. A finished row stays in its
  slot as exact zeros through the network (no expert, zero attention output: it changes no other row's
  activation scales), its tokens are padding and its log-probs are not recorded. The KV cache, the key
  mask, the write column and the positions are preallocated device tensors, the experts dispatch on
  the device (``moe_dispatch="device"``), and nothing is read back to the host inside a step, so one
  ``MoEForCausalLM.decode_step`` is captured in a CUDA graph and replayed (``quads.rollout.decode``; the
  prompt block's prefill too, per block shape seen before: ``StaticDecoder.prefill``; with ``share_prefill``,
  the default, each distinct prompt is prefilled once and its KV cache rows copied to its group's rows);
  "all rows done" is read back every ``done_check_interval`` steps (stop strings: every step).
- ``eager`` (default on the CPU, and the reference): one forward per step over the unfinished rows
  only (finished rows dropped from the cache), with a key mask that grows by one column per step.
Both draw the sampling noise for every row of the batch at every step, so, up to the forwards'
rounding, they sample the same tokens.

Log-probs are those of the distribution actually sampled from: ``log_softmax(logits / temperature)``
after top-k/top-p truncation. At temperature 0 decoding is greedy and the reported log-prob is that of
the argmax under the temperature-1 softmax (what an RL trainer at temperature 1 would compare against).
RL should sample with ``top_p=1, top_k=0``: truncation makes the behaviour policy differ from the
policy the trainer differentiates (tokens outside the nucleus get probability 0 on one side only),
which biases importance ratios.

Layout of a ``RolloutBatch`` (what the trainer consumes): ``input_ids`` [B, P + R] = left-padded
prompt block of width P, then the response block of width R (right-padded); ``logprobs[:, j]`` is the
log-prob of ``input_ids[:, P + j]``, predicted at column ``P + j - 1``.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from quads.kernels._common import HAS_TRITON, interpreter_on
from quads.model.attention import DECODE_ATTENTION, KVCache, activation_dtype
from quads.model.tokenizer import Tokenizer
from quads.rollout.decode import StaticDecoder, cache_length, device_groups, supports_device_dispatch
from quads.rollout.types import (
    RolloutBatch,
    RolloutStats,
    SamplingParams,
    encode_prompt,
    prompt_block,
    prompt_groups,
)

# cuDNN attention builds a plan for every new key length (one per decode step, ~tens of ms each on an
# H200 the first time); the memory-efficient kernel takes the boolean mask with no such cost.
_DECODE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def sampling_noise(rows: int, vocab: int, logits_dtype: torch.dtype, device: torch.device,
                   generator: torch.Generator | None) -> torch.Tensor:
    """[rows, vocab] Exp(1) draws, in the dtype ``sample_tokens`` computes in."""
    dtype = torch.promote_types(logits_dtype, torch.float32)
    return torch.empty((rows, vocab), dtype=dtype, device=device).exponential_(1, generator=generator)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                  noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, V] -> (token ids [b], log-probs [b]) of the distribution sampled from (module doc).

    Sampling is ``argmax(p / q)`` with ``q ~ Exp(1)`` (``noise`` [b, V], drawn from ``generator`` when
    None): the algorithm of ``torch.multinomial(p, 1)``, same draws, same tokens, without its two host
    syncs (a validity check and a zero-sum check), so a decode step needs no readback.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if params.temperature == 0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > params.top_p  # mass before this token already exceeds top_p
        logits = logits.scatter(1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    logp = torch.log_softmax(logits, -1)
    if noise is None:
        noise = sampling_noise(logp.shape[0], logp.shape[1], logp.dtype, logp.device, generator)
    tok = (logp.exp() / noise).argmax(-1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


class RolloutEngine:
    """Generates from ``model`` (used as given: the quantization helper may have swapped its layers)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, recipe: str | None = None, *,
                 device: torch.device | str | None = None, max_batch_tokens: int | None = None,
                 decode: Literal["auto", "static", "eager"] = "auto", cuda_graphs: bool = True,
                 moe_dispatch: Literal["auto", "device", "host"] = "auto", done_check_interval: int = 16,
                 compile: bool = True, compile_prefill: bool = True, share_prefill: bool = True,
                 fuse_qkv: bool = True, decode_attention: Literal["auto", "sdpa", "triton"] = "auto") -> None:
        """``recipe`` is stored for reporting only; ``max_batch_tokens`` caps samples per prefill/decode
        batch at max_batch_tokens // (P + max_new_tokens) (chunks run one after another, so results
        with sampling depend on it through the generator's draw order; greedy results do not).

        ``decode``: the decode path (module docstring); auto = static on CUDA, eager elsewhere.
        ``cuda_graphs``: replay the static decode step, and the prefill of a prompt block shape seen before,
        from CUDA graphs (CUDA, device dispatch only; False for debugging). ``moe_dispatch``: device = the experts' capturable path (device-side
        sort, grouped GEMMs with device offsets), host = their reference path (host-side grouping);
        auto = device on CUDA when every expert module has it. ``done_check_interval``: static decode
        reads "all rows done" back every this many steps (the only host sync of a step).
        ``compile``: on CUDA, run the static decode step under ``torch.compile`` (``quads.rollout.decode``;
        fused pointwise kernels, 2.2x faster on an H200, a different rounding from the plain step,
        recorded in the batch; False for debugging). The CPU never compiles (Inductor's CPU compile of
        the step takes minutes).
        ``compile_prefill``: on CUDA, also run the static path's prefill under ``torch.compile``, one graph
        serving every prompt width (``quads.rollout.decode``; its own rounding, recorded in the batch and
        replayed by rescoring): the 1b prefill 18.1 -> 8.5 ms in BF16 on an H100 (docs/PERF.md run 56), for
        a second cold compile per model; False for debugging or short-lived processes.
        ``share_prefill``: on the static path, prefill a prompt that several samples share (``SamplingParams.n
        > 1``, or the same prompt given twice) once and copy its cache rows to every sample
        (``quads.rollout.decode``): 1/n of the prefill's tokens; a different batch for the quantized
        activations from the full prefill, recorded in the batch and replayed by rescoring.
        ``fuse_qkv``: on the static path, one product by the stacked q/k/v weights instead of three, split into
        column slices (``quads.rollout.decode.FusedQKV``; attention layers with plain BF16 projections, a copy of
        their weights refreshed at each generation's start); the one GEMM may sum in another order, recorded in
        the batch and replayed by rescoring. On by default: the 1b decode step 2.50 -> 2.31 ms in BF16, 2.06 -> 1.90 ms
        in W4A16 on an H100 (docs/PERF.md run 64); False keeps the three products.
        ``decode_attention``: how the static decode step attends (``StaticKVCache.attention``): "sdpa" over
        the whole cache, the unwritten columns masked, or "triton", ``quads.kernels.decode_attention``,
        which reads only the columns written so far (CUDA; on the CPU only under Triton's interpreter, for
        tests); its fp32 sums run in another order, recorded in the batch for rescoring. "auto" (the
        default) = "triton" on CUDA with Triton installed and a bf16 / fp16 model (1b, H200: 4.25 -> 3.21 ms per
        decode step at 512 new tokens, docs/PERF.md run 24), else "sdpa" (an fp32 model may run under autocast,
        whose q, k and v dtypes differ: SDPA takes that, the kernel does not).
        """
        if decode_attention != "auto" and decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be auto or one of {DECODE_ATTENTION}, got {decode_attention!r}")
        if decode not in ("auto", "static", "eager"):
            raise ValueError(f"decode must be auto, static or eager, got {decode!r}")
        if moe_dispatch not in ("auto", "device", "host"):
            raise ValueError(f"moe_dispatch must be auto, device or host, got {moe_dispatch!r}")
        if done_check_interval < 1:
            raise ValueError(f"done_check_interval must be >= 1, got {done_check_interval}")
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else model.device
        if self.device != model.device:
            model.to(self.device)
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}")
        self.max_batch_tokens = max_batch_tokens
        self.recipe = recipe
        self.decode, self.cuda_graphs, self.moe_dispatch = decode, cuda_graphs, moe_dispatch
        self.done_check_interval = done_check_interval
        self.compile, self.compile_prefill = compile, compile_prefill
        self.share_prefill, self.fuse_qkv = share_prefill, fuse_qkv
        if decode_attention == "auto":
            decode_attention = ("triton" if self.device.type == "cuda" and HAS_TRITON
                                and activation_dtype(model) in (torch.bfloat16, torch.float16) else "sdpa")
        self.decode_attention = decode_attention
        if decode_attention == "triton" and self.device.type != "cuda" and not interpreter_on():
            raise ValueError("decode_attention='triton' needs a CUDA device (or Triton's CPU interpreter, "
                             "TRITON_INTERPRET=1, for tests); use 'sdpa'")
        if decode_attention == "triton" and activation_dtype(model) == torch.float64:
            raise ValueError("decode_attention='triton' takes bf16 / fp16 / fp32 activations; this model's are "
                             "float64: use 'sdpa'")
        self._decoders: dict[tuple, StaticDecoder] = {}  # (B, cache length, dispatch, graphs) -> decoder

    def decode_plan(self) -> tuple[str, str, bool]:
        """(decode path, expert dispatch, CUDA graphs) that ``generate`` will use on this model."""
        cuda = self.device.type == "cuda"
        path = self.decode if self.decode != "auto" else ("static" if cuda else "eager")
        capturable = supports_device_dispatch(self.model)
        if self.moe_dispatch == "device" and not capturable:
            raise ValueError("moe_dispatch='device': an expert module of this model has no capturable path "
                             "(forward_static); use moe_dispatch='auto' or 'host'")
        dispatch = self.moe_dispatch
        if dispatch == "auto":
            dispatch = "device" if cuda and capturable else "host"
        if path == "eager":
            dispatch = "host"
        graphs = path == "static" and cuda and self.cuda_graphs and dispatch == "device"
        return path, dispatch, graphs

    def _compiled(self) -> bool:
        """Whether the static decode step runs compiled (``compile``, on CUDA only)."""
        return self.compile and self.device.type == "cuda"

    def _compiled_prefill(self) -> bool:
        """Whether the static path's prefill runs compiled (``compile_prefill``, on CUDA only)."""
        return self.compile_prefill and self.device.type == "cuda"

    def _decoder(self, batch: int, max_len: int, dispatch: str, graphs: bool) -> StaticDecoder:
        compiled, compiled_prefill = self._compiled(), self._compiled_prefill()
        key = (batch, max_len, dispatch, graphs, compiled, compiled_prefill, self.decode_attention, self.fuse_qkv)
        if key not in self._decoders:
            while len(self._decoders) >= 2:  # bound the memory of caches and graphs kept warm
                self._decoders.pop(next(iter(self._decoders)))
            self._decoders[key] = StaticDecoder(self.model, batch, max_len, device_dispatch=dispatch == "device",
                                                cuda_graphs=graphs, compile=compiled, compile_prefill=compiled_prefill,
                                                attention=self.decode_attention, fuse_qkv=self.fuse_qkv)  # fmt: skip
        return self._decoders[key]

    def score(self, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
        """[B, R] teacher-forced log-probs of ``batch``'s responses on this engine's path (``quads.rollout.score``)."""
        from quads.rollout.score import score_rollout

        return score_rollout(self.model, batch, temperature, cuda_graphs=self.cuda_graphs).logprobs

    def load_weights(self, source):
        """Sync the trainer's weights from ``source`` into this engine's model: copy, re-quantize, verify
        (``quads.quant.sync.WeightSync`` into a ``ReplicaTarget``); returns the ``SyncReport``."""
        from quads.quant.sync import ReplicaTarget, WeightSync

        return WeightSync(source, ReplicaTarget(self.model)).run()

    @torch.no_grad()
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None
                 ) -> RolloutBatch:
        params = params or SamplingParams()
        cfg = self.model.config
        ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        samples = [p for p in ids for _ in range(params.n)]
        group = torch.arange(len(ids)).repeat_interleave(params.n)
        P = max(len(p) for p in samples)
        if P + params.max_new_tokens > cfg.max_seq_len:
            raise ValueError(f"longest prompt ({P}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"max_seq_len {cfg.max_seq_len}; shorten prompts or lower max_new_tokens")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        gen = torch.Generator(device=self.device).manual_seed(seed)
        per_chunk = len(samples)
        if self.max_batch_tokens is not None:
            per_chunk = max(1, self.max_batch_tokens // (P + params.max_new_tokens))
        path, dispatch, graphs = self.decode_plan()
        was_training = self.model.training
        self.model.eval()
        try:
            with sdpa_kernel(_DECODE_BACKENDS):
                if path == "static":
                    parts = [self._generate_chunk_static(samples[i:i + per_chunk], P, params, gen, dispatch, graphs)
                             for i in range(0, len(samples), per_chunk)]
                else:
                    parts = [self._generate_chunk(samples[i:i + per_chunk], P, params, gen)
                             for i in range(0, len(samples), per_chunk)]
        finally:
            self.model.train(was_training)
        batch = _concat(parts, P, self.tokenizer.pad_id)
        batch.group_index = group
        batch.recipe = self.recipe
        batch.decode, batch.moe_dispatch = path, dispatch
        batch.cache_len = cache_length(P + params.max_new_tokens) if path == "static" else 0
        batch.compiled = path == "static" and self._compiled()
        batch.compiled_prefill = path == "static" and self._compiled_prefill()
        batch.decode_attention = self.decode_attention if path == "static" else "sdpa"
        batch.shared_prefill = path == "static" and self.share_prefill
        batch.fused_qkv = path == "static" and self.fuse_qkv
        attn = "+triton-attention" if batch.decode_attention == "triton" else ""
        pre = "+compiled-prefill" if batch.compiled_prefill else ""
        qkv = "+fused-qkv" if batch.fused_qkv else ""
        batch.stats.decode_path = (f"{path}{'+compile' if batch.compiled else ''}{pre}{'+graph' if graphs else ''}{attn}"
                                   f"{qkv}/{dispatch}")
        return batch

    def _sync(self) -> None:
        """Wait for the device (CUDA), so the chunk's timings are the work's, not its launches'."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _stop_ids(self, params: SamplingParams) -> torch.Tensor:
        """The token ids that end a sample: ``params.stop_token_ids`` and eos (unless ``ignore_eos``)."""
        ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.tokenizer.eos_id})
        return torch.tensor(sorted(ids), dtype=torch.long, device=self.device)

    def _output_buffers(self, samples: list[list[int]], P: int, params: SamplingParams):
        """The chunk's output tensors: ``input_ids`` / ``mask`` [B, P + R] with the left-padded prompts
        written in, ``logprobs`` [B, R] (fp32, or fp64 for exactness tests) and ``routing``
        [n_layers, B, P + R, k] (-1 = none; None without ``record_routing``)."""
        model, dev, cfg = self.model, self.device, self.model.config
        B, R = len(samples), params.max_new_tokens
        input_ids = torch.full((B, P + R), self.tokenizer.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((B, P + R), dtype=torch.bool, device=dev)
        block, block_mask = prompt_block(samples, P, self.tokenizer.pad_id)  # one host-to-device copy each
        input_ids[:, :P], mask[:, :P] = block.to(dev), block_mask.to(dev)
        logprobs = torch.zeros((B, R), dtype=torch.promote_types(model.dtype, torch.float32), device=dev)
        routing = None
        if params.record_routing:
            routing = torch.full((cfg.n_layers, B, P + R, cfg.top_k), -1, dtype=torch.long, device=dev)
        return input_ids, mask, logprobs, routing

    def _generate_chunk(self, samples: list[list[int]], P: int, params: SamplingParams,
                        gen: torch.Generator) -> RolloutBatch:
        model, tok, dev = self.model, self.tokenizer, self.device
        cfg = model.config
        B, R = len(samples), params.max_new_tokens
        t0 = time.perf_counter()
        input_ids, mask, logprobs, routing = self._output_buffers(samples, P, params)
        lp_dtype = logprobs.dtype
        stop_t = self._stop_ids(params)
        cache = KVCache(cfg, B, P + R, dtype=activation_dtype(model), device=dev)

        out = model(input_ids[:, :P], attention_mask=mask[:, :P], cache=cache,
                    return_routing=params.record_routing, logits_slice=slice(P - 1, P))
        if routing is not None:
            routing[:, :, :P] = out.routing.masked_fill(~mask[None, :, :P, None], -1)
        logits = out.logits[:, -1]
        self._sync()
        t1 = time.perf_counter()
        active = torch.arange(B, device=dev)  # cache row -> sample row
        finish = ["length"] * B
        steps = 0
        for t in range(R):
            noise = None
            if params.temperature > 0:  # every row draws, finished or not, as the static path does
                noise = sampling_noise(B, logits.shape[-1], logits.dtype, dev, gen)[active]
            nxt, lp = sample_tokens(logits, params, gen, noise)
            input_ids[active, P + t] = nxt
            logprobs[active, t] = lp.to(lp_dtype)
            mask[active, P + t] = True
            done = torch.isin(nxt, stop_t)
            if params.stop:
                done = done | self._hit_stop_string(input_ids, active, P, t, params.stop)
            for row in active[done].tolist():
                finish[row] = "stop"
            if t == R - 1 or bool(done.all()):
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                active, nxt = active[keep], nxt[keep]
                cache.select(keep)
            out = model(nxt[:, None], attention_mask=mask[active, :P + t + 1], cache=cache,
                        return_routing=params.record_routing)
            steps += 1
            if routing is not None:
                routing[:, active, P + t] = out.routing[:, :, 0]
            logits = out.logits[:, -1]
        self._sync()
        t2 = time.perf_counter()
        resp_mask = mask[:, P:]
        prompt_ids = [list(p) for p in samples]
        response_ids = [input_ids[i, P:][resp_mask[i]].tolist() for i in range(B)]
        stats = RolloutStats(prefill_s=t1 - t0, decode_s=t2 - t1, n_prompt_tokens=sum(map(len, samples)),
                             n_response_tokens=int(resp_mask.sum()), decode_steps=steps, prefill_rows=B)
        return RolloutBatch(input_ids=input_ids, attention_mask=mask, prompt_len=P, response_mask=resp_mask,
                            logprobs=logprobs, routing=routing, finish_reasons=finish,
                            group_index=torch.zeros(B, dtype=torch.long), prompt_ids=prompt_ids,
                            response_ids=response_ids, texts=[tok.decode(r) for r in response_ids],
                            stats=stats)

    def _generate_chunk_static(self, samples: list[list[int]], P: int, params: SamplingParams,
                               gen: torch.Generator, dispatch: str, graphs: bool) -> RolloutBatch:
        """The static decode path (module docstring): fixed slots, one ``StaticDecoder`` step per token."""
        tok, dev = self.tokenizer, self.device
        B, R = len(samples), params.max_new_tokens
        t0 = time.perf_counter()
        input_ids, mask, logprobs, routing = self._output_buffers(samples, P, params)
        lp_dtype = logprobs.dtype
        stop_t = self._stop_ids(params)
        dec = self._decoder(B, cache_length(P + R), dispatch, graphs)
        captures = dec.n_captures
        dec.begin()

        groups = prompt_groups(samples) if self.share_prefill else None
        logits, pre_routing = dec.prefill(input_ids[:, :P], mask[:, :P], return_routing=params.record_routing,
                                          groups=device_groups(groups, dev))
        if routing is not None:
            routing[:, :, :P] = pre_routing.masked_fill(~mask[None, :, :P, None], -1)
        self._sync()
        t1 = time.perf_counter()
        rows = torch.ones(B, dtype=torch.bool, device=dev)  # rows still generating
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        steps = 0
        for t in range(R):
            nxt, lp = sample_tokens(logits, params, gen)
            live = rows
            input_ids[:, P + t] = torch.where(live, nxt, tok.pad_id)
            logprobs[:, t] = torch.where(live, lp.to(lp_dtype), 0.0)
            mask[:, P + t] = live
            hit = torch.isin(nxt, stop_t) & live
            if params.stop:  # decoded on the host: one readback per step
                act = live.nonzero().squeeze(1)
                by_string = torch.zeros_like(hit)
                by_string[act] = self._hit_stop_string(input_ids, act, P, t, params.stop)
                hit = hit | by_string
            stopped = stopped | hit
            rows = live & ~hit
            if t == R - 1:
                break
            if (params.stop or (t + 1) % self.done_check_interval == 0) and not bool(rows.any()):
                break
            logits, step_routing = dec.step(torch.where(rows, nxt, tok.pad_id), rows)
            steps += 1
            if routing is not None:
                routing[:, :, P + t] = torch.where(rows[None, :, None], step_routing, -1)
        self._sync()
        t2 = time.perf_counter()
        resp_mask = mask[:, P:]
        prompt_ids = [list(p) for p in samples]
        resp_host, keep_host = input_ids[:, P:].tolist(), resp_mask.tolist()  # two readbacks, not 2 per row
        response_ids = [[t for t, m in zip(r, k) if m] for r, k in zip(resp_host, keep_host)]
        finish = ["stop" if s else "length" for s in stopped.tolist()]
        stats = RolloutStats(prefill_s=t1 - t0, decode_s=t2 - t1, n_prompt_tokens=sum(map(len, samples)),
                             n_response_tokens=int(resp_mask.sum()), decode_steps=steps,
                             graph_captures=dec.n_captures - captures,
                             prefill_rows=B if groups is None else len(groups[0]))
        return RolloutBatch(input_ids=input_ids, attention_mask=mask, prompt_len=P, response_mask=resp_mask,
                            logprobs=logprobs, routing=routing, finish_reasons=finish,
                            group_index=torch.zeros(B, dtype=torch.long), prompt_ids=prompt_ids,
                            response_ids=response_ids, texts=[tok.decode(r) for r in response_ids],
                            stats=stats)

    def _hit_stop_string(self, input_ids: torch.Tensor, active: torch.Tensor, P: int, t: int,
                         stops: tuple[str, ...]) -> torch.Tensor:
        """[b] bool: the decoded tail of each active response contains a stop string."""
        width = max(len(s) for s in stops) + 4  # tokens: enough for any stop string of that many chars
        tails = input_ids[active, P + max(0, t + 1 - width):P + t + 1].tolist()
        hits = [any(s in self.tokenizer.decode(tail) for s in stops) for tail in tails]
        return torch.tensor(hits, dtype=torch.bool, device=active.device)


def _concat(parts: list[RolloutBatch], P: int, pad_id: int) -> RolloutBatch:
    """Join chunks (same prompt width P) into one batch, trimming the response block to the longest."""
    R = max(int(p.response_mask.sum(-1).max()) for p in parts)
    first = parts[0]

    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([getattr(p, name) for p in parts], dim=dim)

    input_ids, mask = cat("input_ids")[:, :P + R], cat("attention_mask")[:, :P + R]
    routing = cat("routing", dim=1)[:, :, :P + R] if first.routing is not None else None
    stats = RolloutStats.combine([p.stats for p in parts])
    return RolloutBatch(input_ids=input_ids, attention_mask=mask, prompt_len=P,
                        response_mask=mask[:, P:], logprobs=cat("logprobs")[:, :R], routing=routing,
                        finish_reasons=[r for p in parts for r in p.finish_reasons],
                        group_index=cat("group_index"), prompt_ids=[x for p in parts for x in p.prompt_ids],
                        response_ids=[x for p in parts for x in p.response_ids],
                        texts=[x for p in parts for x in p.texts], stats=stats)
