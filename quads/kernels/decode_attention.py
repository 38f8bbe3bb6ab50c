"""Decode attention over a fixed-shape KV cache that reads only the columns written so far (Triton).

The rollout engine's fixed-shape decode step (``quads.model.attention.StaticKVCache``) keeps keys and
values in buffers ``[B, nkv, S, D]`` sized for the whole generation, and SDPA reads all S columns at
every step, the ones not written yet included (hidden by the key mask). Here the last column that may hold a key is
a device tensor (``last``, the cache's write position ``StaticKVCache.pos``), so one captured CUDA graph
serves every step while each step reads only columns ``0..last``: over a generation about half of what
SDPA reads, and the longer the responses the more.

- ``decode_attention(q [B, nkv, g, D], k, v [B, nkv, S, D], key_mask [B, S] bool, last [1] int, rows [B]
  bool or None) -> [B, nkv, g, D]``: for each of the g query heads of a key/value head (GQA), softmax over the keys with
  ``key_mask`` True among columns ``0..last`` of ``q . k / sqrt(D)``, times v; columns after ``last``
  are never read. Flash-decoding: grid (B x nkv, splits), each program runs an online
  softmax over its chunk of the columns in fp32 and writes (max, sum, weighted values) to an fp32
  workspace; a second kernel combines the splits in a fixed order (the same call gives the same bits
  every time) and casts once (RNE) to ``q``'s dtype; with one split (short caches at a full batch) the split
  kernel does the combine's arithmetic itself, one launch. The g queries of a head are padded to one 16-row
  tensor-core tile: ``q . k`` is an MMA of the BF16 (FP16) inputs (exact products, fp32 sums), and the
  fp32 probabilities enter ``p @ v`` as two half-precision terms ``p_hi + p_lo`` (16 significant bits),
  so the result stays within one output rounding of the exact value (tests: against an fp64
  reference); fp32 inputs multiply in IEEE fp32; fp64 is refused (the reference computes it). No FMA
  contraction (``EXACT``): the bits do not depend on Triton's default, so rescoring in another process
  gives the same ones. A row with no visible key gets zeros (SDPA gives NaN; the
  engine never has one: a query always sees itself). ``rows`` (the fixed-slot decode's live rows): a row that is
  False reads no column and gets zeros (in place of a ``torch.where`` after the kernel, one more kernel a layer; over a
  generation whose rows finish early, the finished rows' cache is not read).
- ``decode_attention_reference``: the same in PyTorch (fp64 by default), what the kernel is tested against.
- ``quads::decode_attention``: the launcher as one custom op, so a compiled decode step keeps it opaque.
"""

from __future__ import annotations

import math

import torch

from quads.kernels._common import EXACT, HAS_TRITON, interpreted

