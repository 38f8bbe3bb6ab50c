"""RMSNorm, RoPE, the KV cache and GQA attention of the built-in MoE decoder.

Legend: ``B`` sequences, ``L`` new tokens in this forward, ``S`` key length (past + L), ``H`` hidden,
``D`` head dim, ``nh`` query heads, ``nkv`` key/value heads.

Numerics mirror Hugging Face Qwen3-MoE: RMSNorm normalises in at least fp32 and casts back before the
weight multiply; RoPE frequencies are computed in fp32 and cos/sin cast to the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quads.kernels.decode_attention import decode_attention_op
from quads.kernels.decode_qkv import decode_qkv_op
from quads.model.config import ModelConfig
from quads.model.gemm import Linear, linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 at least (bf16 inputs), fp64 stays fp64 so exactness tests are not limited by a cast
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, L, D] for integer positions [B, L] (HF "default" RoPE, halves concatenated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=position_ids.device) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq  # [B, L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D]; cos/sin [B, L, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``model``'s activations (so its keys and values) come out in right now: the autocast dtype
    when autocast is on for the model's device type (an fp32 trainer-side model under BF16 autocast),
    else the model's own dtype. A KV cache of this dtype stores exactly what the forward computes."""
    kind = model.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return model.dtype


DECODE_ATTENTION = ("sdpa", "triton")  # StaticKVCache.attention: how a fixed-shape decode step attends


class KVCache:
    """Preallocated keys/values per layer, [B, nkv, max_len, D], for incremental decode only.

    All rows share one write offset ``length`` (prompts are left-padded to a common width), so a decode
    step writes column ``length`` for every row. ``select(rows)`` keeps a subset of rows (finished
    sequences dropped). The model advances ``length`` once per forward, after the last layer.
    """

    attention = "sdpa"  # how a decode step attends over it (StaticKVCache may say "triton")
    # per layer, the q/k/v projections' weights as one [(nh + 2 nkv) D, H] tensor (or None: that layer's three
    # products): the rollout engine's fused projection (quads.rollout.decode.FusedQKV), one GEMM instead of three
    qkv: list[torch.Tensor | None] | None = None

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int | None = None, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        self.max_len = max_len or cfg.max_seq_len
        shape = (batch, cfg.n_kv_heads, self.max_len, cfg.head_dim)
        dtype = dtype or cfg.torch_dtype
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.length = 0

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, nkv, L, D] at [length, length + L) and return the keys/values [:, :, :length+L]."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache overflow: need {end} positions, cache holds {self.max_len}; "
                             "raise ModelConfig.max_seq_len or lower max_new_tokens")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def leading_rows(self, n: int) -> KVCache:
        """An empty ``KVCache`` over the first ``n`` rows of this one's buffers (views: what a forward writes
        into it lands here); the shared prefill writes each distinct prompt's keys and values through it."""
        if not 1 <= n <= self.batch:
            raise ValueError(f"leading_rows: n must be in [1, {self.batch}], got {n}")
        view = object.__new__(KVCache)
        view.max_len, view.length = self.max_len, 0
        view.k, view.v = [t[:n] for t in self.k], [t[:n] for t in self.v]
        view.qkv = self.qkv
        return view

    def spread_rows(self, source: torch.Tensor, columns: int) -> None:
        """Row ``i`` of every layer's keys and values, columns ``0..columns-1``, becomes row ``source[i]``'s
        (``source`` [B] long device tensor; gathered first, so rows may read rows that are written)."""
        for t in (*self.k, *self.v):
            t[:, :, :columns] = t[:, :, :columns].index_select(0, source)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (a long index tensor) of every layer's cache, in that order."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]


