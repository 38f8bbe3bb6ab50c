"""quads' side of the vLLM comparisons: the same token sequences through quads' own forward.

``quads_prompt_logprobs(model, sequences)`` mirrors ``VLLMRolloutEngine.prompt_logprobs``: one
full-sequence forward per sequence (a batch of one, so batch-dependent activation scales and RAC
channels see the same tokens as a one-request vLLM prefill), log p(token t | tokens < t) at
temperature 1 in fp32. ``logprob_gap`` summarises two such lists (max / mean absolute difference).

``replay_layer_inputs(model, records)`` makes quads' forward quantize exactly the activations vLLM
quantized. Both engines compute the unquantized ops (attention, norms, rotary, router) with their own
kernels, which agree to float rounding (a few fp32 ulps), but which ulps differ depends on the CPU's
vector width (vLLM loads ``_C_AVX2`` or its AVX-512 library, torch dispatches per ISA). An activation
quantizer (FP8, NVFP4, a RAC channel choice) turns an ulp on a rounding boundary into a different code,
and a flipped code moves a sharp model's log-probs by up to nats. So the whole-model comparison feeds
every quads layer of quads' forward the input vLLM's layer recorded (``worker.record_inputs``), after
checking that quads' own input agrees with it to ``rtol`` (float rounding of the unquantized ops) and
that the router chose the same experts; the quantized layers then compute the same bits on both sides
(``test_experts_layer_bit_exact``) and what is left is rounding, on any CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from quads.rl.logprobs import SequenceBatch, forward_logprobs

ROUNDING_RTOL = 1e-5  # max |x_vllm - x_quads| / max |x_quads| at a layer input: fp32 rounding of the unquantized ops


@torch.no_grad()
def quads_prompt_logprobs(model: nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, fp32 ``[L - 1]`` log-probs of tokens 1..L-1 from quads' forward (module doc)."""
    dev = next(model.parameters()).device
    out = []
    for s in sequences:
        ids = torch.tensor([s], dtype=torch.long, device=dev)
        L = ids.shape[1]
        seq = SequenceBatch(ids, torch.ones_like(ids, dtype=torch.bool), 1, torch.ones((1, L - 1), dtype=torch.bool, device=dev),
                            torch.arange(L, device=dev)[None])
        out.append(forward_logprobs(model, seq).logprobs[0].float().cpu())
    return out


def logprob_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    """``{"max": max |a - b|, "mean": mean |a - b|, "n": tokens}`` over all positions of all sequences."""
    d = torch.cat([(x.double() - y.double()).abs() for x, y in zip(a, b, strict=True)])
    return {"max": float(d.max()), "mean": float(d.mean()), "n": int(d.numel())}


@contextmanager
def replay_layer_inputs(model: nn.Module, records: dict[str, list[tuple[torch.Tensor, ...]]],
                        rtol: float = ROUNDING_RTOL) -> Iterator[dict[str, int]]:
    """Within the block, every quads layer of ``model`` named in ``records`` computes on vLLM's recorded input.

    Rows are taken in order across calls (vLLM's prefill and decode steps vs one full-sequence forward);
    a forward may compute rows past the recorded ones (the last sampled token, which vLLM never feeds)
    on its own input. Raises ``AssertionError`` where quads' own input differs from vLLM's by more than
    ``rtol`` relative to its largest element, where the router picked other experts (or weighted them
    differently by more than ``rtol``), or, at exit, where recorded rows were left unconsumed. Yields
    ``{layer name: rows replayed}``.
    """
    from quads.quant.layers import QuantizedExperts, QuantizedLinear

    streams = {n: [torch.cat(parts) for parts in zip(*calls)] for n, calls in records.items() if calls}
    used = dict.fromkeys(streams, 0)

    def hook(name: str):
        def pre(module: nn.Module, args: tuple) -> tuple:
            x, rec, p = args[0], streams[name], used[name]
            flat = x.detach().reshape(-1, x.shape[-1])
            m = min(flat.shape[0], rec[0].shape[0] - p)
            if m <= 0:
                raise AssertionError(f"{name}: quads' forward computes rows {p}.. but vLLM recorded only {p}")
            got = rec[0][p:p + m].to(flat.dtype)
            scale = float(flat[:m].abs().max().clamp_min(torch.finfo(torch.float32).tiny))
            gap = float((flat[:m] - got).abs().max()) / scale
            if not gap <= rtol:
                raise AssertionError(f"{name}: vLLM's layer input differs from quads' by {gap:.3e} (relative) > "
                                     f"{rtol} rows {p}..{p + m}: more than float rounding of the unquantized ops")
            new = [torch.cat([got, flat[m:]]).reshape(x.shape)]
            if len(rec) == 3:
                ids, w = args[1], args[2]
                rid, rw = rec[1][p:p + m].to(ids.dtype), rec[2][p:p + m].to(w.dtype)
                if not torch.equal(ids[:m], rid):
                    raise AssertionError(f"{name}: vLLM's router chose other experts than quads' rows {p}..{p + m}")
                if not float((w[:m].detach() - rw).abs().max()) <= rtol:
                    raise AssertionError(f"{name}: vLLM's routing weights differ from quads' by more than {rtol}")
                new += [torch.cat([rid, ids[m:]]), torch.cat([rw, w[m:]])]
            used[name] = p + m
            return (*new, *args[len(new):])
        return pre

    handles = [mod.register_forward_pre_hook(hook(n)) for n, mod in model.named_modules()
               if n in streams and isinstance(mod, (QuantizedExperts, QuantizedLinear))]
    try:
        yield used
    finally:
        for h in handles:
            h.remove()
    left = {n: streams[n][0].shape[0] - used[n] for n in streams if used[n] and used[n] != streams[n][0].shape[0]}
    if left:
        raise AssertionError(f"vLLM recorded rows that quads' forward never computed: {left}")
