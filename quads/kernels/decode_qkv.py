"""The decode step's attention prologue in one Triton kernel: per-head RMSNorm of q and k, RoPE, and the new
key / value column written into the fixed-shape KV cache.

In the rollout engine's fixed-shape decode step (``quads.model.attention.StaticKVCache``, one new token per
row) the projections' outputs go through ``q_norm`` / ``k_norm`` (Qwen3's per-head RMSNorm), RoPE, and the
cache write at column ``pos`` before the decode attention (``quads.kernels.decode_attention``). Inductor
compiles these ~15 small ops into two or three kernels per layer. Here they are one launch of B programs:

- ``decode_qkv(q [B, nh*D], k, v [B, nkv*D], q_weight, k_weight [D], eps, cos, sin [B, D], k_cache,
  v_cache [B, nkv, S, D], pos [1]) -> q_out [B, nh, D]``; writes ``k_cache[:, :, pos] = rope(k_norm(k))`` and
  ``v_cache[:, :, pos] = v``. Every tensor in one dtype (the model's: BF16, FP16 or FP32).
- Numerics: the eager module's operations in its order and roundings (``quads.model.attention.RMSNorm``,
  ``apply_rope``): ``h = fp32(x) / sqrt(mean(h^2) + eps)`` rounded to the dtype, times the weight (rounded),
  then ``x * cos`` and ``rotate_half(x) * sin`` each rounded, their sum rounded. The mean is a sum of D fp32
  squares (Triton's order, one of the orders a reduction may take) times 1/D, the reciprocal square root
  ``1 / sqrt`` with IEEE square root and division (no approximate ``rsqrt``), and no FMA contraction, so the
  interpreter and sm_90 agree wherever the sum does; against the eager module the difference is the sum's
  order and ``rsqrt``'s rounding (tests: within one rounding of the dtype).
- ``decode_qkv_reference``: the eager module's code path, what the kernel is tested against.
- ``quads::decode_qkv``: the launcher as one custom op (mutating the two caches), opaque to ``torch.compile``.
"""

from __future__ import annotations

import torch

from quads.kernels._common import EXACT, HAS_TRITON


def decode_qkv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``decode_qkv`` through the model's own modules' operations (eager PyTorch), the same arguments."""
    from quads.model.attention import apply_rope

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # quads.model.attention.RMSNorm.forward
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    B, D = cos.shape
    nkv = k_cache.shape[1]
    qn = norm(q.view(B, 1, -1, D), q_weight).transpose(1, 2)  # [B, nh, 1, D]
    kn = norm(k.view(B, 1, nkv, D), k_weight).transpose(1, 2)
    q_out = apply_rope(qn, cos[:, None], sin[:, None])
    k_cache.index_copy_(2, pos, apply_rope(kn, cos[:, None], sin[:, None]).to(k_cache.dtype))
    v_cache.index_copy_(2, pos, v.view(B, 1, nkv, D).transpose(1, 2).to(v_cache.dtype))
    return q_out[:, :, 0]


def rows_contiguous(t: torch.Tensor) -> bool:
    """Whether a 2-D ``t`` holds each row's elements next to each other (its rows may be any stride apart)."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1) and (t.stride(0) >= t.shape[1] or t.shape[0] <= 1)


def _check(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, pos) -> None:
    B, D = cos.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"decode_qkv: caches must be [B, nkv, S, D] alike with B = {B}, D = {D} (cos); got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    nkv = k_cache.shape[1]
    if q.dim() != 2 or q.shape[0] != B or q.shape[1] % (nkv * D):
        raise ValueError(f"decode_qkv: q must be [B, nh * D] with nh a multiple of nkv = {nkv}, got {tuple(q.shape)}")
    if k.shape != (B, nkv * D) or v.shape != (B, nkv * D) or sin.shape != cos.shape:
        raise ValueError(f"decode_qkv: k, v must be [{B}, {nkv * D}] and sin like cos; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(sin.shape)}")
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"decode_qkv: norm weights must be [{D}], got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    dts = {t.dtype for t in (q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache)}
    if len(dts) != 1 or next(iter(dts)) not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"decode_qkv: every tensor in one of bf16, fp16, fp32; got {sorted(map(str, dts))}")
    if D & (D - 1) or D < 16:
        raise ValueError(f"decode_qkv: the head dim must be a power of two >= 16, got {D}")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"decode_qkv: pos must be one integer, got {tuple(pos.shape)} {pos.dtype}")


