"""The rollout side's data types, shared by every backend: ``SamplingParams`` (what to sample),
``RolloutBatch`` (what came out: tokens, log-probs of the sampled tokens, expert ids, finish reasons;
layout in ``quads.rollout.engine``'s docstring), ``RolloutStats`` (timings), ``encode_prompt``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt (a GRPO group), contiguous in the output
    temperature: float = 1.0  # 0 = greedy (seed ignored)
    top_p: float = 1.0  # nucleus truncation; keep 1.0 for RL (see module docstring)
    top_k: int = 0  # keep the k most likely tokens; 0 = off; keep 0 for RL
    max_new_tokens: int = 64  # response length cap (finish reason "length")
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end a sample (kept in the response); eos always does
    stop: tuple[str, ...] = ()  # strings that end a sample once the decoded response contains one
    ignore_eos: bool = False  # do not stop at the tokenizer's eos (benchmarks)
    seed: int | None = 0  # torch.Generator seed; None draws one from the global RNG
    record_routing: bool = True  # record expert ids per token and layer (routing replay, metrics)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop = tuple(self.stop)


@dataclass
class RolloutStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    n_prompt_tokens: int = 0  # real (unpadded) prompt tokens over all samples
    n_response_tokens: int = 0  # sampled tokens over all samples
    decode_steps: int = 0
    decode_path: str = ""  # "static+graph", "static" or "eager" (and the expert dispatch: "/device", "/host")
    graph_captures: int = 0  # CUDA graphs captured during this call (0 once warm)
    prefill_rows: int = 0  # prompt rows the prefill ran: the distinct prompts with a shared prefill, else every sample

    @classmethod
    def combine(cls, parts: list[RolloutStats]) -> RolloutStats:
        """The stats of batches joined into one: every count and time summed, the first one's decode path."""
        first = parts[0]
        return cls(**{f.name: first.decode_path if f.name == "decode_path" else sum(getattr(p, f.name) for p in parts)
                      for f in fields(cls)})

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """Sampled tokens per second of wall time (prefill included)."""
        return self.n_response_tokens / max(self.total_s, 1e-9)


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, P + R] long: left-padded prompts then right-padded responses (pad_id)
    attention_mask: torch.Tensor  # [B, P + R] bool, True at real tokens
    prompt_len: int  # P, width of the prompt block
    response_mask: torch.Tensor  # [B, R] bool, True at sampled tokens
    logprobs: torch.Tensor  # [B, R] float32 (float64 for a float64 model) log-probs of sampled tokens, 0 on padding
    routing: torch.Tensor | None  # [n_layers, B, P + R, k] long expert ids used by the engine; -1 = none
    finish_reasons: list[str]  # "stop" (eos, stop id or stop string) or "length"
    group_index: torch.Tensor  # [B] long: index of the prompt each sample came from
    prompt_ids: list[list[int]]  # per sample, unpadded
    response_ids: list[list[int]]  # per sample, unpadded (stop token included)
    texts: list[str]  # decoded responses
    stats: RolloutStats = field(default_factory=RolloutStats)
    recipe: str | None = None  # the rollout precision recipe, for reporting only
    decode: str = "eager"  # the engine's decode path ("static" or "eager"): rescoring replays the same one
    moe_dispatch: str = "host"  # the expert dispatch of that path ("device" or "host")
    cache_len: int = 0  # static decode: the KV cache length it attended over (rescoring uses the same)
    compiled: bool = False  # static decode: the step ran under torch.compile (rescoring replays the same)
    compiled_prefill: bool = False  # static decode: the prefill ran under torch.compile (rescoring the same)
    decode_attention: str = "sdpa"  # static decode: how the step attended (StaticKVCache.attention; rescoring the same)
    shared_prefill: bool = False  # static decode: a prompt repeated in the batch was prefilled once (prompt_groups; rescoring the same)
    fused_qkv: bool = False  # static decode: one product by the stacked q/k/v weights (decode.FusedQKV; rescoring the same)

    @property
    def response_tokens(self) -> torch.Tensor:
        """[B, R] long, the response block of ``input_ids``."""
        return self.input_ids[:, self.prompt_len:]

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    """A prompt as token ids: strings get ``<bos>`` (when the tokenizer has one) + their encoding;
    token-id prompts are used as given. Shared by every rollout backend so they see the same ids."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_id
        ids = ([bos] if bos is not None else []) + tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("empty prompt: give at least one token (string prompts get <bos> when the "
                         "tokenizer has one)")
    return ids


def prompt_block(samples: list[list[int]], P: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The left-padded prompt block of a ``RolloutBatch``, built on the host: ids [B, P] long (``pad_id``
    before each prompt) and mask [B, P] bool (True on the prompt's tokens). Shared by every rollout
    backend; one tensor each, so a device copy is one copy, not one per row."""
    ids = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in samples], dtype=torch.long).reshape(len(samples), P)
    lengths = torch.tensor([len(p) for p in samples], dtype=torch.long)
    return ids, torch.arange(P)[None, :] >= P - lengths[:, None]


def prompt_groups(samples: list[list[int]]) -> tuple[list[int], list[int]] | None:
    """The shared prefill's plan for ``samples`` (one prompt per row, a GRPO group's rows repeating it):
    ``(first, source)``, ``first`` the row of each distinct prompt's first occurrence (in row order) and
    ``source[i]`` the position in ``first`` of row ``i``'s prompt; None when no prompt repeats. The engine
    and rescoring compute it from the same prompt lists, so they prefill the same rows in the same order."""
    seen: dict[tuple[int, ...], int] = {}
    first: list[int] = []
    source: list[int] = []
    for i, p in enumerate(samples):
        key = tuple(p)
        if key not in seen:
            seen[key] = len(first)
            first.append(i)
        source.append(seen[key])
    return (first, source) if len(first) < len(samples) else None
