"""quads' side of the vLLM comparisons: the same token sequences through quads' own forward.

``quads_prompt_logprobs(model, sequences)`` mirrors ``VLLMRolloutEngine.prompt_logprobs``: one
full-sequence forward per sequence (a batch of one, so batch-dependent activation scales and RAC
channels see the same tokens as a one-request vLLM prefill), log p(token t | tokens < t) at
temperature 1 in fp32. ``logprob_gap`` summarises two such lists (max / mean absolute difference).
"""

from __future__ import annotations

import torch
from torch import nn

from quads.rl.logprobs import SequenceBatch, forward_logprobs


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