SMS = 132  # H200 streaming multiprocessors: the split heuristic aims at 4 programs per SM


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                               last: torch.Tensor | int, dtype: torch.dtype = torch.float64,
                               rows: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_attention`` in PyTorch, computed in ``dtype`` (fp64: the exact reference) and returned in it;
    columns after ``last`` are hidden, rows with no visible key (and rows False in ``rows``) give zeros."""
    _check(q, k, v, key_mask, last, rows)
    n = 1 + (int(last) if not torch.is_tensor(last) else int(last.reshape(-1)[0]))
    s = k.shape[2]
    visible = key_mask.bool() & (torch.arange(s, device=k.device) < n)[None, :]  # [B, S]
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    scores = torch.einsum("bhgd,bhsd->bhgs", qd, kd) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-hidden rows: NaN -> 0
    out = torch.einsum("bhgs,bhsd->bhgd", p, vd)
    return out if rows is None else torch.where(rows[:, None, None, None], out, 0.0)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, last,
           rows: torch.Tensor | None = None) -> None:
    if rows is not None and (rows.shape != (q.shape[0],) or rows.dtype != torch.bool):
        raise ValueError(f"decode_attention: rows must be a bool [B] = [{q.shape[0]}], got {rows.dtype} "
                         f"{tuple(rows.shape)}")  # fmt: skip
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"decode_attention: q must be [B, nkv, g, D] and k, v [B, nkv, S, D] alike; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    b, h, _, d = q.shape
    if k.shape[:2] != (b, h) or k.shape[3] != d:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B, nkv or D")
    if key_mask.shape != (b, k.shape[2]):
        raise ValueError(f"decode_attention: key_mask must be [B, S] = {(b, k.shape[2])}, got {tuple(key_mask.shape)}")
    if torch.is_tensor(last) and (last.numel() != 1 or last.dtype.is_floating_point):
        raise ValueError(f"decode_attention: last must be one integer (a [1] tensor on the device), got "
                         f"{last.dtype} {tuple(last.shape)}")  # fmt: skip
    devices = {q.device, k.device, v.device, key_mask.device, *((last.device,) if torch.is_tensor(last) else ())}
    if len(devices) != 1:
        raise ValueError("decode_attention: q, k, v, key_mask and last must be on one device")


def splits_for(bh: int, s: int, block_s: int) -> int:
    """Splits of the key columns: a power of two while the programs are fewer than 4 per SM and each
    split keeps at least 4 blocks of ``block_s`` columns."""
    split = 1
    while bh * split < 4 * SMS and -(-s // block_s) >= 4 * (2 * split):
        split *= 2
    return split


if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out

    @triton.jit
    def _dot(a, b, acc, F32: tl.constexpr, INTERP: tl.constexpr):
        """acc += a @ b on the tensor cores (BF16 / FP16 operands: exact products, fp32 sums); fp32 operands
        and the interpreter (whose BF16 dot is wrong) multiply in IEEE fp32."""
        if F32 or INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, m_ptr, last_ptr, rows_ptr, ws_ptr, out_ptr, S, NKV, G, sm_scale,
        sqb, sqh, sqg, skb, skh, sks, svb, svh, svs, smb, sob, soh, sog,
        GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
        F32: tl.constexpr, PSCALE: tl.constexpr, INTERP: tl.constexpr, ROWS: tl.constexpr, FINISH: tl.constexpr,
    ):  # fmt: skip
        """Grid (B * nkv, SPLITS): the online softmax of the g queries of one key/value head (padded to GP
        rows of a tensor-core tile) over columns ``[split * CHUNK, min((split + 1) * CHUNK, last + 1, S))``;
        writes max ``m``, sum ``l`` and the weighted values ``acc`` (fp32, ``ws[bh, split] = [m (GP) | l (GP)
        | acc (GP x D)]``). ``q . k`` is one MMA per block (exact products, fp32 sums); the probabilities
        enter the ``p @ v`` MMA as two half-precision terms, ``p_hi + p_lo`` (16 significant bits), so
        that the value sum keeps nearly fp32's precision; FP16 terms are taken of ``p * PSCALE`` (2**15),
        which keeps small probabilities out of FP16's subnormals, and the sums scaled back exactly. With ROWS, a
        row whose ``rows`` byte is 0 reads no column: its partial softmax is empty, so the combine writes zeros.
        ``FINISH`` (one split): the combine's arithmetic on this one split done here, the output written, no
        workspace (the same operations, so the same bits as the two kernels)."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // NKV
        h = bh % NKV
        n = tl.load(last_ptr).to(tl.int32) + 1  # columns 0..last may hold keys
        if ROWS:
            n = tl.where(tl.load(rows_ptr + b) != 0, n, 0)  # a dead row: no column
        lo = split * CHUNK
        hi = tl.minimum(tl.minimum(lo + CHUNK, n), S)
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        q = tl.load(q_ptr + b * sqb + h * sqh + rg[:, None] * sqg + rd[None, :], mask=rg[:, None] < G, other=0.0)
        m = tl.full((GP,), float("-inf"), tl.float32)
        l = tl.zeros((GP,), tl.float32)  # noqa: E741
        acc = tl.zeros((GP, D), tl.float32)
        kb = k_ptr + b.to(tl.int64) * skb + h * skh
        vb = v_ptr + b.to(tl.int64) * svb + h * svh
        for s0 in range(lo, hi, BLOCK_S):
            rs = s0 + tl.arange(0, BLOCK_S)
            inside = rs < hi
            seen = tl.load(m_ptr + b * smb + rs, mask=inside, other=0) != 0
            kt = tl.load(kb + rs[:, None] * sks + rd[None, :], mask=inside[:, None], other=0.0)
            scores = _dot(q, tl.trans(kt), tl.zeros((GP, BLOCK_S), tl.float32), F32, INTERP) * sm_scale
            scores = tl.where(seen[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            live = m_new > float("-inf")  # a query that has seen a key (else its sums stay 0)
            alpha = tl.where(live, tl.exp(m - tl.where(live, m_new, 0.0)), 1.0)
            p = tl.where(live[:, None], tl.exp(scores - tl.where(live, m_new, 0.0)[:, None]), 0.0)
            vt = tl.load(vb + rs[:, None] * svs + rd[None, :], mask=inside[:, None], other=0.0)
            l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
            acc = acc * alpha[:, None]
            if F32:
                acc = _dot(p, vt, acc, F32, INTERP)
            else:
                ps = p * PSCALE  # FP16: out of its subnormal range (exact: a power of two)
                p_hi = ps.to(vt.dtype)
                acc = _dot(p_hi, vt, acc, F32, INTERP)
                acc = _dot((ps - p_hi.to(tl.float32)).to(vt.dtype), vt, acc, F32, INTERP)
            m = m_new
        if not F32:
            acc = acc * (1.0 / PSCALE)  # exact
        if FINISH:  # _combine_kernel over this one split: weight exp(m - m) = 1 (0 for a row that saw no key)
            live = m > float("-inf")
            c = tl.where(live, tl.exp(m - tl.where(live, m, 0.0)), 0.0)
            _finish(tl.zeros((GP, D), tl.float32) + c[:, None] * acc, tl.zeros((GP,), tl.float32) + c * l, live,
                    out_ptr, b, h, sob, soh, sog, rg, rd, G)  # fmt: skip
        else:
            w = ws_ptr + (bh.to(tl.int64) * SPLITS + split) * GP * (D + 2)
            tl.store(w + rg, m)
            tl.store(w + GP + rg, l)
            tl.store(w + 2 * GP + rg[:, None] * D + rd[None, :], acc)

    @triton.jit
    def _finish(acc, total, live, out_ptr, b, h, sob, soh, sog, rg, rd, G):
        """The merged sums ``acc`` of a head's queries divided once by their softmax sums ``total`` (a row that saw
        no key: zeros), cast (RNE), stored."""
        y = tl.where(live[:, None], tl.math.div_rn(acc, tl.where(live, total, 1.0)[:, None]), 0.0)
        tl.store(out_ptr + b * sob + h * soh + rg[:, None] * sog + rd[None, :], cast_out(y, out_ptr),
                 mask=rg[:, None] < G)  # fmt: skip

    @triton.jit
    def _combine_kernel(ws_ptr, out_ptr, NKV, G, sob, soh, sog, GP: tl.constexpr, D: tl.constexpr,
                        SPLITS: tl.constexpr):  # fmt: skip
        """Grid (B * nkv,): the splits' partial softmaxes merged in split order, divided once, cast (RNE)."""
        bh = tl.program_id(0)
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        base = ws_ptr + bh.to(tl.int64) * SPLITS * GP * (D + 2)
        m = tl.load(base + rg)
        for s in tl.static_range(1, SPLITS):
            m = tl.maximum(m, tl.load(base + s * GP * (D + 2) + rg))
        live = m > float("-inf")
        mm = tl.where(live, m, 0.0)
        l = tl.zeros((GP,), tl.float32)  # noqa: E741
        acc = tl.zeros((GP, D), tl.float32)
        for s in tl.static_range(SPLITS):
            w = base + s * GP * (D + 2)
            ms = tl.load(w + rg)
            c = tl.where(ms > float("-inf"), tl.exp(ms - mm), 0.0)
            l += c * tl.load(w + GP + rg)  # noqa: E741
            acc += c[:, None] * tl.load(w + 2 * GP + rg[:, None] * D + rd[None, :])
        _finish(acc, l, live, out_ptr, bh // NKV, bh % NKV, sob, soh, sog, rg, rd, G)


DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernel takes (fp64: the reference)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                     last: torch.Tensor, rows: torch.Tensor | None = None, *, block_s: int = 64,
                     splits: int | None = None, num_warps: int = 4, finish_one_split: bool = True) -> torch.Tensor:
    """Decode attention (module docstring): ``q`` ``[B, nkv, g, D]``, ``k``/``v`` ``[B, nkv, S, D]`` (the
    cache buffers), ``key_mask`` ``[B, S]`` (True: a key the query may see), ``last`` ``[1]`` integer on
    the device (the last column that may hold a key; the columns after it are not read), ``rows`` ``[B]`` bool
    or None (False: the row's output is zeros) -> ``[B, nkv, g, D]`` in ``q``'s dtype. ``splits`` None
    picks ``splits_for``; D must be a power of two (the built-in presets' 32 and 64). ``finish_one_split``
    (a launch option, the same bits either way): with one split, the split kernel also does the combine's
    arithmetic and writes the output (one launch, no workspace)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use decode_attention_reference")
    _check(q, k, v, key_mask, last, rows)
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, k and v must share one of {DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype} (fp64: decode_attention_reference)")  # fmt: skip
    if not torch.is_tensor(last):
        last = torch.tensor([int(last)], device=q.device)
    b, h, g, d = q.shape
    s = k.shape[2]
    if d & (d - 1) or d < 16 or block_s & (block_s - 1) or block_s < 16:
        raise ValueError(f"decode_attention: head dim ({d}) and block_s ({block_s}) must be powers of two >= 16")
    if k.stride(3) != 1 or v.stride(3) != 1 or q.stride(3) != 1:
        raise ValueError("decode_attention: q, k and v need a contiguous last (head) dim")
    mask = key_mask if key_mask.dtype != torch.bool else key_mask.view(torch.uint8)
    mask = mask.contiguous()
    gp = max(16, triton.next_power_of_2(g))  # the queries fill one tensor-core tile of >= 16 rows
    split = splits or splits_for(b * h, s, block_s)
    per_split = -(-s // split)
    chunk = -(-per_split // block_s) * block_s  # columns per split, a multiple of block_s
    split = -(-s // chunk)
    out = torch.empty_like(q)
    if q.numel() == 0:
        return out
    finish = split == 1 and finish_one_split
    ws = out if finish else torch.empty(b * h * split * gp * (d + 2), dtype=torch.float32, device=q.device)
    live = mask if rows is None else rows.contiguous().view(torch.uint8)  # any pointer when ROWS is off
    _split_kernel[(b * h, split)](
        q, k, v, mask, last, live, ws, out, s, h, g, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), out.stride(0), out.stride(1), out.stride(2),
        GP=gp, D=d, BLOCK_S=block_s, CHUNK=chunk, SPLITS=split, F32=q.dtype == torch.float32,
        PSCALE=32768.0 if q.dtype == torch.float16 else 1.0, INTERP=interpreted(q), ROWS=rows is not None,
        FINISH=finish, num_warps=num_warps, **EXACT,
    )  # fmt: skip
    if not finish:
        _combine_kernel[(b * h,)](ws, out, h, g, out.stride(0), out.stride(1), out.stride(2), GP=gp, D=d,
                                  SPLITS=split, num_warps=num_warps, **EXACT)  # fmt: skip
    return out


@torch.library.custom_op("quads::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                         last: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    return decode_attention(q, k, v, key_mask, last, rows)


@_decode_attention_op.register_fake
def _(q, k, v, key_mask, last, rows=None):
    return torch.empty_like(q)


def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                        last: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_attention`` as the custom op ``quads::decode_attention`` (opaque to ``torch.compile``)."""
    return torch.ops.quads.decode_attention(q, k, v, key_mask, last, rows)
