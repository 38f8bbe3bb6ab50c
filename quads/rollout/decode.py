"""The rollout engine's fixed-shape decode step, eager or replayed from a CUDA graph.

A ``StaticDecoder`` serves one batch size ``B`` and one cache length ``S`` (the engine rounds
P + max_new_tokens up to ``CACHE_BUCKET`` so that generations with similar prompt widths share it).
It owns:

- a ``StaticKVCache``: keys/values ``[B, nkv, S, D]`` per layer, the key mask, the write column and
  each row's position, all on the device;
- the step's inputs ``tokens`` ``[B]`` and ``rows`` ``[B]`` bool (rows still generating);
- with ``cuda_graphs``, one ``torch.cuda.CUDAGraph`` of ``MoEForCausalLM.decode_step``, captured at the
  first decode step (after two eager warm-up calls on a side stream) and replayed for every later
  step of every later generation. A replay re-reads every weight from its storage: weight sync
  copies into the same tensors (``copy_`` into parameters, ``WeightStore.refresh`` into quantized
  operands), so synced weights reach the graph with no re-capture. If a weight tensor is *replaced*
  (a new storage: ``model.to``, a re-quantization to another shape), the next generation sees a new
  ``weights_key`` and captures again (``n_captures`` counts them).

The prefill of the prompt block (``prefill``) runs the experts on the decoder's dispatch too (the capturable
path with ``device_dispatch``), so with ``cuda_graphs`` it is replayed from a graph as well: one per prompt
block shape ``(P, padded, routing recorded, distinct prompts)``, captured the *second* time a shape is prefilled (the first
runs it eagerly: a prompt width seen once, as with prompts of varying length, costs no capture) and kept for
``PREFILL_GRAPHS`` shapes of at most ``PREFILL_GRAPH_TOKENS`` tokens. Replayed or not it is the same kernels on the same operands, so the two give the same
bits; the eager prefill of a batch with padding needs one host read of the mask (``build_attn_mask``), which the
graph captures as "padded" instead.

A decode step is idempotent for a given state (it writes the same cache column and key-mask entry
again), which is what lets the warm-up calls run on the real state before the capture. Sampling
happens after the step, outside the graph (``quads.rollout.engine.sample_tokens``: no host sync), so
the seeded generator needs no graph registration and draws the same numbers with and without graphs.

With ``compile``, the step is ``torch.compile(MoEForCausalLM.decode_step)`` (Inductor: fused pointwise
kernels, one static shape, no recompilation across steps), run eagerly or captured in the graph like
the plain step. Inductor computes fused BF16 pointwise chains in fp32 and rounds once, so a compiled
step is a *different* rollout computation from the plain one (within rounding); the batch records
it (``RolloutBatch.compiled``) and rescoring replays the same compiled step, so the engine's log-probs
are still those of the computation that sampled each token.

With ``groups`` (the shared prefill, ``quads.rollout.types.prompt_groups``), a prompt that several rows
share (a GRPO group's n samples) is prefilled once: the forward runs the U distinct prompts into the
cache's leading rows (``KVCache.leading_rows``), then every row copies its prompt's keys and values
(``KVCache.spread_rows``), logits and expert ids, all inside the same graph. The decode steps that follow
are unchanged. It is 1/n of the prefill's tokens; since a batch of U rows is not the batch of B rows, the
quantized activations (per-tensor scales, RAC's channel choice) may round differently from the full
prefill, so the batch records it (``RolloutBatch.shared_prefill``) and rescoring replays the same.

With ``compile_prefill``, the prefill is ``torch.compile(prefill_forward)`` (shared by every model and
decoder) with the prompt width marked dynamic (``torch._dynamo.maybe_mark_dynamic``), so one graph per
(model, padding) case serves every width, as the trainer's compiled forward does (``quads.rl.compiled``:
static shapes would compile once per width; padding to width buckets would put extra pad tokens into the
activation-quantized GEMMs and change the numbers). The expert ids are always computed inside it, so the
graph, and with it the rounding, does not depend on whether the caller records them. A width of 1 is
specialised by Dynamo (one more graph). Replayed from a CUDA graph like the plain prefill; recorded in
the batch (``RolloutBatch.compiled_prefill``) and replayed by rescoring, as the compiled step is.

With ``fuse_qkv``, each attention layer whose q, k and v projections are plain ``Linear`` layers (BF16 in every
recipe that quantizes only the experts) multiplies once by the three weights stacked (``FusedQKV``, read through
``KVCache.qkv``) and splits the product into q, k and v column slices: one GEMM instead of three in the decode
step and the prefill. Every output column is the dot product of its own weight row, but the one GEMM's kernel may
sum in another order than the three's, so the batch records it (``RolloutBatch.fused_qkv``) and rescoring replays
it. The stacked weights are a copy (the layer's q/k/v weights once more in memory, one copy per model shared by its
decoders and rescoring: ``FusedQKV.of``), refreshed from the parameters at every generation's start (``begin``), in
place, so weight sync reaches them and a captured graph keeps reading the same storage.
"""

