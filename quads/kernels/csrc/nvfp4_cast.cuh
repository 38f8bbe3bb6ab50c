// The canonical NVFP4 cast of one element, for CUDA kernels and (compiled by a host C++ compiler with
// -ffp-contract=off) for the host: the arithmetic of the Triton kernels (nvfp4_quant._global_scales, _quantize_tile,
// _units_tile; _common.e4m3_rne, e2m1_code_bits, e2m1_times_scale, f32_to_bf16_rne), which quads.formats.nvfp4 defines
// and tests/test_nvfp4*.py hold bit-exact. A 16-element block's amax and NaN flag are the caller's (a loop, or warp
// shuffles); block_scale turns them into the block's encode factor and stored scale, element_unit one element into
// u = e2m1 * s. tests/test_rac_operand_cuda.py builds these for the host and compares them with the reference.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define QUADS_HD __host__ __device__ __forceinline__
#else
#define QUADS_HD inline
#endif

namespace quads_nvfp4 {

// the format's constants, named as in quads/formats/constants.py
constexpr float kF4E2M1Max = 6.f;                          // F4_E2M1_MAX
constexpr float kF8E4M3Max = 448.f;                        // F8E4M3_MAX
constexpr float kF8E4M3MinNormal = 0.015625f;              // F8E4M3_MIN_NORMAL = 2^-6
constexpr float kGlobalNumerator = kF8E4M3Max * kF4E2M1Max;  // NVFP4_GLOBAL_ENCODE_NUMERATOR = 2688
constexpr float kE4M3SubnormalStep = 0.001953125f;         // 2^-9, E4M3's subnormal spacing
constexpr float kE4M3SubnormalMagic = 16384.f;             // 2^14: x + 2^14 - 2^14 rounds x to a multiple of 2^-9
constexpr float kE2M1HalfMagic = 4194304.f;                // 2^22: |y| + 2^22 rounds |y| to a multiple of 0.5
constexpr float kFp16Unit = 16384.f;                       // 2^14: an E2M1 code read as FP16 bits is its value * 2^-14
constexpr float kInv6 = 0.16666667163372040f;              // fp32(1 / F4_E2M1_MAX)
constexpr float kFltMax = 3.4028234663852886e38f;

// fp32 operations rounded once to nearest even, never contracted into an FMA (the Triton kernels' EXACT)
QUADS_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
QUADS_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
QUADS_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
QUADS_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// the min of two values, the second never NaN (Triton's tl.minimum against a constant)
QUADS_HD float fmin2(float a, float b) { return b < a ? b : a; }
QUADS_HD uint32_t bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t b;
  memcpy(&b, &v, 4);
  return b;
#endif
}
QUADS_HD float from_bits(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float v;
  memcpy(&v, &b, 4);
  return v;
#endif
}

// amax (>= 0, not NaN) -> (S_enc, S_dec), as nvfp4.global_encode_scale
QUADS_HD void global_scales(float amax, float& s_enc, float& s_dec) {
  float e = fmin2(div(kGlobalNumerator, amax), kFltMax);
  if (amax == 0.f || e == 0.f) e = 1.f;
  s_enc = e;
  s_dec = div(1.f, e);
}

// v in [0, F8E4M3_MAX] (not NaN) -> the fp32 value of e4m3(v), RNE, and its byte
QUADS_HD float e4m3_rne(float v, int& byte) {
  const uint32_t b = bits(v);
  const uint32_t rb = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
  const float s = sub(add(v, kE4M3SubnormalMagic), kE4M3SubnormalMagic);  // below 2^-6
  if (v < kF8E4M3MinNormal) {
    byte = (int)mul(s, 1.f / kE4M3SubnormalStep);  // exact: a power of two
    return s;
  }
  byte = (int)(((((rb >> 23) & 0xFFu) - 120u) << 3) | ((rb >> 20) & 7u));
  return from_bits(rb);
}

// E4M3 byte -> fp32, exact; 0x7F / 0xFF -> NaN
QUADS_HD float e4m3_to_f32(int b) {
  b &= 0xFF;
  const int e = (b >> 3) & 0xF, m = b & 7;
  float mag = e == 0 ? mul((float)m, kE4M3SubnormalStep) : from_bits((uint32_t)(((e + 120) << 23) | (m << 20)));
  if ((b & 0x7F) == 0x7F) mag = from_bits(0x7FC00000u);
  return (b & 0x80) ? -mag : mag;
}

// y = x * enc -> the 4-bit E2M1 code, RNE, sign from x, NaN x -> 0
QUADS_HD int e2m1_code(float y, float x) {
  const uint32_t b = bits(y) & 0x7FFFFFFFu;
  const float m = from_bits(b);
  const int sb = (int)bits(add(m, kE2M1HalfMagic)) - (int)bits(kE2M1HalfMagic);
  int nrm = (int)((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252;
  nrm = nrm < 7 ? nrm : 7;
  const int c = (m < 1.f ? sb : nrm) | (int)((bits(x) >> 28) & 8u);
  return x != x ? 0 : c;
}

// A block's encode factor and stored scale from its NaN-ignoring amax bm and NaN flag: (enc, s16 = float(scale) *
// 2^14, NaN for a block holding a NaN)
QUADS_HD void block_scale(float bm, bool has_nan, float s_enc, float s_dec, float& enc, float& s16) {
  const float v = fmin2(mul(bm, mul(s_enc, kInv6)), kF8E4M3Max);
  int byte;
  const float s_val = e4m3_rne(v, byte);
  enc = fmin2(div(1.f, mul(s_val, s_dec)), kFltMax);
  s16 = mul(e4m3_to_f32(has_nan ? 0x7F : byte), kFp16Unit);
}

// One element -> u = e2m1 * scale in fp32 (exact): the code's E2M1 value times 2^-14 (the value of the FP16 bit
// pattern ((c & 7) << 9) | ((c & 8) << 12), built here as fp32 bits) times s16
QUADS_HD float element_unit(float x, float enc, float s16) {
  const int c = e2m1_code(mul(x, enc), x);
  const uint32_t m = (uint32_t)c & 7u;
  uint32_t fb = m == 0 ? 0u : m == 1 ? (112u << 23) : ((((m >> 1) + 112u) << 23) | ((m & 1u) << 22));
  fb |= ((uint32_t)c & 8u) << 28;
  return mul(from_bits(fb), s16);
}

// fp32 -> BF16 bits, RNE; NaN stays a quiet NaN of the same sign and top payload
QUADS_HD uint16_t bf16_bits(float v) {
  const uint32_t b = bits(v);
  const uint32_t r = v != v ? (b | 0x400000u) : b + 0x7FFFu + ((b >> 16) & 1u);
  return (uint16_t)(r >> 16);
}

}  // namespace quads_nvfp4
