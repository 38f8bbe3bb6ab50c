"""Triton helpers shared by the NVFP4 kernels: exact E4M3 / E2M1 rounding and decoding.

Everything here is plain IEEE fp32 / integer arithmetic, so it runs the same compiled for sm_90 and
under Triton's CPU interpreter:

- Triton's ``.to(tl.float8e4nv)`` is not used for the block scales: under the interpreter it
  mis-rounds values whose mantissa carries into the exponent (127.8 -> 64 instead of 128, seen with
  triton 3.9), so ``e4m3_rne`` rounds by bit manipulation (RNE, subnormals kept) and returns both
  the fp32 value of the rounded scale and its byte.
- Triton's fp32 ``/`` lowers to an approximate division on NVIDIA GPUs; the reference divides with
  IEEE round-to-nearest, so kernels use ``tl.math.div_rn``.
- The interpreter's fp32 -> bf16 cast truncates; outputs go through ``cast_out`` (RNE by bits).
- E2M1 decoding places the 3 magnitude bits of a code in the exponent and top mantissa bit of an
  fp16 (``(c & 7) << 9``), which is exactly ``e2m1 * 2**-14`` (code 1 lands on the fp16 subnormal
  2**-15); multiplying by ``s * 2**14`` in fp32 gives ``e2m1 * s`` exactly, which BF16 also holds
  exactly (2 + 4 significant bits, exponents within range).
"""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

# 2**14: the fp16 bit trick in ``e2m1_times_scale`` yields e2m1 * 2**-14.
E2M1_F16_SHIFT = 16384.0
# Adding 2**14 to an fp32 in [0, 2**-6) rounds it (RNE) to a multiple of 2**-9 = the E4M3 subnormal step.
E4M3_SUBNORMAL_MAGIC = 16384.0


# Launch options of the bit-exact kernels: no FMA contraction (``x - a * b`` must round ``a * b``
# first, as the reference does; Triton contracts by default).
EXACT = {"enable_fp_fusion": False}


def check_out(out: torch.Tensor, m: int, k: int, name: str) -> None:
    """A clear error unless ``out`` (a kernel's output, rows may be strided) is ``[m, k]`` with unit stride along K."""
    if out.shape != (m, k) or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be [{m}, {k}] with unit stride along K, got {tuple(out.shape)} "
                         f"strides {out.stride()}")


def interpreted(t: torch.Tensor) -> bool:
    """Whether a kernel launched on ``t`` runs under Triton's CPU interpreter: Triton compiles only for
    GPUs, so a kernel on CPU tensors is interpreted. Kernels take this as a constexpr to pick the
    interpreter-safe form of an operation (same values); it is read from the tensor, not from the
    environment."""
    return not t.is_cuda