from __future__ import annotations

import torch

from quads.model import gemm
from quads.model.attention import StaticKVCache, activation_dtype

CACHE_BUCKET = 128  # cache lengths are multiples of this (a graph per bucket, not per prompt width)
# Dynamo's recompile limit while a compiled step runs: every (model, batch size, cache length) is one static-shape
# compile of the same code object, and past Dynamo's default of 8 the next shapes would run eagerly, silently
# (run 37: the 100m's 4-bit steps at 2x their time, after the 1b's eight compiles in the same process)
COMPILED_SHAPES = 64
PREFILL_GRAPHS = 8  # prefill graphs kept per decoder (prompt block shapes), the least recently used dropped
# larger prompt blocks (B x P tokens) always prefill eagerly: their GPU work hides the launches, and a graph
# would keep their activations' memory for good
PREFILL_GRAPH_TOKENS = 32768
# torch.compile backend of the compiled prefill, a name or a callable (tests: a counting backend that runs the captured
# ATen ops as they are)
PREFILL_COMPILE_BACKEND: object = "inductor"


def cache_length(needed: int) -> int:
    """The cache length serving ``needed`` = P + max_new_tokens columns."""
    return -(-needed // CACHE_BUCKET) * CACHE_BUCKET


def supports_device_dispatch(model: torch.nn.Module) -> bool:
    """Whether every MoE expert module of ``model`` has a capturable path (``forward_static``)."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        if not hasattr(experts, "forward_static"):
            return False
        if hasattr(experts, "supports_static") and not experts.supports_static():
            return False
    return True


def weights_key(model: torch.nn.Module) -> tuple:
    """Storage addresses of every tensor a captured step reads (parameters, buffers, quantized
    operands) and the RAC calibration switches it baked in; a change means: capture again."""
    from quads.quant.layers import _QuantizedBase

    key: list = [t.data_ptr() for t in model.parameters()]
    key += [t.data_ptr() for t in model.buffers()]
    for m in model.modules():
        if isinstance(m, _QuantizedBase):
            for store in m.stores.values():
                packed = store.kernel.tensors() if store.kernel is not None else ()
                packed += (store.fp8.data, store.fp8.scale) if store.fp8 is not None else ()
                key += [None if t is None else t.data_ptr() for t in (store.w_q, store.w_q32, store.w_amp, *packed)]
            key += [bool(getattr(sel, "observing", False)) for sel in m.selectors.values()]
    return tuple(key)


def _recompile_limit():
    """Dynamo's recompile limits raised to ``COMPILED_SHAPES`` while a compiled region of the decoder runs."""
    return torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES,
                                      accumulated_recompile_limit=max(COMPILED_SHAPES, 256))


def _compiled_step(model: torch.nn.Module):
    """``torch.compile`` of ``model.decode_step``, one per model (every decoder of a model shares its
    compiled code; a new batch size or cache length is a new static shape, compiled once), called under a
    recompile limit of ``COMPILED_SHAPES``."""
    fn = getattr(model, "_quads_compiled_decode_step", None)
    if fn is None:
        gemm.mark_compile_constants()
        compiled = torch.compile(model.decode_step, dynamic=False, fullgraph=False)

        def fn(*args, **kwargs):
            with _recompile_limit():
                return compiled(*args, **kwargs)

        object.__setattr__(model, "_quads_compiled_decode_step", fn)  # not an nn.Module attribute
    return fn