class StaticKVCache(KVCache):
    """A ``KVCache`` of fixed shape whose decode-time state lives on the device (fixed-shape decode).

    The prefill goes through ``update`` as in ``KVCache`` (host offset ``length``). After
    ``start_decode(prompt_mask)``, every ``update`` writes the column ``pos`` (a ``[1]`` long device
    tensor) with ``index_copy_`` and returns the whole buffers ``[B, nkv, max_len, D]``; ``key_mask``
    ``[B, max_len]`` bool marks the keys a query may see (columns not yet written are hidden) and
    ``row_pos`` ``[B]`` holds each row's RoPE position for the next token. ``advance_decode()`` moves
    both by one between steps, so no shape and no host value changes from step to step and one
    captured CUDA graph serves every step. ``attention``: how a decode step attends, "sdpa" (SDPA over
    all ``max_len`` columns, the unwritten ones masked) or "triton" (``quads.kernels.decode_attention``:
    reads only the columns ``0..pos`` written so far; a different fp32 summation order). Rows are never dropped (``select`` is refused): finished
    rows stay in their slot (``MoEForCausalLM.decode_step`` zeroes them).
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, attention: str = "sdpa") -> None:
        if attention not in DECODE_ATTENTION:
            raise ValueError(f"decode attention must be one of {DECODE_ATTENTION}, got {attention!r}")
        super().__init__(cfg, batch, max_len, dtype=dtype, device=device)
        self.attention = attention
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.row_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.key_mask = torch.zeros(batch, self.max_len, dtype=torch.bool, device=device)
        self.decoding = False

    def reset(self) -> None:
        """Empty the cache for a new generation (same buffers: a captured graph keeps reading them)."""
        for t in (*self.k, *self.v):
            t.zero_()
        self.key_mask.zero_()
        self.length, self.decoding = 0, False

    def start_decode(self, prompt_mask: torch.Tensor) -> None:
        """After the prefill of ``prompt_mask.shape[1]`` columns: show the prompt's real tokens as keys,
        write the next column, and start each row's positions after its real prompt tokens."""
        P = prompt_mask.shape[1]
        if P != self.length:
            raise ValueError(f"start_decode: the prefill wrote {self.length} columns, prompt_mask has {P}")
        self.key_mask.zero_()
        self.key_mask[:, :P] = prompt_mask.bool()
        self.pos.fill_(P)
        self.row_pos.copy_(prompt_mask.long().sum(-1))
        self.decoding = True

    def advance_decode(self) -> None:
        self.pos += 1
        self.row_pos += 1

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.decoding:
            return super().update(layer, k, v)
        # stored in the cache's dtype, as KVCache's slice assignment does (under autocast the rotated keys
        # can come out fp32 beside BF16 values; attention reads both in the autocast dtype); no-op casts else
        self.k[layer].index_copy_(2, self.pos, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, self.pos, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        if not self.decoding:
            super().advance(n)

    def select(self, rows: torch.Tensor) -> None:
        raise RuntimeError("StaticKVCache keeps every row in its slot; finished rows are masked, not dropped")


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is capturing a CUDA graph (where a read-back to the host is an error)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def build_attn_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, past: int,
                    device: torch.device) -> torch.Tensor | None:
    """Boolean SDPA mask [B, 1, L, S] (True = attend): causal, keys with ``attention_mask == 0`` hidden.

    ``attention_mask`` is [B, S] over all keys (past + new). A query always sees itself, so rows of
    padding tokens are never fully masked (their outputs are garbage but finite and unused).
    Returns None when plain causal attention is exact (no padding, no past, or a single query with
    no padding), so SDPA can take its ``is_causal`` fast path. Under ``torch.compile`` a given mask is
    always applied: the test for padding reads the mask back to the host (a graph break), so a traced
    caller passes None itself for a batch without padding (``quads.rl.logprobs.forward_logprobs`` does);
    the same under CUDA-graph capture (``quads.rollout.decode.StaticDecoder.prefill`` does).
    """
    if attention_mask is None or (not torch.compiler.is_compiling() and not _capturing(attention_mask)
                                  and bool(attention_mask.all())):
        if past == 0 or q_len == 1:
            return None
    s = past + q_len
    q_pos = torch.arange(past, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None]  # [1, L, S]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].bool()
        allowed = allowed | (k_pos == q_pos)[None]
    return allowed.expand(batch, q_len, s)[:, None]


