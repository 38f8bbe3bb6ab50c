"""Rollout-side teacher forcing: the engine's log-probs of *given* token sequences.

``score_rollout(model, batch)`` replays a ``RolloutBatch`` through the rollout engine's own path
(one prefill of the prompt block into a ``KVCache``, then one decode forward per response column)
but feeds the batch's tokens instead of sampling. It mirrors ``RolloutEngine._generate_chunk`` step
for step, including the rows it drops from the cache when a sample ends (a sample of length n is
fed for its first n - 1 tokens; the last one is never fed back), because under NVFP4 a per-tensor
activation scale depends on which rows share a forward. So scoring a batch with the model that
sampled it reproduces the engine's log-probs bit for bit, and scoring it with another rollout
variant changes exactly one thing: the numerics of the rollout forward.

A batch from the engine's static decode path (``batch.decode == "static"``) is replayed on that path:
the same fixed slots, cache length, expert dispatch and compiled-or-plain step, a row fed while its sample continues (the
same rule), a CUDA graph when ``cuda_graphs`` and the dispatch allow it, and the shared prefill of repeated prompts
when the batch says so (``batch.shared_prefill``: the groups from ``batch.prompt_ids``, as the engine made them), and
the fused q/k/v product when it was used (``batch.fused_qkv``).

This is the rollout side only: it never calls the trainer's full forward (``quads.rl.logprobs``);
the disagreement between the two paths is the engine-drift floor of DESIGN.md section 2.
Not supported: batches the engine produced in several chunks (``max_batch_tokens``), whose rows
were decoded in separate forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import sdpa_kernel

from quads.model.attention import KVCache, activation_dtype
from quads.rollout.decode import StaticDecoder, cache_length, device_groups
from quads.rollout.engine import _DECODE_BACKENDS
from quads.rollout.types import RolloutBatch, prompt_groups


@dataclass
class ScoreResult:
    logprobs: torch.Tensor  # [B, R] log-probs of the batch's response tokens at `temperature`, 0 on padding
    routing: torch.Tensor | None  # [n_layers, B, P + R, k] expert ids of every fed token; -1 where not fed; None: not recorded (vLLM)


@torch.no_grad()
def score_rollout(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0, *,
                  cuda_graphs: bool = True) -> ScoreResult:
    """Teacher-forced rollout log-probs of ``batch``'s responses under ``model`` (module docstring).

    ``temperature`` must be the one the batch was sampled at (> 0); log-probs are
    ``log_softmax(logits / temperature)`` in fp32 (fp64 for an fp64 model), as the engine reports.
    ``cuda_graphs``: for a static-path batch on CUDA with device dispatch, replay the step from a graph.
    """
    if temperature <= 0:
        raise ValueError(f"score_rollout needs temperature > 0, got {temperature}; greedy batches report "
                         "temperature-1 log-probs, so pass 1.0")
    if batch.decode == "static":
        return _score_static(model, batch, temperature, cuda_graphs)
    cfg, dev = model.config, model.device
    ids = batch.input_ids.to(dev)
    full_mask = batch.attention_mask.to(dev).bool()
    P = batch.prompt_len
    B, S = ids.shape
    R = S - P
    lengths = batch.response_mask.sum(-1).tolist()
    lp_dtype = torch.promote_types(model.dtype, torch.float32)
    logprobs = torch.zeros((B, R), dtype=lp_dtype, device=dev)
    routing = torch.full((cfg.n_layers, B, S, cfg.top_k), -1, dtype=torch.long, device=dev)
    cache = KVCache(cfg, B, S, dtype=activation_dtype(model), device=dev)
    was_training = model.training
    model.eval()
    try:
        with sdpa_kernel(_DECODE_BACKENDS):
            out = model(ids[:, :P], attention_mask=full_mask[:, :P], cache=cache, return_routing=True,
                        logits_slice=slice(P - 1, P))
            routing[:, :, :P] = out.routing.masked_fill(~full_mask[None, :, :P, None], -1)
            logits = out.logits[:, -1]
            active = torch.arange(B, device=dev)  # cache row -> sample row
            for t in range(R):
                tok = ids[active, P + t]
                lp = torch.log_softmax(logits.to(lp_dtype) / temperature, -1).gather(1, tok[:, None]).squeeze(1)
                logprobs[active, t] = lp
                done = torch.tensor([lengths[i] == t + 1 for i in active.tolist()], device=dev)
                if t == R - 1 or bool(done.all()):
                    break
                if bool(done.any()):
                    keep = (~done).nonzero().squeeze(1)
                    active, tok = active[keep], tok[keep]
                    cache.select(keep)
                out = model(tok[:, None], attention_mask=full_mask[active, :P + t + 1], cache=cache,
                            return_routing=True)
                routing[:, active, P + t] = out.routing[:, :, 0]
                logits = out.logits[:, -1]
    finally:
        model.train(was_training)
    logprobs = logprobs.masked_fill(~batch.response_mask.to(dev).bool(), 0.0)
    return ScoreResult(logprobs, routing)


def _score_static(model: torch.nn.Module, batch: RolloutBatch, temperature: float, cuda_graphs: bool
                  ) -> ScoreResult:
    """``score_rollout`` on the engine's static decode path (``RolloutEngine._generate_chunk_static``)."""
    cfg, dev = model.config, model.device
    ids = batch.input_ids.to(dev)
    full_mask = batch.attention_mask.to(dev).bool()
    P = batch.prompt_len
    B, S = ids.shape
    R = S - P
    lengths = batch.response_mask.to(dev).sum(-1)
    n_max = int(lengths.max()) if B else 0
    lp_dtype = torch.promote_types(model.dtype, torch.float32)
    logprobs = torch.zeros((B, R), dtype=lp_dtype, device=dev)
    routing = torch.full((cfg.n_layers, B, S, cfg.top_k), -1, dtype=torch.long, device=dev)
    device_dispatch = batch.moe_dispatch == "device"
    dec = StaticDecoder(model, B, batch.cache_len or cache_length(S), device_dispatch=device_dispatch,
                        cuda_graphs=cuda_graphs and device_dispatch, compile=batch.compiled,
                        compile_prefill=batch.compiled_prefill, attention=batch.decode_attention,
                        fuse_qkv=batch.fused_qkv)
    was_training = model.training
    model.eval()
    try:
        with sdpa_kernel(_DECODE_BACKENDS):
            dec.begin()
            groups = device_groups(prompt_groups(batch.prompt_ids), dev) if batch.shared_prefill else None
            logits, pre_routing = dec.prefill(ids[:, :P], full_mask[:, :P], return_routing=True, groups=groups)
            routing[:, :, :P] = pre_routing.masked_fill(~full_mask[None, :, :P, None], -1)
            for t in range(R):
                tok = ids[:, P + t]
                lp = torch.log_softmax(logits.to(lp_dtype) / temperature, -1).gather(1, tok[:, None]).squeeze(1)
                logprobs[:, t] = lp
                if t + 1 >= n_max:
                    break
                rows = lengths > t + 1  # the engine feeds token t back iff the sample continues after it
                logits, step_routing = dec.step(torch.where(rows, tok, 0), rows)
                routing[:, :, P + t] = torch.where(rows[None, :, None], step_routing, -1)
    finally:
        model.train(was_training)
    logprobs = logprobs.masked_fill(~batch.response_mask.to(dev).bool(), 0.0)
    return ScoreResult(logprobs, routing)