def interpreter_on() -> bool:
    """Whether Triton decorated the kernels for its CPU interpreter (Triton's own switch,
    ``TRITON_INTERPRET=1``, read by Triton when a kernel is decorated); without it a kernel cannot
    run on CPU tensors."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(e4m3_rne, InterpretedFunction)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def e4m3_rne(v):
        """fp32 ``v`` in [0, 448] (no NaN) -> (fp32 value of e4m3(v), e4m3 byte as int32), RNE."""
        bits = v.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1
        rb = (bits + 0x7FFFF + lsb) & -1048576  # clear the low 20 mantissa bits, round to nearest even
        normal = rb.to(tl.float32, bitcast=True)
        sub = (v + 16384.0) - 16384.0  # E4M3_SUBNORMAL_MAGIC: multiples of 2**-9 for v < 2**-6
        is_sub = v < 0.015625  # F8E4M3_MIN_NORMAL
        val = tl.where(is_sub, sub, normal)
        byte_n = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
        byte_s = (sub * 512.0).to(tl.int32)
        byte = tl.where(is_sub, byte_s, byte_n)
        return val, byte

    @triton.jit
    def f32_to_bf16_rne(v):
        """fp32 -> bf16, round to nearest even, by bits (the interpreter's cast truncates)."""
        bits = v.to(tl.int32, bitcast=True)
        r = bits + 0x7FFF + ((bits >> 16) & 1)
        r = tl.where(v != v, bits | 0x400000, r)  # NaN stays a (quiet) NaN
        return (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def cast_out(v, ptr):
        """fp32 ``v`` cast (RNE) to the element type of ``ptr``."""
        if ptr.dtype.element_ty == tl.bfloat16:
            return f32_to_bf16_rne(v)
        else:
            return v.to(ptr.dtype.element_ty)

    @triton.jit
    def e4m3_to_f32(b):
        """E4M3 (fn) bytes (any int type) -> fp32, exact; 0x7F / 0xFF -> NaN. Decoded by bits because the
        interpreter's float8 -> fp32 cast does not give NaN for 0x7F."""
        b = b.to(tl.int32) & 0xFF
        e = (b >> 3) & 0xF
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
        mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
        return tl.where((b & 0x80) != 0, -mag, mag)

    @triton.jit
    def e4m3_to_f32_hw(b, INTERP: tl.constexpr):
        """``e4m3_to_f32`` through the hardware convert on the GPU (``cvt.rn.f16x2.e4m3x2``: exact,
        0x7F / 0xFF stay NaN), about 1 instruction per value instead of about 10; under the
        interpreter (whose float8 cast gives no NaN for 0x7F) the bit decode."""
        if INTERP:
            return e4m3_to_f32(b)
        else:
            return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def e2m1_code(y, sign_src):
        """fp32 ``y`` (= x * enc) -> 4-bit E2M1 code (int32), RNE; sign bit from ``sign_src``.

        Thresholds as in ``quads.formats.nvfp4._E2M1_THRESHOLDS``; values above 6 (and inf) give
        code 7, so no clamp is needed; NaN gives magnitude code 0.
        """
        m = tl.abs(y)
        c = (m > 0.25).to(tl.int32)
        c += (m >= 0.75).to(tl.int32)
        c += (m > 1.25).to(tl.int32)
        c += (m >= 1.75).to(tl.int32)
        c += (m > 2.5).to(tl.int32)
        c += (m >= 3.5).to(tl.int32)
        c += (m > 5.0).to(tl.int32)
        sign = (sign_src.to(tl.int32, bitcast=True) >> 31) & 1
        return c | (sign << 3)

    @triton.jit
    def e2m1_code_bits(y, x):
        """Same codes as ``e2m1_code(y, x)`` for ``y = x * enc`` (enc > 0), NaN ``x`` -> 0, in about 12
        integer / fp32 ops instead of 7 compare-and-adds:

        - |y| < 1 (E2M1 subnormal step 0.5): ``|y| + 2**22`` rounds |y| to a multiple of 0.5 (RNE, the ulp
          at 2**22 is 0.5); its bits minus those of 2**22 count the halves: code 0, 1 or 2.
        - |y| >= 1: round the fp32 to 1 mantissa bit (RNE by bits); ``bits >> 22`` is then
          (biased exponent, mantissa bit) and minus 252 the E2M1 code; above 6 (and inf) saturate at 7.
        """
        b = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        m = b.to(tl.float32, bitcast=True)
        sub = (m + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000
        nrm = tl.minimum(((b + 0x1FFFFF + ((b >> 22) & 1)) >> 22) - 252, 7)
        c = tl.where(m < 1.0, sub, nrm)
        c = c | ((x.to(tl.int32, bitcast=True) >> 28) & 8)
        return tl.where(x != x, 0, c)

    @triton.jit
    def e2m1_times_scale(c, s16):
        """4-bit codes ``c`` (int32) and ``s16`` = float(scale) * 2**14 (fp32, broadcastable) ->
        ``e2m1 * scale`` in fp32, exact."""
        bits = ((c & 7) << 9) | ((c & 8) << 12)
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return v * s16

    @triton.jit
    def unpack_codes(packed, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BLOCK_R, BLOCK_K // 2] bytes -> [BLOCK_R, BLOCK_K] int32 codes (low nibble = even element)."""
        p = packed.to(tl.int32)
        lo = p & 0xF
        hi = (p >> 4) & 0xF
        return tl.reshape(tl.join(lo, hi), (BLOCK_R, BLOCK_K))