class Attention(nn.Module):
    """GQA self-attention with optional q/k RMSNorm (per head: Qwen3; full width: OLMoE) and RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        H, q, kv = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = Linear(H, q, bias=False)
        self.k_proj = Linear(H, kv, bias=False)
        self.v_proj = Linear(H, kv, bias=False)
        self.o_proj = Linear(q, H, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(q, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kv, cfg.rms_norm_eps)

    def _fused_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      cache: KVCache | None, rows: torch.Tensor | None) -> bool:
        """Whether this forward is a fixed-shape decode step with Triton attention whose prologue (per-head q/k
        norm, RoPE, cache write) ``decode_qkv`` runs: one new token per row, every operand contiguous and in the
        cache's dtype (under autocast the norms' outputs may not be; then the operations below run)."""
        if rows is None or q.shape[1] != 1 or not isinstance(cache, StaticKVCache) or not cache.decoding:
            return False
        if cache.attention != "triton" or self.qk_norm != "head" or self.q_norm.eps != self.k_norm.eps:
            return False
        dt = cache.k[self.layer_idx].dtype
        same = all(t.dtype == dt for t in (q, k, v, cos, self.q_norm.weight, self.k_norm.weight))
        # q, k, v: rows of contiguous elements (the column slices of the fused projection's output qualify)
        return same and cos.is_contiguous() and all(t.stride(-1) == 1 for t in (q, k, v))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rows`` [B] bool (fixed-slot decode): rows that are False get a zero attention output, so
        they feed zeros, not garbage, into ``o_proj`` (whose activation scale may span the batch)."""
        B, L, _ = x.shape
        fused = None if cache is None or cache.qkv is None else cache.qkv[self.layer_idx]
        if fused is not None:  # one product, split into column slices (quads.rollout.decode.FusedQKV)
            q, k, v = linear(x, fused).split((self.n_heads * self.head_dim, *(2 * [self.n_kv * self.head_dim])), -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, L, nh*D], [B, L, nkv*D] x2
        if self._fused_decode(q, k, v, cos, cache, rows):
            # the fixed-shape decode step with Triton attention: q/k norm, RoPE and the cache write in one kernel
            # (quads.kernels.decode_qkv; the same operations as below, one launch), then the attention
            g = self.n_heads // self.n_kv
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
            qo = decode_qkv_op(q.view(B, -1), k.view(B, -1), v.view(B, -1), self.q_norm.weight, self.k_norm.weight,
                               self.q_norm.eps, cos.view(B, -1), sin.view(B, -1), kc, vc, cache.pos)
            out = decode_attention_op(qo.view(B, self.n_kv, g, self.head_dim), kc, vc, cache.key_mask, cache.pos, rows)
            return self.o_proj(out.reshape(B, L, self.n_heads * self.head_dim))  # [B, nkv, g, D] = [B, 1, nh*D]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, L, self.n_heads, self.head_dim)
        k = k.view(B, L, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, nh, L, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, nkv, L, D]
        v = v.view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # [B, nkv, S, D]
        if rows is not None and L == 1 and cache is not None and cache.attention == "triton":
            # the fixed-shape decode step over the written columns only (0..cache.pos)
            g = self.n_heads // self.n_kv
            out = decode_attention_op(q.reshape(B, self.n_kv, g, self.head_dim), k, v, cache.key_mask, cache.pos, rows)
            return self.o_proj(out.reshape(B, L, self.n_heads * self.head_dim))
        if rows is not None and L == 1 and self.n_kv != self.n_heads:
            # one new token: the g = nh / nkv query heads of a key/value head become g queries of it,
            # [B, nkv, g, D] against [B, nkv, S, D] (the same dot products and softmaxes as GQA, with
            # no copy of the whole cache per query head, which GQA's fallback kernel would make)
            g = self.n_heads // self.n_kv
            out = F.scaled_dot_product_attention(q.reshape(B, self.n_kv, g, self.head_dim), k, v, attn_mask=mask)
            out = torch.where(rows[:, None, None, None], out, 0.0).reshape(B, self.n_heads, 1, self.head_dim)
            return self.o_proj(out.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim))
        # mask None: plain causal (L > 1) or one query seeing every key; a branch, not `mask is None and L > 1`,
        # so that a dynamic-shape trace hands SDPA a bool (it refuses the symbolic L > 1)
        causal = True if mask is None and L > 1 else False  # noqa: SIM210
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=self.n_kv != self.n_heads)
        if rows is not None:
            out = torch.where(rows[:, None, None, None], out, 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim))
