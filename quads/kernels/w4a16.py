"""W4A16 GEMMs over NVFP4 weights in a pre-shuffled packed layout (Triton), beside their references.

The rollout's weights are quantized once per weight sync, so they are stored in the order the GEMM's
inner loop reads them (``pack``, once per sync; ``unpack`` gives the canonical ``NVFP4Tensor`` back,
byte for byte). Layout of a weight ``[N, K]`` (an expert stack ``[E, N, K]`` has E of them), with K
padded to ``Kp``, a multiple of ``LAYOUT_K`` = 64 (zero codes and scales):

- ``codes`` int32 ``[(E,) Kp/64, N, 8]``: row n's 64 codes of K tile t are 8 words, element
  ``64 t + 8 j + i`` in word j: its 3 magnitude bits in bits ``4i..4i+2`` (the canonical nibble order
  read as little-endian words), its sign bit in bit ``8i+7`` for i < 4 and ``8(i-4)+3`` for i >= 4 (the
  nibbles' top bits, ``SIGN_BITS``: there ``w & 0x80808080`` and ``(w << 4) & 0x80808080`` are the sign
  masks of the bytes the decode looks up); the words of one K tile of consecutive rows are contiguous,
  so a ``[BLOCK_N, BLOCK_K]`` tile is ``BLOCK_K / 64`` contiguous runs of ``BLOCK_N * 32`` bytes (128-bit
  loads, 8 codes per word).
- ``scales`` int32 ``[(E,) Kp/64, N]``: the 4 E4M3 block scales of row n in K tile t, block j in byte j.
- ``global_scale`` fp32 ``[E]`` (``[1]`` for a single weight): the FP32 decode scale S_dec.

The weight the kernels multiply is ``bf16(fp32(e2m1 * s) * S_dec)``, the value of
``quads.formats.nvfp4.dequantize(q, torch.bfloat16)`` bit for bit: ``e2m1 * s`` is exact in fp32, the
product with S_dec is the reference's one fp32 rounding, and the cast to BF16 rounds to nearest even.
``_decode_pairs`` computes these once per 16-element block for the 8 E2M1 magnitudes and picks each
weight from that table with byte permutes (4 weights per ``prmt``; the sign by XOR). Products with the
BF16 activations are accumulated in fp32, on the tensor cores (``tl.dot``) or by fp32 FMAs (the GEMV
kernel); a product of two BF16 values is exact in fp32 (8 + 8 significant bits fit in 24, barring fp32
under- or overflow), so a GEMM equals ``x @ dequantize(q, bf16).T`` up to fp32 summation order; the
output is cast (RNE) to ``x.dtype``.

- ``gemm(x [M, K], w) -> [M, N]``: at most ``tuning.json`` ``w4a16_dispatch.dense.gemv_max_m`` rows
  the GEMV kernel (``_gemv_kernel``: each program owns ``BLOCK_N`` output features and a K range, the
  next two K tiles' words in flight, the decoded weights widened to fp32 in registers and multiplied
  with every row: no tensor cores and no shared-memory round trip of the decoded tile), above it the
  tiled kernel (``_gemm_kernel``: tiles of ``BLOCK_N`` output features, ``tl.dot``). Both split K at
  small M so that every SM streams weights; split partials go to an fp32 workspace and are summed in
  a fixed order by a second kernel (deterministic: the same call gives the same bits every time).
- ``grouped_gemm(x [T, K], w [E, N, K], ends [E] int32) -> [T, N]``: rows sorted by expert, rows
  ``ends[e-1]:ends[e]`` use expert e (``torch._grouped_mm``'s offsets, read on the device: no host sync,
  no data-dependent shape, so it can be captured in a CUDA graph); experts without rows read no
  weights; rows past ``ends[E-1]`` (masked slots) are written as zeros; split-K when few experts have
  rows (decided from the shapes only).
- Many rows (prefill; ``tuning.json`` ``w4a16_dispatch``): cuBLAS / ``torch._grouped_mm`` over the BF16
  weight decoded by the same decode (``dequantize_bf16``), where decoding once beats decoding per row
  tile.

Launch configs come from ``tuning.json`` (``w4a16_gemm``, ``w4a16_gemv``, ``w4a16_grouped_gemm``);
explicit arguments override them. ``dequantize``, ``gemm_reference`` and ``grouped_gemm_reference`` are the pure-PyTorch
twins the kernels are tested against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from quads.formats import nvfp4
from quads.formats.constants import NVFP4_BLOCK
from quads.kernels import tuning
from quads.kernels._common import HAS_TRITON, interpreted

LAYOUT_K = 64  # K elements per layout tile: 8 code words and 1 scale word per row
# the grouped GEMM takes the "decode" launch config at <= this many routed rows per expert (on average)
GROUPED_DECODE_ROWS = 16
SMS = 132  # H200 streaming multiprocessors, for the split-K heuristics (programs per SM)
# bit of a code word holding the sign of code i: canonical 4i+3, packed SIGN_BITS[i] (module docstring)
SIGN_BITS = (7, 15, 23, 31, 3, 11, 19, 27)
CANONICAL_SIGN_BITS = (3, 7, 11, 15, 19, 23, 27, 31)


@dataclass
class W4A16Weight:
    """An NVFP4 weight in the kernels' packed layout (module docstring)."""

    codes: torch.Tensor  # int32 [(E,) Kp/64, N, 8]
    scales: torch.Tensor  # int32 [(E,) Kp/64, N]
    global_scale: torch.Tensor  # float32 [E] or [1]
    n: int  # output features
    k: int  # input features (before padding)
    experts: int | None  # E for an expert stack, None for one weight
    dtype: torch.dtype = torch.bfloat16  # the NVFP4Tensor's metadata, kept for unpack
    tile: tuple[int, int] = (1, 16)
    mode: str = "te"

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scales, self.global_scale

    def as_stack(self) -> W4A16Weight:
        """A single weight as a one-expert stack (views of the same tensors: the layout per expert is the
        single weight's), for the grouped kernels with ``ends = [M]``; a stack is returned as it is."""
        if self.experts is not None:
            return self
        return dataclasses.replace(self, codes=self.codes.unsqueeze(0), scales=self.scales.unsqueeze(0), experts=1)

    def copy_(self, other: W4A16Weight) -> bool:
        """Copy ``other`` into these tensors in place (a captured CUDA graph keeps reading them);
        False (nothing copied) when the layouts differ."""
        if (other.n, other.k, other.experts) != (self.n, self.k, self.experts) or any(
            a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
            for a, b in zip(self.tensors(), other.tensors())
        ):
            return False
        for a, b in zip(self.tensors(), other.tensors()):
            a.copy_(b)
        return True


def _move_signs(words: torch.Tensor, src: tuple[int, ...], dst: tuple[int, ...]) -> torch.Tensor:
    """int32 code words with the sign of code i moved from bit ``src[i]`` to bit ``dst[i]`` (magnitudes,
    bits 4i..4i+2, stay)."""
    out = words & 0x77777777
    for a, b in zip(src, dst):  # the bit's value as a Python int32 scalar: no host-to-device copy per bit
        out = out | (((words >> a) & 1) * (-(1 << 31) if b == 31 else 1 << b))
    return out