def prefill_forward(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None, cache: StaticKVCache,
                    device_dispatch: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill of ``input_ids`` [B, P] (``mask`` [B, P] or None: no padding) into the empty ``cache`` ->
    (logits of the last column [B, V], expert ids [n_layers, B, P, k]); the region ``compile_prefill`` compiles
    (no argument fixes the width: the logits slice is the last column, not ``P - 1``)."""
    out = model(input_ids, attention_mask=mask, cache=cache, return_routing=True, logits_slice=slice(-1, None),
                device_dispatch=device_dispatch)
    return out.logits[:, -1], out.routing


_COMPILED_PREFILL: dict[object, object] = {}  # backend -> torch.compile(prefill_forward)


def _compiled_prefill(backend: object):
    """``torch.compile(prefill_forward)`` for ``backend`` (one per process: Dynamo keeps a graph per model and
    padding case), called with the width of ``input_ids`` / ``mask`` marked dynamic, under a recompile limit of
    ``COMPILED_SHAPES``."""
    fn = _COMPILED_PREFILL.get(backend)
    if fn is None:
        gemm.mark_compile_constants()
        compiled = torch.compile(prefill_forward, backend=backend, dynamic=None, fullgraph=False)

        def fn(model, input_ids, mask, cache, device_dispatch):
            for t in (input_ids, mask):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 1)
            with _recompile_limit():
                return compiled(model, input_ids, mask, cache, device_dispatch)

        _COMPILED_PREFILL[backend] = fn
    return fn


class FusedQKV:
    """The stacked q/k/v weights of ``model``'s attention layers (module docstring, ``fuse_qkv``): ``weights[i]`` =
    ``[q; k; v]`` ``[(nh + 2 nkv) D, H]`` for layer i, or None where its projections are not three plain ``Linear``
    layers without bias in one dtype and on one device (a quantized projection keeps its own product). One per model
    (``of``): every decoder of a model and its rescoring share the copy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layout = self._layout(model)
        self.weights: list[torch.Tensor | None] = []
        # every fused projection and its row range of the stacked copy, for one multi-tensor copy (refresh)
        self._projs: list[torch.nn.Module] = []
        self._dst: list[torch.Tensor] = []
        for projs, plain in zip(self._projections(model), self.layout):
            if plain is None:  # a quantized projection may hold no plain weight
                self.weights.append(None)
                continue
            w = projs[0].weight
            rows = [p.weight.shape[0] for p in projs]
            out = torch.empty(sum(rows), w.shape[1], dtype=w.dtype, device=w.device)
            self.weights.append(out)
            self._projs.extend(projs)
            self._dst.extend(out.split(rows))
        self.refresh()

    @staticmethod
    def _projections(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ...]]:
        """Per layer, its attention's (q_proj, k_proj, v_proj)."""
        return [(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in model.model.layers]

    @classmethod
    def _layout(cls, model: torch.nn.Module) -> tuple:
        """Per layer: None (not fused) or the projections' identities, dtype, device and shapes."""
        out = []
        for projs in cls._projections(model):  # each attribute read once: this runs at every generation's start
            if not all(type(p) is gemm.Linear for p in projs):
                out.append(None)
                continue
            ws = [p.weight for p in projs]
            plain = all(type(w) is torch.nn.Parameter and p.bias is None for p, w in zip(projs, ws))
            same = plain and len({(w.dtype, w.device, w.shape[1]) for w in ws}) == 1
            out.append((tuple(map(id, projs)), ws[0].dtype, ws[0].device, tuple(tuple(w.shape) for w in ws))
                       if same else None)
        return tuple(out)

    @classmethod
    def of(cls, model: torch.nn.Module) -> FusedQKV:
        """``model``'s one ``FusedQKV``, made again when a projection's layout changed (another device or dtype, a
        replaced or quantized projection): the caller then holds new storages."""
        have = getattr(model, "_quads_fused_qkv", None)
        if have is None or have.layout != cls._layout(model):
            have = cls(model)
            object.__setattr__(model, "_quads_fused_qkv", have)  # not an nn.Module attribute
        return have

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the projections' current weights into the stacked ones (same storage as before): one multi-tensor
        copy over every layer's projections (on CUDA a launch or a few, against a copy per layer)."""
        if self._dst:  # each weight read now: a Parameter assigned since is copied too
            torch._foreach_copy_(self._dst, [p.weight for p in self._projs])


def device_groups(groups: tuple[list[int], list[int]] | None, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``prompt_groups``' host lists (first, source) as ``StaticDecoder.prefill``'s long tensors on ``device``
    (one host-to-device copy)."""
    if groups is None:
        return None
    first, source = groups
    both = torch.tensor(first + source, dtype=torch.long).to(device)
    return both[:len(first)], both[len(first):]


class StaticDecoder:
    """Fixed-slot decode of ``batch`` rows over a cache of ``max_len`` columns (module docstring)."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, *, device_dispatch: bool,
                 cuda_graphs: bool, compile: bool = False, compile_prefill: bool = False,
                 attention: str = "sdpa", fuse_qkv: bool = False) -> None:
        cfg, dev = model.config, model.device
        self.model = model
        self.batch, self.max_len = batch, max_len
        self.cache = StaticKVCache(cfg, batch, max_len, dtype=activation_dtype(model), device=dev,
                                   attention=attention)  # fmt: skip
        self.fuse_qkv = fuse_qkv
        self.fused_qkv: FusedQKV | None = None  # FusedQKV.of(model), taken at each begin
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        self.rows = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.device_dispatch = device_dispatch
        self.cuda_graphs = cuda_graphs and dev.type == "cuda"
        if self.cuda_graphs and not device_dispatch:
            raise ValueError("CUDA graphs need the capturable expert path (device_dispatch=True)")
        self.compiled = compile
        self._step_fn = _compiled_step(model) if compile else model.decode_step
        self.compiled_prefill = compile_prefill
        self._prefill_fn = _compiled_prefill(PREFILL_COMPILE_BACKEND) if compile_prefill else prefill_forward
        self.graph: torch.cuda.CUDAGraph | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._key: tuple | None = None  # weights_key when the graphs (step and prefills) were captured
        self.n_captures = 0
        # prefill graphs by prompt block shape: (graph, input ids, mask, (logits, routing)); shapes seen once
        self._prefills: dict[tuple, tuple] = {}
        self._prefill_seen: dict[tuple, int] = {}
        self.n_prefill_captures = 0

    def begin(self) -> StaticKVCache:
        """Start a generation: empty cache; drop the graphs if a weight tensor was replaced; the stacked q/k/v
        weights (``fuse_qkv``) copied from the parameters again."""
        fused = FusedQKV.of(self.model) if self.fuse_qkv else None
        if (self.graph is not None or self._prefills) and (weights_key(self.model) != self._key
                                                            or fused is not self.fused_qkv):
            self.graph, self._out = None, None
            self._prefills.clear()
        if fused is not None:
            self.fused_qkv, self.cache.qkv = fused, fused.weights
            fused.refresh()
        self.cache.reset()
        return self.cache

    def _prefill_run(self, ids: torch.Tensor, mask: torch.Tensor | None, routing: bool,
                     groups: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The prefill forward into the (empty) cache; idempotent: it writes columns ``0..P-1`` again. With
        ``groups`` = (first, source), the shared prefill: the rows ``first`` are prefilled into the cache's
        leading rows, then every row ``i`` takes row ``source[i]``'s keys, values, logits and expert ids."""
        self.cache.length, self.cache.decoding = 0, False
        cache = self.cache
        if groups is not None:
            first, source = groups
            ids, mask = ids.index_select(0, first), None if mask is None else mask.index_select(0, first)
            cache = self.cache.leading_rows(first.shape[0])
        ids, mask = ids.contiguous(), None if mask is None else mask.contiguous()  # one compiled layout (strides)
        logits, ids_out = self._prefill_fn(self.model, ids, mask, cache, self.device_dispatch)
        if groups is not None:
            self.cache.length = cache.length
            self.cache.spread_rows(source, cache.length)
            logits, ids_out = logits.index_select(0, source), ids_out.index_select(1, source)
        return logits, ids_out if routing else None

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, *, return_routing: bool,
                groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill the prompt block ``input_ids`` [B, P] (``mask`` [B, P] bool, left padding) into the cache
        from ``begin`` -> (logits of the last column [B, V], expert ids [n_layers, B, P, k] or None); then
        ``cache.start_decode(mask)``. ``groups``: the shared prefill (``quads.rollout.types.prompt_groups`` as
        long device tensors ``first`` [U] and ``source`` [B]): only the U distinct prompts run the forward, a
        GRPO group's rows copy their prompt's cache rows (a different batch from the full prefill, so
        quantized activations may round differently: the batch records it). From a graph where one was
        captured (module docstring): the outputs are then the graph's buffers, valid until the next prefill
        of that shape."""
        P = input_ids.shape[1]
        padded = not bool(mask.all())  # the one host read; no padding: plain causal attention, as the model's test
        key = (P, padded, return_routing, None if groups is None else groups[0].shape[0])
        use_graph = self.cuda_graphs and self.device_dispatch and input_ids.numel() <= PREFILL_GRAPH_TOKENS
        if use_graph and key not in self._prefills:
            self._prefill_seen[key] = self._prefill_seen.get(key, 0) + 1
            if self._prefill_seen[key] >= 2:
                self._capture_prefill(key, input_ids, mask, groups)
        if use_graph and key in self._prefills:
            graph, bufs, out = self._prefills.pop(key)
            self._prefills[key] = (graph, bufs, out)  # most recently used last
            for buf, t in zip(bufs, (input_ids, mask, *(groups or ()))):
                buf.copy_(t)
            graph.replay()
            self.cache.length = P  # the host-side offset the captured forward advanced once
            logits, routing = out
        else:
            logits, routing = self._prefill_run(input_ids, mask if padded else None, return_routing, groups)
        self.cache.start_decode(mask)
        return logits, routing

    def _capture_prefill(self, key: tuple, input_ids: torch.Tensor, mask: torch.Tensor,
                         groups: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        P, padded, routing, _ = key
        while len(self._prefills) >= PREFILL_GRAPHS:
            self._prefills.pop(next(iter(self._prefills)))
        bufs = tuple(t.clone() for t in (input_ids, mask, *(groups or ())))  # ids, mask (, first, source)
        ids_buf, mask_buf = bufs[:2]
        group_bufs = None if groups is None else bufs[2:]
        # one warm-up fills the allocator (the shape's first sight, eager, compiled the kernels)
        graph, out = self._graph_of(
            lambda: self._prefill_run(ids_buf, mask_buf if padded else None, routing, group_bufs), 1)
        self._prefills[key] = (graph, bufs, out)
        self.n_prefill_captures += 1

    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._step_fn(self.tokens, self.cache, self.rows, device_dispatch=self.device_dispatch)

    def _graph_of(self, run, warmups: int) -> tuple[torch.cuda.CUDAGraph, object]:
        """``run`` captured in a CUDA graph after ``warmups`` eager calls on a side stream -> (graph, the captured
        call's outputs); records the weights the graphs now read (``begin`` drops them all when these change)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        self._key = weights_key(self.model)
        return graph, out

    def _capture(self) -> None:
        # two warm-ups: compile the Triton kernels, pick cuBLAS plans, fill the allocator
        self.graph, self._out = self._graph_of(self._run, 2)
        self.n_captures += 1

    def step(self, tokens: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode ``tokens`` [B] for ``rows`` [B] bool at the cache's current column -> (logits [B, V],
        expert ids [n_layers, B, k]); then the cache moves to the next column. With a graph, the
        outputs are the graph's own buffers: read them before the next step."""
        self.tokens.copy_(tokens)
        self.rows.copy_(rows)
        if self.cuda_graphs:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            out = self._out
        else:
            out = self._run()
        self.cache.advance_decode()
        return out
