"""The trainer's compiled policy forward: ``torch.compile`` of ``quads.rl.logprobs.policy_forward``.

What is compiled: the model forward that feeds the training loss and the old log-probs (embedding,
attention, router, experts with W4A16 QAT's cached ``QDQ(W)`` and straight-through operand, final
norm and the lm_head over the response columns), and through AOTAutograd its backward. What stays
eager: ``token_logprobs`` (its vocabulary chunk loop has as many chunks as the step has tokens per
chunk, a count the graph would have to be specialised on), the loss, the optimizer, and two things
that must read the host before the region: whether the batch has padding (SDPA's causal fast path)
and whether an optimizer step changed a QAT weight (``quads.quant.layers.refresh_stale``).

Shapes. The batch size is fixed by the config (``rollout.prompts_per_step * n_samples /
optim.mini_batches``; the old log-probs take the whole batch, without grad: a second graph; with
``optim.micro_batch_size`` every forward takes one micro-batch, of at most two sizes, then the batch
dimension is dynamic too: ``CompiledForward(dynamic_batch=True)``), but the sequence width ``P + R`` (widest prompt + longest response of the step) changes every step. The
sequence dimension is marked dynamic (``torch._dynamo.maybe_mark_dynamic``) on every input, so one
graph per (grad mode, autocast, routing replay, padding, ``return_routing``) case serves every width,
compiled at its first use. Static shapes would compile once per (P, R) pair (hundreds in a run, past
Dynamo's recompile limit); padding to width buckets would bound them but puts extra pad tokens into
each activation-quantized GEMM (an NVFP4 tensor amax over the batch) and into the routing-replay
layout, so it would change the numbers, not just the speed. A width of 1 (a one-token response) is
specialised by Dynamo: one more graph.

Numerics. With the default Inductor backend the forward and backward are a different computation
from the plain ones (fused BF16 pointwise chains are computed in fp32 and rounded once, other GEMM
plans), within rounding; the run's config records ``trainer_compile``. With ``backend="eager"`` the
traced graph runs the same ATen ops as the plain forward and matches it bit for bit (the CPU tests).
The experts' grouped path (``moe.sorted_expert_mlp``, the CUDA default) traces without a graph break;
the per-expert loop reads the expert counts to the host and breaks the graph at every layer (still
correct, less gain).
"""

from __future__ import annotations

from typing import Literal

import torch

from quads.model import gemm
from quads.quant.layers import refresh_stale
from quads.rl.logprobs import policy_forward

CompileSetting = Literal["auto", True, False]


def resolve(setting: CompileSetting, device: str | torch.device, distributed: bool) -> bool:
    """Whether the trainer compiles its forward: ``auto`` = on CUDA devices in one process (Inductor's
    CPU compile takes longer than the short CPU runs it would speed up); True under torchrun is refused
    (FSDP2's per-layer gather hooks and the QAT cache refresh are not traced)."""
    if setting not in ("auto", True, False):
        raise ValueError(f"trainer_compile must be auto, true or false; got {setting!r}")
    if setting is True and distributed:
        raise ValueError("trainer_compile=true is not supported under torchrun (FSDP2 trainer); "
                         "pass --trainer-compile auto or false")
    if setting == "auto":
        return torch.device(device).type == "cuda" and not distributed
    return bool(setting)


class CompiledForward:
    """``policy_forward`` under ``torch.compile`` (a drop-in for it: ``forward_logprobs(forward=...)``).

    Each call first brings the QAT weight caches up to date eagerly (``refresh_stale``), marks the
    sequence dimension of every input dynamic, then runs the compiled region. ``backend``: Inductor in
    the product; ``eager`` / ``aot_eager`` in tests. ``fullgraph``: raise on a graph break (tests).
    ``dynamic_batch``: mark the batch dimension dynamic too, for micro-batches of two sizes
    (``optim.micro_batch_size`` not dividing a mini-batch, ``quads.rl.microbatch``): one graph serves
    both instead of a static one per size (a batch of one row is still specialised).
    """

    def __init__(self, backend: str = "inductor", *, fullgraph: bool = False, dynamic_batch: bool = False) -> None:
        self.backend = backend
        self.dynamic_batch = dynamic_batch
        gemm.mark_compile_constants()
        self.fn = torch.compile(policy_forward, backend=backend, fullgraph=fullgraph, dynamic=None)

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, routing: torch.Tensor | None, response_mask: torch.Tensor,
                 return_routing: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        refresh_stale(model)
        for t, dim in ((input_ids, 1), (attention_mask, 1), (position_ids, 1), (routing, 2), (response_mask, 1)):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, dim)
                if self.dynamic_batch:
                    torch._dynamo.maybe_mark_dynamic(t, dim - 1)  # the rows: dimension 1 of routing, else 0
        return self.fn(model, input_ids, attention_mask, position_ids, routing, response_mask, return_routing)