if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out

    @triton.jit
    def _norm_rope(x_ptr, stride_x, w_ptr, cos, sin, row, H: tl.constexpr, D: tl.constexpr, eps, out_ptr):
        """The H heads of one row of ``x`` ``[*, H * D]`` (rows ``stride_x`` elements apart): RMSNorm (weight
        ``w``), RoPE; returned in ``out_ptr``'s dtype as fp32 values (every step rounded as the eager module
        rounds)."""
        h = tl.arange(0, H)[:, None]
        d = tl.arange(0, D)[None, :]
        half: tl.constexpr = D // 2
        rot = (d + half) % D  # rotate_half's source: x[d + D/2] (negated) for d < D/2, x[d - D/2] after
        x = tl.load(x_ptr + row * stride_x + h * D + d).to(tl.float32)
        xr = tl.load(x_ptr + row * stride_x + h * D + rot).to(tl.float32)
        ms = tl.sum(x * x, axis=1) * (1.0 / D)  # [H]; mean = sum * (1 / D), exact for D a power of two
        inv = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))[:, None]
        w = tl.load(w_ptr + d).to(tl.float32)
        wr = tl.load(w_ptr + rot).to(tl.float32)
        y = cast_out(w * cast_out(x * inv, out_ptr).to(tl.float32), out_ptr).to(tl.float32)
        yr = cast_out(wr * cast_out(xr * inv, out_ptr).to(tl.float32), out_ptr).to(tl.float32)
        yr = tl.where(d < half, -yr, yr)
        a = cast_out(y * cos, out_ptr).to(tl.float32)
        b = cast_out(yr * sin, out_ptr).to(tl.float32)
        return cast_out(a + b, out_ptr)

    @triton.jit
    def _decode_qkv_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, pos_ptr, qo_ptr,
                           stride_q, stride_k, stride_v, eps, S, NH: tl.constexpr, NKV: tl.constexpr,
                           D: tl.constexpr):  # fmt: skip
        """Row b: its NH query heads normed and rotated into ``qo``; its NKV key heads normed, rotated and
        stored in the key cache at column ``pos``, its value heads copied to the value cache there."""
        b = tl.program_id(0)
        d = tl.arange(0, D)[None, :]
        cos = tl.load(cos_ptr + b * D + d).to(tl.float32)
        sin = tl.load(sin_ptr + b * D + d).to(tl.float32)
        qo = _norm_rope(q_ptr, stride_q, qw_ptr, cos, sin, b, NH, D, eps, qo_ptr)
        h = tl.arange(0, NH)[:, None]
        tl.store(qo_ptr + b * (NH * D) + h * D + d, qo)
        ko = _norm_rope(k_ptr, stride_k, kw_ptr, cos, sin, b, NKV, D, eps, kc_ptr)
        p = tl.load(pos_ptr).to(tl.int64)
        hk = tl.arange(0, NKV)[:, None]
        col = ((b * NKV + hk) * S + p) * D + d  # cache [B, NKV, S, D], contiguous
        tl.store(kc_ptr + col, ko)
        tl.store(vc_ptr + col, tl.load(v_ptr + b * stride_v + hk * D + d))


def decode_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
               eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               pos: torch.Tensor, *, num_warps: int = 4) -> torch.Tensor:
    """The prologue (module docstring) in one launch; ``cos``, ``sin`` and the caches contiguous, ``q``, ``k``,
    ``v`` rows of contiguous elements (any row stride: the column slices of one fused projection's output too).
    Returns ``q_out`` ``[B, nh, D]``."""
    _check(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, pos)
    for name, t in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache), ("q_weight", q_weight),
                    ("k_weight", k_weight)):
        if not t.is_contiguous():
            raise ValueError(f"decode_qkv: {name} must be contiguous")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not rows_contiguous(t):
            raise ValueError(f"decode_qkv: {name}'s rows must be contiguous (stride 1 along the row), got strides "
                             f"{t.stride()}")
    B, D = cos.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    nh = q.shape[1] // D
    if nh & (nh - 1) or nkv & (nkv - 1):
        raise ValueError(f"decode_qkv: the head counts must be powers of two, got nh = {nh}, nkv = {nkv}")
    out = torch.empty(B, nh, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    _decode_qkv_kernel[(B,)](q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, pos, out, q.stride(0),
                             k.stride(0), v.stride(0), float(eps), S, NH=nh, NKV=nkv, D=D, num_warps=num_warps,
                             **EXACT)  # fmt: skip
    return out


@torch.library.custom_op("quads::decode_qkv", mutates_args=("k_cache", "v_cache"))
def _decode_qkv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pos: torch.Tensor) -> torch.Tensor:
    return decode_qkv(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, pos)


@_decode_qkv_op.register_fake
def _(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, pos):
    B, D = cos.shape
    return q.new_empty(B, q.shape[1] // D, D)


def decode_qkv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  pos: torch.Tensor) -> torch.Tensor:
    """``decode_qkv`` as the custom op ``quads::decode_qkv`` (opaque to ``torch.compile``; mutates the caches)."""
    return torch.ops.quads.decode_qkv(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, pos)