def _padded_k(k: int) -> int:
    return -(-k // LAYOUT_K) * LAYOUT_K


def pack(q: nvfp4.NVFP4Tensor) -> W4A16Weight:
    """The packed layout of an NVFP4 weight ``[N, K]`` (one global scale) or expert stack ``[E, N, K]``
    (one global scale per expert) with linear ``[.., N, K/16]`` scales."""
    codes, scales = q.codes, q.scales
    if codes.dim() not in (2, 3) or codes.dtype != torch.uint8:
        raise ValueError(f"w4a16.pack: expects packed uint8 codes [N, K/2] or [E, N, K/2], got "
                         f"{codes.dtype} {tuple(codes.shape)}")  # fmt: skip
    k = codes.shape[-1] * 2
    if tuple(scales.shape) != (*codes.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(f"w4a16.pack: needs linear scales {(*codes.shape[:-1], k // NVFP4_BLOCK)}, got "
                         f"{tuple(scales.shape)}; unswizzle them first (nvfp4.unswizzle_scales)")  # fmt: skip
    experts = codes.shape[0] if codes.dim() == 3 else None
    ng = 1 if experts is None else experts
    if q.global_scale.numel() != ng:
        raise ValueError(f"w4a16.pack: needs one global scale per weight ({ng}), got shape "
                         f"{tuple(q.global_scale.shape)}; per-token scales are for activations")  # fmt: skip
    g = q.global_scale.float().reshape(ng).contiguous()
    n, kp = codes.shape[-2], _padded_k(k)
    c = codes.contiguous()
    s = scales.view(torch.uint8).contiguous()
    if kp != k:
        c = torch.nn.functional.pad(c, (0, (kp - k) // 2))
        s = torch.nn.functional.pad(s, (0, (kp - k) // NVFP4_BLOCK))
    lead = c.shape[:-2]
    cw = c.view(torch.int32).reshape(*lead, n, kp // LAYOUT_K, 8).transpose(-3, -2)
    cw = _move_signs(cw, CANONICAL_SIGN_BITS, SIGN_BITS).contiguous()
    sw = s.view(torch.int32).reshape(*lead, n, kp // LAYOUT_K).transpose(-2, -1).contiguous()
    return W4A16Weight(codes=cw, scales=sw, global_scale=g, n=n, k=k, experts=experts, dtype=q.dtype,
                       tile=tuple(q.tile), mode=q.mode)  # fmt: skip


def unpack(w: W4A16Weight) -> nvfp4.NVFP4Tensor:
    """The canonical ``NVFP4Tensor`` of a packed weight (byte for byte what ``pack`` was given; global
    scale ``[]`` for one weight, ``[E, 1, 1]`` for a stack)."""
    lead = w.codes.shape[:-3]
    words = _move_signs(w.codes, SIGN_BITS, CANONICAL_SIGN_BITS)
    codes = words.transpose(-3, -2).contiguous().view(torch.uint8).reshape(*lead, w.n, -1)[..., : w.k // 2]
    # flattened before the view: with one K tile, [.., N, 1] is "contiguous" with a last stride of N
    scales = w.scales.transpose(-2, -1).flatten(-2).contiguous().view(torch.uint8).reshape(*lead, w.n, -1)
    scales = scales[..., : w.k // NVFP4_BLOCK].contiguous().view(torch.float8_e4m3fn)
    g = w.global_scale.reshape(()) if w.experts is None else w.global_scale.reshape(-1, 1, 1)
    shape = torch.Size((*lead, w.n, w.k))
    return nvfp4.NVFP4Tensor(codes=codes.contiguous(), scales=scales, global_scale=g.clone(), shape=shape,
                             dtype=w.dtype, tile=w.tile, mode=w.mode)  # fmt: skip


def dequantize(w: W4A16Weight) -> torch.Tensor:
    """The BF16 weight ``[(E,) N, K]`` the kernels multiply, decoded from the packed layout in PyTorch:
    ``bf16(fp32(e2m1 * s) * S_dec)``, equal to ``nvfp4.dequantize(unpack(w), torch.bfloat16)``."""
    lead = w.codes.shape[:-3]
    kt = w.codes.shape[-3]
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int32)
    words = _move_signs(w.codes, SIGN_BITS, CANONICAL_SIGN_BITS)
    c = (words[..., None] >> shifts) & 0xF  # [.., Kp/64, N, 8, 8]: word j, nibble i -> 64 t + 8 j + i
    vals = nvfp4.e2m1_values(c.to(torch.uint8))
    sb = (w.scales[..., None] >> torch.arange(0, 32, 8, device=w.device, dtype=torch.int32)) & 0xFF
    s = sb.to(torch.uint8).view(torch.float8_e4m3fn).float()  # [.., Kp/64, N, 4]
    blk = vals.reshape(*lead, kt, w.n, 4, NVFP4_BLOCK) * s[..., None]  # exact
    g = w.global_scale.reshape(-1, 1, 1, 1, 1) if w.experts is not None else w.global_scale.reshape(1, 1, 1, 1)
    out = (blk * g).to(torch.bfloat16)  # the reference's one fp32 rounding, then RNE to BF16
    out = out.reshape(*lead, kt, w.n, LAYOUT_K).movedim(-3, -2).reshape(*lead, w.n, kt * LAYOUT_K)
    return out[..., : w.k].contiguous()


def gemm_reference(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """``x @ dequantize(w).T`` with fp32 accumulation, in ``x.dtype`` (what ``gemm`` computes)."""
    return (x.float() @ dequantize(w).float().T).to(x.dtype)


def grouped_gemm_reference(x: torch.Tensor, w: W4A16Weight, ends: torch.Tensor,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per expert ``x_e @ We_e.T`` (fp32 accumulation) over the sorted rows (``rows``: ``x[rows]``), zeros past
    ``ends[-1]``."""
    if rows is not None:
        x = x[rows]
    out = torch.zeros(x.shape[0], w.n, dtype=x.dtype, device=x.device)
    we = dequantize(w).float()
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = (x[start:end].float() @ we[e].T).to(x.dtype)
        start = max(start, end)
    return out


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels take activations ``x`` (BF16; the reference path covers everything else)."""
    return x.dtype == torch.bfloat16


if HAS_TRITON:
    import triton
    import triton.language as tl

    from quads.kernels._common import cast_out, e4m3_to_f32_hw, f32_to_bf16_rne

    @triton.jit
    def _dot(a, b, acc, INTERP: tl.constexpr):
        """acc += a @ b of BF16 operands; the interpreter (whose BF16 dot is wrong) multiplies the same
        values as fp32 in IEEE precision."""
        if INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _prmt(a, b, sel, INTERP: tl.constexpr):
        """PTX ``prmt.b32`` (generic mode) on int32 tensors: byte j of the result is byte ``sel[4j+2:4j]``
        of the 8 bytes ``{b, a}`` (a = bytes 0-3, b = bytes 4-7), or that byte's msb copied to all 8 bits
        when ``sel`` bit 4j+3 is set; bits 16-31 of ``sel`` are not read. One instruction on the GPU, by
        shifts under the interpreter."""
        sel = sel + tl.zeros_like(a)
        if INTERP:
            v = (b.to(tl.int64) << 32) | (a.to(tl.int64) & 0xFFFFFFFF)
            out = tl.zeros_like(v)
            for j in tl.static_range(4):
                nib = ((sel >> (4 * j)) & 0xF).to(tl.int64)
                byte = (v >> ((nib & 7) * 8)) & 0xFF
                rep = tl.where((byte & 0x80) != 0, 0xFF, 0).to(tl.int64)
                out = out | (tl.where((nib & 8) != 0, rep, byte) << (8 * j))
            return out.to(tl.int32)
        else:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                             dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip

    @triton.jit
    def _bf16x2(lo, hi, INTERP: tl.constexpr):
        """fp32 ``lo``, ``hi`` -> int32 holding bf16(lo) in bits 0-15 and bf16(hi) in bits 16-31 (RNE)."""
        if INTERP:
            lb = f32_to_bf16_rne(lo).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            hb = f32_to_bf16_rne(hi).to(tl.int16, bitcast=True).to(tl.int32)
            return lb | (hb << 16)
        else:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                             is_pure=True, pack=1)  # fmt: skip

    @triton.jit
    def _bf16_halves(p):
        """int32 ``p`` (two bf16 by bits) -> (bf16 of bits 0-15, bf16 of bits 16-31)."""
        return p.to(tl.int16).to(tl.bfloat16, bitcast=True), (p >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _load_tile(c_ptr, s_ptr, rn, k0, N, KT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr):  # fmt: skip
        """The packed words of rows ``rn`` x columns [k0, k0 + BLOCK_K) (``k0`` a multiple of 64; ``KT`` =
        Kp / 64 layout tiles): code words int32 [BLOCK_N, BLOCK_K / 64, 4 (block), 2 (word)] and scale
        words int32 [BLOCK_N, BLOCK_K / 64] (zeros past the last layout tile)."""
        NW: tl.constexpr = BLOCK_K // 8  # code words per row
        NS: tl.constexpr = BLOCK_K // 64  # scale words per row
        nmask = rn < N
        j = tl.arange(0, NW)
        t = k0 // 64 + j // 8
        cmask = nmask[:, None]
        if not EVEN_K:
            cmask = cmask & (t < KT)[None, :]
        words = tl.load(c_ptr + t[None, :] * (N * 8) + rn[:, None] * 8 + (j % 8)[None, :], mask=cmask, other=0)
        ts = k0 // 64 + tl.arange(0, NS)
        smask = nmask[:, None]
        if not EVEN_K:
            smask = smask & (ts < KT)[None, :]
        sw = tl.load(s_ptr + ts[None, :] * N + rn[:, None], mask=smask, other=0)
        return tl.reshape(words, (BLOCK_N, NS, 4, 2)), sw

    @triton.jit
    def _decode_pairs(w, sw, g, INTERP: tl.constexpr):
        """Code words ``w`` [.., BLOCK_N, NS, 4, 2] and scale words ``sw`` [.., BLOCK_N, NS] (``_load_tile``) ->
        the weights ``bf16(fp32(e2m1 * s) * g)`` as 4 int32 tensors of ``w``'s shape holding bf16 pairs:
        codes (0, 1), (2, 3), (4, 5), (6, 7) of each word (the first of a pair in bits 0-15).

        By table lookup: the 8 magnitudes of a 16-element block, ``bf16(fp32(e2m1 * s) * g)`` for the E2M1
        values 0, 0.5, .., 6, are computed once per block the reference's way (exact products, one fp32
        rounding, RNE to BF16) and held as two 8-byte tables (low bytes, high bytes); each weight is then
        picked by its 3 magnitude bits with byte permutes (``prmt``: 4 weights per lookup) and its sign
        bit XORed into bit 15 (negation commutes with both roundings, and IEEE products take the XOR of
        the signs: -0.0 and NaN blocks come out as in the reference). About 1.6 integer instructions per
        weight plus 1.5 per weight for the tables (sm_90 SASS: scripts/sass_w4a16.py)."""
        # [.., BLOCK_N, NS, 4] scales: block j of tile t in byte j
        s = e4m3_to_f32_hw((tl.expand_dims(sw, -1) >> (8 * tl.arange(0, 4))) & 0xFF, INTERP)
        # the block's magnitudes as bf16 pairs (code 2i in the low half, 2i + 1 in the high half): the
        # products with the E2M1 values are exact, times g the reference's one fp32 rounding
        p01 = _bf16x2((s * 0.0) * g, (s * 0.5) * g, INTERP)
        p23 = _bf16x2(s * g, (s * 1.5) * g, INTERP)
        p45 = _bf16x2((s * 2.0) * g, (s * 3.0) * g, INTERP)
        p67 = _bf16x2((s * 4.0) * g, (s * 6.0) * g, INTERP)
        # byte tables: byte c of (lo0, lo1) is the low byte of magnitude c, of (hi0, hi1) its high byte;
        # one per word of the block
        lo0 = tl.expand_dims(_prmt(p01, p23, 0x6420, INTERP), -1)
        lo1 = tl.expand_dims(_prmt(p45, p67, 0x6420, INTERP), -1)
        hi0 = tl.expand_dims(_prmt(p01, p23, 0x7531, INTERP), -1)
        hi1 = tl.expand_dims(_prmt(p45, p67, 0x7531, INTERP), -1)
        mag = w & 0x77777777  # selectors: magnitudes of codes 0-3 in bits 0-15, of codes 4-7 in 16-31
        mag_hi = mag >> 16
        # the signs (SIGN_BITS): bit 8q + 7 of w is the sign of code q, of w << 4 that of code 4 + q
        lo_a = _prmt(lo0, lo1, mag, INTERP)  # low bytes of codes 0-3
        hi_a = _prmt(hi0, hi1, mag, INTERP) ^ (w & -0x7F7F7F80)  # high bytes, signed (mask 0x80808080)
        lo_b = _prmt(lo0, lo1, mag_hi, INTERP)
        hi_b = _prmt(hi0, hi1, mag_hi, INTERP) ^ ((w << 4) & -0x7F7F7F80)
        # interleave into bf16 pairs (codes 0 1, 2 3, 4 5, 6 7)
        return (_prmt(lo_a, hi_a, 0x5140, INTERP), _prmt(lo_a, hi_a, 0x7362, INTERP),
                _prmt(lo_b, hi_b, 0x5140, INTERP), _prmt(lo_b, hi_b, 0x7362, INTERP))  # fmt: skip

    @triton.jit
    def _decode(c_ptr, s_ptr, g, rn, k0, N, K, KT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
        """Rows ``rn`` x columns [k0, k0 + BLOCK_K) of the weight -> BF16 [BLOCK_N, BLOCK_K] =
        bf16(fp32(e2m1 * s) * g) (``_load_tile``, ``_decode_pairs``). ``KT`` = Kp / 64 layout tiles; ``k0``
        a multiple of 64."""
        w, sw = _load_tile(c_ptr, s_ptr, rn, k0, N, KT, BLOCK_N, BLOCK_K, EVEN_K)
        return _decode_words(w, sw, g, k0, K, BLOCK_N, BLOCK_K, EVEN_K, INTERP)

    @triton.jit
    def _decode_words(w, sw, g, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      INTERP: tl.constexpr):  # fmt: skip
        """``_decode`` of loaded words (``_load_tile``): BF16 [BLOCK_N, BLOCK_K], zeros from column K on."""
        p01, p23, p45, p67 = _decode_pairs(w, sw, g, INTERP)
        # the nested joins put code i of word q of block j of tile t at position 64 t + 16 j + 8 q + i
        c0, c1 = _bf16_halves(p01)
        c2, c3 = _bf16_halves(p23)
        c4, c5 = _bf16_halves(p45)
        c6, c7 = _bf16_halves(p67)
        v = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
        v = tl.reshape(v, (BLOCK_N, BLOCK_K))
        if not EVEN_K:
            v = tl.where((k0 + tl.arange(0, BLOCK_K) < K)[None, :], v, 0.0)
        return v

    @triton.jit
    def _k_tile(acc, x_ptr, rm, xr, row_end, stride_xm, c_ptr, s_ptr, g, rn, k0, N, K, KT, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
        """``acc`` + the product rows ``rm`` (those below ``row_end``), read from rows ``xr`` of ``x`` (``rm``
        itself, or gathered), x the weight's rows ``rn``, over columns [k0, k0 + BLOCK_K): the tile decoded
        (``_decode``) and multiplied on the tensor cores ``SUB_K`` columns at a time, in K order (a smaller
        decoded tile holds fewer registers)."""
        for sub in tl.static_range(BLOCK_K // SUB_K):
            ks = k0 + sub * SUB_K
            rk = ks + tl.arange(0, SUB_K)
            xm = rm[:, None] < row_end
            if not EVEN_K:
                xm = xm & (rk[None, :] < K)
            x = tl.load(x_ptr + xr[:, None] * stride_xm + rk[None, :], mask=xm, other=0.0)
            w = _decode(c_ptr, s_ptr, g, rn, ks, N, K, KT, BLOCK_N, SUB_K, EVEN_K, INTERP)
            acc = _dot(x.to(tl.bfloat16), tl.trans(w), acc, INTERP)
        return acc

    @triton.jit
    def _gemm_kernel(
        x_ptr, c_ptr, s_ptr, g_ptr, out_ptr, ws_ptr, M, N, K, KT, stride_xm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr, INTERP: tl.constexpr, SUB_K: tl.constexpr,
    ):  # fmt: skip
        """Grid (N tiles, M tiles, SPLIT_K): split s runs a contiguous range of the K tiles (``_k_tile``)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        g = tl.load(g_ptr)
        n_tiles = tl.cdiv(K, BLOCK_K)
        per = tl.cdiv(n_tiles, SPLIT_K)
        lo = pid_k * per
        hi = tl.minimum(lo + per, n_tiles)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kt in range(lo, hi):
            acc = _k_tile(acc, x_ptr, rm, rm, M, stride_xm, c_ptr, s_ptr, g, rn, kt * BLOCK_K, N, K, KT, BLOCK_N,
                          BLOCK_K, SUB_K, EVEN_K, INTERP)  # fmt: skip
        om = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(acc, out_ptr), mask=om)
        else:
            tl.store(ws_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=om)

    @triton.jit
    def _bf16_pair_f32(p):
        """int32 ``p`` (two bf16 by bits) -> (fp32 of bits 0-15, fp32 of bits 16-31), exact (by bits)."""
        return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _gemv_kernel(
        x_ptr, c_ptr, s_ptr, g_ptr, out_ptr, ws_ptr, M, N, K, KT, stride_xm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr, INTERP: tl.constexpr,
    ):  # fmt: skip
        """Grid (N tiles, SPLIT_K, M tiles): ``BLOCK_M`` rows of ``x`` against ``BLOCK_N`` output features
        over a contiguous range of the K tiles, by fp32 FMAs (no tensor cores, no shared-memory round trip
        of the decoded tile). The next two K tiles' code and scale words are loaded while one is decoded
        (``_load_tile``, ``_decode_pairs``); the weights stay in the code words' order (code i of word q of
        block j of layout tile t, column ``64 t + 16 j + 8 q + i``), widened to fp32 by bits, and the
        activations are split into the same order (8 columns per word: two 8-byte loads per word and row).
        Each (row, weight row, code word) has an fp32 accumulator that takes its 8 products in code order,
        tile after tile; they are summed once at the end (a fixed order: the same call gives the same bits
        every time)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        NS: tl.constexpr = BLOCK_K // 64
        g = tl.load(g_ptr)
        n_tiles = tl.cdiv(K, BLOCK_K)
        per = tl.cdiv(n_tiles, SPLIT_K)
        lo = pid_k * per
        hi = tl.minimum(lo + per, n_tiles)
        # the activations as int64 words of 4 bf16 (codes 0-3 and 4-7 of a code word: 2 per word), in the
        # code words' order [BLOCK_M, NS, 4 (block), 2 (word), 2]; the launcher aligns x to 16 bytes
        kx = tl.reshape(tl.arange(0, BLOCK_K // 4), (1, NS, 4, 2, 2))
        xrow = x_ptr.to(tl.pointer_type(tl.int64)) + rm[:, None, None, None, None] * (stride_xm // 4)
        w, sw = _load_tile(c_ptr, s_ptr, rn, tl.minimum(lo, n_tiles - 1) * BLOCK_K, N, KT, BLOCK_N, BLOCK_K,
                           EVEN_K)  # fmt: skip
        # the words with a leading unit dim (a reshape, not expand_dims, keeps their register layout), and
        # zeros computed from them (K >> 31 is 0) for the accumulators: the products take the words'
        # layout, so that the compiler moves the activations, not the decoded weights, between threads
        w = tl.reshape(w, (1, BLOCK_N, NS, 4, 2))
        sw = tl.reshape(sw, (1, BLOCK_N, NS))
        acc = tl.broadcast_to((w & (K >> 31)).to(tl.float32), (BLOCK_M, BLOCK_N, NS, 4, 2))
        wa, swa = _load_tile(c_ptr, s_ptr, rn, tl.minimum(lo + 1, hi - 1) * BLOCK_K, N, KT, BLOCK_N, BLOCK_K,
                             EVEN_K)  # fmt: skip
        wa = tl.reshape(wa, (1, BLOCK_N, NS, 4, 2))
        swa = tl.reshape(swa, (1, BLOCK_N, NS))
        for kt in range(lo, hi):
            k0 = kt * BLOCK_K
            # the words of the next two K tiles are in flight while this one is decoded (the last tiles
            # reload the split's last one, from the cache)
            wb, swb = _load_tile(c_ptr, s_ptr, rn, tl.minimum(kt + 2, hi - 1) * BLOCK_K, N, KT, BLOCK_N, BLOCK_K,
                                 EVEN_K)  # fmt: skip
            wb = tl.reshape(wb, (1, BLOCK_N, NS, 4, 2))
            swb = tl.reshape(swb, (1, BLOCK_N, NS))
            p01, p23, p45, p67 = _decode_pairs(w, sw, g, INTERP)
            w0, w1 = _bf16_pair_f32(p01)
            w2, w3 = _bf16_pair_f32(p23)
            w4, w5 = _bf16_pair_f32(p45)
            w6, w7 = _bf16_pair_f32(p67)
            xm = rm[:, None, None, None, None] < M
            if not EVEN_K:
                xm = xm & (k0 + 4 * kx < K)
            x03, x47 = tl.split(tl.load(xrow + k0 // 4 + kx, mask=xm, other=0))  # [BLOCK_M, NS, 4, 2] int64
            # x{i}: column i of each code word, in fp32 (by bits)
            x0, x1 = _bf16_pair_f32(x03.to(tl.int32))  # truncation: the low word
            x2, x3 = _bf16_pair_f32((x03 >> 32).to(tl.int32))
            x4, x5 = _bf16_pair_f32(x47.to(tl.int32))
            x6, x7 = _bf16_pair_f32((x47 >> 32).to(tl.int32))
            acc += tl.reshape(x0, (BLOCK_M, 1, NS, 4, 2)) * w0
            acc += tl.reshape(x1, (BLOCK_M, 1, NS, 4, 2)) * w1
            acc += tl.reshape(x2, (BLOCK_M, 1, NS, 4, 2)) * w2
            acc += tl.reshape(x3, (BLOCK_M, 1, NS, 4, 2)) * w3
            acc += tl.reshape(x4, (BLOCK_M, 1, NS, 4, 2)) * w4
            acc += tl.reshape(x5, (BLOCK_M, 1, NS, 4, 2)) * w5
            acc += tl.reshape(x6, (BLOCK_M, 1, NS, 4, 2)) * w6
            acc += tl.reshape(x7, (BLOCK_M, 1, NS, 4, 2)) * w7
            w, sw, wa, swa = wa, swa, wb, swb
        y = tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2)
        om = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], cast_out(y, out_ptr), mask=om)
        else:
            tl.store(ws_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], y, mask=om)

    @triton.jit
    def _split_sum_kernel(ws_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """out = sum over s = 0..SPLIT_K-1 of ws[s] (this order), cast to out's dtype."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < MN
        acc = tl.load(ws_ptr + i, mask=m, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(ws_ptr + s * MN + i, mask=m, other=0.0)
        tl.store(out_ptr + i, cast_out(acc, out_ptr), mask=m)

    @triton.jit
    def _scaled_rows(y, scale_ptr, rm, rmask, out_ptr, SCALE: tl.constexpr):
        """The output tile ``y`` (fp32) in the output type; ``SCALE``: times ``scale[rm]`` (output type) as eager
        PyTorch multiplies two tensors of that type (the product of the rounded values, rounded)."""
        y = cast_out(y, out_ptr)
        if SCALE:
            sc = tl.load(scale_ptr + rm, mask=rmask, other=0.0).to(tl.float32)
            y = cast_out(y.to(tl.float32) * sc[:, None], out_ptr)
        return y

    @triton.jit
    def _grouped_kernel(
        x_ptr, rows_ptr, c_ptr, s_ptr, g_ptr, ends_ptr, out_ptr, ws_ptr, scale_ptr, T, N, K, KT, E, stride_xm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr, INTERP: tl.constexpr, SUB_K: tl.constexpr, GATHER: tl.constexpr, SCALE: tl.constexpr,
    ):  # fmt: skip
        """Grid (N tiles, E + 1, SPLIT_K): program e < E runs the rows of expert e (split s: a contiguous
        range of the K tiles, into ``ws[s]``, ``_k_tile``), program E writes zeros to the rows past ``ends[E-1]``.
        ``GATHER``: product row m reads row ``rows[m]`` of ``x`` (else row m). ``SCALE`` (``SPLIT_K`` 1): output row
        m times ``scale[m]`` (``_scaled_rows``)."""
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        if SPLIT_K == 1:
            dst = out_ptr
        else:
            dst = ws_ptr + pid_k.to(tl.int64) * T * N
        if e == E:
            for m0 in range(start, T, BLOCK_M):
                rm = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
                z = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                om = (rm[:, None] < T) & (rn[None, :] < N)
                if SCALE:  # zeros times the scale, as the product of eager PyTorch
                    tl.store(out_ptr + rm[:, None] * N + rn[None, :], _scaled_rows(z, scale_ptr, rm, rm < T, out_ptr,
                                                                                   SCALE), mask=om)  # fmt: skip
                else:
                    tl.store(dst + rm[:, None] * N + rn[None, :], z.to(dst.dtype.element_ty), mask=om)
        else:
            end = tl.load(ends_ptr + e)
            ce = c_ptr + e.to(tl.int64) * KT * N * 8
            se = s_ptr + e.to(tl.int64) * KT * N
            g = tl.load(g_ptr + e)
            n_tiles = tl.cdiv(K, BLOCK_K)
            per = tl.cdiv(n_tiles, SPLIT_K)
            lo = pid_k * per
            hi = tl.minimum(lo + per, n_tiles)
            for m0 in range(start, end, BLOCK_M):  # experts without rows read no weights
                rm = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
                if GATHER:
                    xr = tl.load(rows_ptr + rm, mask=rm < end, other=0).to(tl.int64)
                else:
                    xr = rm
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for kt in range(lo, hi):
                    acc = _k_tile(acc, x_ptr, rm, xr, end, stride_xm, ce, se, g, rn, kt * BLOCK_K, N, K, KT, BLOCK_N,
                                  BLOCK_K, SUB_K, EVEN_K, INTERP)  # fmt: skip
                om = (rm[:, None] < end) & (rn[None, :] < N)
                if SPLIT_K == 1:
                    tl.store(out_ptr + rm[:, None] * N + rn[None, :],
                             _scaled_rows(acc, scale_ptr, rm, rm < end, out_ptr, SCALE), mask=om)
                else:
                    tl.store(dst + rm[:, None] * N + rn[None, :], acc, mask=om)


    @triton.jit
    def _dequantize_kernel(c_ptr, s_ptr, g_ptr, out_ptr, N, K, KT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
        """Grid (N tiles, K tiles, E): the BF16 weight [E?, N, K] the GEMMs multiply (``_decode``)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = pid_k * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        w = _decode(c_ptr + e * KT * N * 8, s_ptr + e * KT * N, tl.load(g_ptr + e), rn, k0, N, K, KT, BLOCK_N,
                    BLOCK_K, EVEN_K, INTERP)  # fmt: skip
        om = (rn[:, None] < N) & (rk[None, :] < K)
        tl.store(out_ptr + e * N * K + rn[:, None].to(tl.int64) * K + rk[None, :], w, mask=om)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use w4a16.gemm_reference / grouped_gemm_reference "
                           "(or kernel backend 'reference')")  # fmt: skip


def _check_x(x: torch.Tensor, w: W4A16Weight, what: str, experts: bool) -> None:
    if (w.experts is not None) != experts:
        raise ValueError(f"{what}: needs {'an expert stack [E, N, K]' if experts else 'one weight [N, K]'}, "
                         f"got a packed weight with experts={w.experts}")  # fmt: skip
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"{what}: activations must be [rows, K={w.k}], got {tuple(x.shape)}")
    if not supports(x):
        raise ValueError(f"{what}: activations must be bfloat16, got {x.dtype}; use the reference")
    if x.device != w.device:
        raise ValueError(f"{what}: activations on {x.device}, weight on {w.device}")


def _cfg(kernel: str, case: str, **explicit) -> dict:
    """The launch config of ``kernel`` for ``case`` in tuning.json, with explicit values on top."""
    cfg = tuning.config(kernel, case, **explicit)
    if cfg["block_k"] % LAYOUT_K:
        raise ValueError(f"{kernel}: block_k must be a multiple of {LAYOUT_K}, got {cfg['block_k']}")
    return cfg


def grouped_case(t: int, e: int, n: int, k: int) -> str:
    """The ``w4a16_grouped_gemm`` tuning case of ``t`` rows over ``e`` experts of ``[n, k]`` weights: decode (at
    most ``GROUPED_DECODE_ROWS`` rows per expert on average) or prefill, as ``n{n}_k{k}_<case>`` where the
    table has that shape."""
    case = "decode" if t <= GROUPED_DECODE_ROWS * e else "prefill"
    return tuning.case("w4a16_grouped_gemm", f"n{n}_k{k}", case)


def m_bucket(m: int) -> str:
    """The ``w4a16_gemm`` tuning case of ``m`` rows: m1, m4, m16, m32, m64 (the smallest not below m) or
    large."""
    for b in (1, 4, 16, 32, 64):
        if m <= b:
            return f"m{b}"
    return "large"


def split_for(m: int, n: int, k: int, block_n: int, block_k: int) -> int:
    """A split-K for ``m`` rows: powers of two while fewer programs than SMs and each split keeps
    at least 4 K tiles."""
    if m > 64:
        return 1
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < SMS and -(-k // block_k) // (split * 2) >= 4:
        split *= 2
    return split


def gemv_split_for(n: int, k: int, block_n: int, block_k: int) -> int:
    """A split-K for the GEMV kernel: the largest power of two that keeps its programs at most 4 per SM
    (about what fits at once at its default config: one wave, enough warps streaming weights to cover
    the memory latency) and at least 8 K tiles per split."""
    tiles = -(-n // block_n)
    split = 1
    while tiles * split * 2 <= 4 * SMS and -(-k // block_k) // (split * 2) >= 8:
        split *= 2
    return split


GEMM_KERNELS = ("gemv", "tiled", "cuda")


def gemm(
    x: torch.Tensor,
    w: W4A16Weight,
    *,
    kernel: str | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fused_max_m: int | None = None,
    sub_k: int | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` BF16 x packed weight ``[N, K]`` -> ``[M, N]`` BF16 (module docstring).

    ``kernel`` None dispatches on M (``tuning.json`` ``w4a16_dispatch.n{N}_k{K}_dense`` where the table has the
    weight's shape, else ``w4a16_dispatch.dense``): at most ``cuda_max_m`` rows the CUDA grouped decode kernel on
    the weight as a one-expert stack (``w4a16_cuda``, launch config ``w4a16_grouped_cuda.n{N}_k{K}_dense`` or
    ``w4a16_grouped_cuda.dense``; where it takes the operands, else the next choice), then at most
    ``gemv_max_m`` rows the GEMV kernel (``_gemv_kernel``: fp32 FMAs, no tensor cores; launch config
    ``w4a16_gemv.small``), then up to ``fused_max_m`` rows the tiled kernel (``_gemm_kernel``:
    ``tl.dot``), above it cuBLAS over the BF16 weight decoded by ``dequantize_bf16`` (many rows: compute
    bound, where decoding each weight tile once per row tile costs more than one decode pass).
    ``kernel`` "gemv", "tiled" or "cuda" runs that kernel at any M (the benchmark's side-by-side timing;
    "cuda" where it cannot run is an error).
    Launch config of the tiled kernel: ``w4a16_gemm.n{N}_k{K}_{bucket}`` if present, else
    ``w4a16_gemm.{bucket}`` (``m_bucket``); explicit arguments override either table; ``sub_k`` (null:
    ``block_k``) decodes and multiplies each K tile that many columns at a time (``_k_tile``). ``split_k`` None
    or 0 (in the call or the table) picks one with ``split_for`` (tiled) or ``gemv_split_for`` (GEMV).

    Both kernels multiply the same BF16 weights (``dequantize``, bit for bit) with the BF16 activations:
    each product of two BF16 values is exact in fp32 (8 + 8 significant bits fit in 24; barring fp32
    under- or overflow), so the kernels differ from ``gemm_reference`` and from each other only in the
    order of the fp32 sums; the output is rounded once (RNE) to BF16."""
    _require_triton()
    _check_x(x, w, "w4a16.gemm", experts=False)
    if kernel not in (None, *GEMM_KERNELS):
        raise ValueError(f"w4a16.gemm: kernel must be None (dispatch on M) or one of {GEMM_KERNELS}, got {kernel!r}")
    x = x.contiguous()
    m, k, n = x.shape[0], w.k, w.n
    dispatch = tuning.config("w4a16_dispatch", tuning.case("w4a16_dispatch", f"n{n}_k{k}", "dense"))
    cuda_case = tuning.case("w4a16_grouped_cuda", f"n{n}_k{k}", "dense")
    if kernel is None:
        if m > (fused_max_m if fused_max_m is not None else dispatch["fused_max_m"]):
            return x @ dequantize_bf16(w).T
        if m <= dispatch["cuda_max_m"]:
            y = _cuda_gemm(x, w.as_stack(), torch.full((1,), m, dtype=torch.int32, device=x.device), cuda_case)
            if y is not None:
                return y
        kernel = "gemv" if m <= dispatch["gemv_max_m"] else "tiled"
    if kernel == "cuda":
        return _cuda_gemm(x, w.as_stack(), torch.full((1,), m, dtype=torch.int32, device=x.device), cuda_case,
                          required="w4a16.gemm: kernel='cuda'")  # fmt: skip
    if kernel == "gemv":
        return _gemv(x, w, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                     num_stages=num_stages)  # fmt: skip
    mb = m_bucket(m)
    case = tuning.case("w4a16_gemm", f"n{n}_k{k}", mb)
    d = _cfg("w4a16_gemm", case, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
             sub_k=sub_k)  # fmt: skip
    bn, bk = d["block_n"], min(d["block_k"], _padded_k(k))
    sk = _sub_k(d.get("sub_k"), bk, "w4a16.gemm")
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    split = (split_k if split_k is not None else d["split_k"]) or split_for(m, n, k, bn, bk)
    split = max(1, min(split, -(-k // bk)))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    if m == 0:
        return out
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _gemm_kernel[grid](
        x, w.codes, w.scales, w.global_scale, out, ws, m, n, k, w.codes.shape[-3], x.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, EVEN_K=k % bk == 0, INTERP=interpreted(x), SUB_K=sk,
        num_warps=d["num_warps"], num_stages=d["num_stages"],
    )  # fmt: skip
    return _sum_splits(ws, out, split)


def _cuda_gemm(x: torch.Tensor, w: W4A16Weight, ends: torch.Tensor, case: str, required: str | None = None
              ) -> torch.Tensor | None:
    """The product of the stack ``w`` on the CUDA grouped kernel (``w4a16_cuda``) in its launch config ``case`` of
    ``w4a16_grouped_cuda`` (``decode`` where the table has no such entry; ``nt`` null: ``rows_per_pass``); None where
    the kernel does not take the operands, or, when ``required`` names the caller, an error."""
    from quads.kernels import w4a16_cuda

    c = tuning.config("w4a16_grouped_cuda", case if case in tuning.table()["w4a16_grouped_cuda"] else "decode")
    c["nt"] = c["nt"] or w4a16_cuda.rows_per_pass(x.shape[0], w.experts, c["ng"], c["warps"], c["ksplit"])
    if w4a16_cuda.supports(x, w.n, w.k, c["ng"], c["warps"], c["ksplit"]):
        return w4a16_cuda.grouped_gemm(x, w.codes, w.scales, w.global_scale, ends, w.n, w.k, **c)
    if required:
        raise ValueError(f"{required} takes BF16 x on an sm_89+ GPU with a CUDA compiler, K a multiple of 64 and N of "
                         f"{16 * c['ng'] * c['warps'] // c['ksplit']}; got {x.dtype} on {x.device}, K={w.k}, N={w.n}")
    return None


def _sub_k(sub_k: int | None, bk: int, what: str) -> int:
    """The columns a K tile of ``bk`` is decoded and multiplied in at a time: ``sub_k`` (null: ``bk``), a
    multiple of 64 dividing ``bk``."""
    sk = min(sub_k or bk, bk)
    if sk % LAYOUT_K or bk % sk:
        raise ValueError(f"{what}: sub_k must be a multiple of {LAYOUT_K} dividing block_k {bk}, got {sk}")
    return sk


def _sum_splits(ws: torch.Tensor, out: torch.Tensor, split: int) -> torch.Tensor:
    """``out`` = the sum of the ``split`` fp32 partials ``ws`` ``[split, M, N]`` in split order (BF16 once);
    ``out`` itself when there was one split (the kernel wrote it)."""
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(out.numel(), block),)](ws, out, out.numel(), SPLIT_K=split, BLOCK=block,
                                                               num_warps=4)
    return out


def _gemv(x: torch.Tensor, w: W4A16Weight, **explicit) -> torch.Tensor:
    """``gemm`` by ``_gemv_kernel`` (launch config ``w4a16_gemv.small`` with ``explicit`` on top): up to 16
    rows per program (``BLOCK_M``, the next power of two of M)."""
    m, k, n = x.shape[0], w.k, w.n
    if x.data_ptr() % 16:
        x = x.clone()  # the kernel reads x in 8-byte words
    d = _cfg("w4a16_gemv", "small", **{a: v for a, v in explicit.items() if a != "split_k"})
    bn, bk = d["block_n"], min(d["block_k"], _padded_k(k))
    bm = min(16, triton.next_power_of_2(max(m, 1)))
    split = explicit.get("split_k") or d["split_k"] or gemv_split_for(n, k, bn, bk)
    split = max(1, min(split, -(-k // bk)))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _gemv_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, bm))](
        x, w.codes, w.scales, w.global_scale, out, ws, m, n, k, w.codes.shape[-3], x.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, EVEN_K=k % bk == 0, INTERP=interpreted(x),
        num_warps=d["num_warps"], num_stages=d["num_stages"],
    )  # fmt: skip
    return _sum_splits(ws, out, split)


def grouped_block_m(rows: int, experts: int) -> int:
    """Rows per M tile of the grouped kernel when the table says null: twice the mean rows per expert
    (so that most experts fit one tile and decode each weight tile once), a power of two in [16, 64]."""
    mean = -(-rows // max(experts, 1))
    return min(64, max(16, triton.next_power_of_2(2 * mean)))


def grouped_split_for(rows: int, experts: int, n: int, k: int, block_n: int, block_k: int) -> int:
    """A split-K for the grouped kernel: powers of two while the programs that can have rows
    (``min(E, rows)`` experts x N tiles) are fewer than 4 per SM, each split keeps at least 2 K tiles, and
    the fp32 partials (``split x rows x N x 4`` bytes, written and read once) stay under 1/8 of the
    weight bytes those experts read."""
    active = min(experts, rows)
    wbytes = active * n * k * 9 // 16
    split = 1
    while (active * -(-n // block_n) * split < 4 * SMS and -(-k // block_k) // (split * 2) >= 2
           and 2 * split * rows * n * 4 * 8 <= wbytes):  # fmt: skip
        split *= 2
    return split


def grouped_gemm(
    x: torch.Tensor,
    w: W4A16Weight,
    ends: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    max_registers: int | None = None,
    sub_k: int | None = None,
    fused_max_rows_per_expert: int | None = None,
    backend: str | None = None,
    rows: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped MoE W4A16 (module docstring): ``x`` ``[T, K]`` BF16 sorted by expert, packed ``w``
    ``[E, N, K]``, ``ends`` ``[E]`` int32 on the device -> ``[T, N]`` BF16. ``rows`` ``[T]`` (int64, optional):
    the sorted rows are ``x[rows]`` (``x`` ``[S, K]``: e.g. a MoE layer's tokens, ``rows`` each slot's token),
    which the Triton kernel reads in place (the product of ``x[rows]``, bit for bit, without writing it); rows
    past ``ends[E-1]`` are not read. ``row_scale`` ``[T]`` (``x.dtype``): output row m times ``row_scale[m]``, the
    bits of eager ``y * row_scale[:, None]`` (e.g. a MoE layer's route weights in sorted order), in the Triton
    kernel's epilogue without split-K, after the product otherwise.

    Above ``fused_max_rows_per_expert`` rows per expert on average (``tuning.json``
    ``w4a16_dispatch.grouped``; prefill) the product is ``torch._grouped_mm`` over the BF16 stack
    decoded by ``dequantize_bf16``, with the rows past ``ends[E-1]`` zeroed.

    Launch config: ``tuning.json`` ``w4a16_grouped_gemm.decode`` at <= ``GROUPED_DECODE_ROWS`` rows per
    expert on average (``T <= 16 E``), else ``.prefill`` (``.n{N}_k{K}_decode`` / ``_prefill`` where the table
    has that weight shape, and ``w4a16_grouped_cuda`` the same key for the CUDA backend's config); explicit arguments override it; ``block_m``
    null picks ``grouped_block_m``, ``split_k`` null (or 0) ``grouped_split_for``; ``max_registers``
    (null: the compiler's choice) caps the registers per thread (PTX ``.maxnreg``), which trades spills
    for resident warps: the decode config's 225 registers allow 2 blocks of 4 warps per SM (Nsight
    Compute, docs/PERF.md). A launch option: the result is the same bits under every value. ``sub_k`` (null:
    ``block_k``; a multiple of 64 dividing it) decodes and multiplies each K tile that many columns at a
    time (compiled for sm_90, 64 at block_k 128 needs 128 registers instead of 217); the fp32 sums run
    in the same K order.

    ``backend`` (null: the config's, ``tuning.json`` ``w4a16_grouped_gemm.<case>.backend``): "triton", or "cuda",
    the CUDA kernel of ``w4a16_cuda`` (launch config ``w4a16_grouped_cuda.decode``; its ``nt`` null:
    ``w4a16_cuda.rows_per_pass``) where it takes the operands
    (``w4a16_cuda.supports``: BF16 on an sm_89+ GPU with nvcc, K a multiple of 64), the Triton kernel otherwise;
    asked for explicitly where it cannot run, an error. Both give the same operands and fp32 sums in another
    order (the GEMMs' tolerance)."""
    _require_triton()
    _check_x(x, w, "w4a16.grouped_gemm", experts=True)
    e = w.experts
    if ends.shape != (e,) or ends.dtype != torch.int32 or ends.device != x.device:
        raise ValueError(f"w4a16.grouped_gemm: ends must be int32 [E={e}] on {x.device} (cumulative rows per "
                         f"expert), got {ends.dtype} {tuple(ends.shape)} on {ends.device}")  # fmt: skip
    x = x.contiguous()
    if row_scale is not None:
        t_out = x.shape[0] if rows is None else rows.shape[0]
        if row_scale.shape != (t_out,) or row_scale.dtype != x.dtype or row_scale.device != x.device:
            raise ValueError(f"w4a16.grouped_gemm: row_scale must be {x.dtype} [{t_out}] on {x.device}, got "
                             f"{row_scale.dtype} {tuple(row_scale.shape)} on {row_scale.device}")  # fmt: skip
        row_scale = row_scale.contiguous()

    def scaled(y: torch.Tensor) -> torch.Tensor:  # the row scale after a product that did not apply it
        return y if row_scale is None else y * row_scale[:, None]

    if rows is not None:
        if rows.dim() != 1 or rows.dtype != torch.long or rows.device != x.device:
            raise ValueError(f"w4a16.grouped_gemm: rows must be int64 [T] on {x.device}, got {rows.dtype} "
                             f"{tuple(rows.shape)} on {rows.device}")  # fmt: skip
        rows = rows.contiguous()
    t, k, n = (x.shape[0] if rows is None else rows.shape[0]), w.k, w.n
    case = grouped_case(t, e, n, k)
    d = _cfg("w4a16_grouped_gemm", case, block_m=block_m, block_n=block_n, block_k=block_k,
             num_warps=num_warps, num_stages=num_stages, split_k=split_k, max_registers=max_registers, sub_k=sub_k)  # fmt: skip
    rpe = fused_max_rows_per_expert
    dequant = t > e * (rpe if rpe is not None else tuning.config("w4a16_dispatch", "grouped")["fused_max_rows_per_expert"])
    choice = backend or d.get("backend") or "triton"
    if rows is not None and (dequant or choice == "cuda"):
        x, rows = x[rows], None  # these paths read the sorted rows themselves
    if dequant:
        y = torch._grouped_mm(x, dequantize_bf16(w).transpose(-2, -1), offs=ends)
        written = torch.arange(t, device=x.device) < ends[-1]
        return scaled(torch.where(written[:, None], y, 0.0))  # rows past the last offset are not written
    if choice not in ("triton", "cuda"):
        raise ValueError(f"w4a16.grouped_gemm: backend must be triton or cuda, got {choice!r}")
    if choice == "cuda":
        y = _cuda_gemm(x, w, ends, case, required="w4a16.grouped_gemm: backend='cuda'" if backend == "cuda" else None)
        if y is not None:
            return scaled(y)
    bk = min(d["block_k"], _padded_k(k))
    bm = d["block_m"] or grouped_block_m(t, e)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    bn = d["block_n"]
    sk = _sub_k(d.get("sub_k"), bk, "w4a16.grouped_gemm")
    split = max(1, min(d["split_k"] or grouped_split_for(t, e, n, k, bn, bk), -(-k // bk)))
    ws = torch.empty(split, t, n, dtype=torch.float32, device=x.device) if split > 1 else out
    fuse = row_scale is not None and split == 1  # the scale in the epilogue (split partials are summed first)
    _grouped_kernel[(triton.cdiv(n, bn), e + 1, split)](
        x, ends if rows is None else rows, w.codes, w.scales, w.global_scale, ends, out, ws,
        row_scale if fuse else out, t, n, k, w.codes.shape[-3], e, x.stride(0), BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split,
        BLOCK_K=bk, EVEN_K=k % bk == 0, INTERP=interpreted(x), SUB_K=sk, GATHER=rows is not None, SCALE=fuse,
        num_warps=d["num_warps"], num_stages=d["num_stages"], **_max_registers(d.get("max_registers"), x),
    )  # fmt: skip
    y = _sum_splits(ws, out, split)
    return y if fuse else scaled(y)


def _max_registers(n: int | None, x: torch.Tensor) -> dict:
    """The launch option capping registers per thread (``maxnreg``), none when ``n`` is null or under the
    interpreter (which has no registers)."""
    if n is None:
        return {}
    if not 24 <= n <= 255:
        raise ValueError(f"max_registers must be in [24, 255] (PTX .maxnreg), got {n}")
    return {} if interpreted(x) else {"maxnreg": int(n)}


def dequantize_bf16(w: W4A16Weight, *, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """``dequantize(w)`` by the GEMMs' own decode (Triton): the BF16 weight ``[(E,) N, K]``, bit for bit."""
    _require_triton()
    e = w.experts or 1
    out = torch.empty(*(() if w.experts is None else (e,)), w.n, w.k, dtype=torch.bfloat16, device=w.device)
    bk = min(block_k, _padded_k(w.k))
    _dequantize_kernel[(triton.cdiv(w.n, block_n), triton.cdiv(w.k, bk), e)](
        w.codes, w.scales, w.global_scale, out, w.n, w.k, w.codes.shape[-3], BLOCK_N=block_n, BLOCK_K=bk,
        EVEN_K=w.k % bk == 0, INTERP=interpreted(w.codes),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------- torch.compile ops
# The launchers read the tuning table and pick configs in Python; inside the engine's compiled decode
# step (quads.rollout.decode) they are single opaque custom ops, so Dynamo neither traces that Python
# nor breaks the graph around them, and Inductor fuses the code on both sides.


@torch.library.custom_op("quads::w4a16_gemm", mutates_args=())
def _gemm_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
             n: int, k: int) -> torch.Tensor:
    return gemm(x, W4A16Weight(codes, scales, global_scale, n, k, None))


@_gemm_op.register_fake
def _(x, codes, scales, global_scale, n, k):
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("quads::w4a16_grouped_gemm", mutates_args=())
def _grouped_gemm_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     ends: torch.Tensor, n: int, k: int, rows: torch.Tensor | None = None,
                     row_scale: torch.Tensor | None = None) -> torch.Tensor:
    return grouped_gemm(x, W4A16Weight(codes, scales, global_scale, n, k, codes.shape[0]), ends, rows=rows,
                        row_scale=row_scale)


@_grouped_gemm_op.register_fake
def _(x, codes, scales, global_scale, ends, n, k, rows=None, row_scale=None):
    return x.new_empty(x.shape[0] if rows is None else rows.shape[0], n)


def linear_op(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """``gemm(x, w)`` with the tuned launch config, as the custom op ``quads::w4a16_gemm``."""
    return torch.ops.quads.w4a16_gemm(x, w.codes, w.scales, w.global_scale, w.n, w.k)


def grouped_op(x: torch.Tensor, w: W4A16Weight, ends: torch.Tensor, rows: torch.Tensor | None = None,
               row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_gemm(x, w, ends, rows=rows, row_scale=row_scale)`` with the tuned launch config, as the custom op
    ``quads::w4a16_grouped_gemm``."""
    return torch.ops.quads.w4a16_grouped_gemm(x, w.codes, w.scales, w.global_scale, ends, w.n, w.k, rows, row_scale)
