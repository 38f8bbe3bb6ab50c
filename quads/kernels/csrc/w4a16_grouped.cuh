// Grouped MoE W4A16 GEMM at decode over the packed NVFP4 layout of quads.kernels.w4a16 (CUDA, sm_89+: the E4M3 convert).
//
// out[t, :] = x[t, :] @ W_e^T for the rows t of expert e (ends[e-1] <= t < ends[e]); rows from ends[E-1] on
// are written as zeros. The weight each product uses is bf16(fp32(e2m1 * s) * S_dec[e]), the value of
// quads.formats.nvfp4.dequantize(q, bf16) bit for bit, decoded in registers straight into the tensor-core
// operand (mma.sync m16n8k16, BF16 in, FP32 accumulate): no shared-memory round trip, which is what the
// Triton kernel (w4a16._grouped_kernel, the reference beside this one) pays for tl.dot's operand layout.
//
// The decode is _decode_pairs' (w4a16.py): per 16-element block the 8 magnitudes bf16(fp32(s * m) * g) for
// m in {0, .5, 1, 1.5, 2, 3, 4, 6} as two 8-byte tables, then 4 weights per byte permute and the sign by XOR;
// the table here comes from two roundings where that is exact (`table`, below).
//
// Work split: a warp owns 16 NG output features (NG groups of 16, one mma m-tile each: the weights are the A
// operand, the activations the B operand, so the tensor cores compute out^T) of one expert and runs the whole K
// loop (or, with KSPLIT > 1, every KSPLIT-th K tile of it, see grouped_decode_kernel); a block is WARPS warps,
// WARPS / KSPLIT feature groups side by side along N; grid (N / (16 NG WARPS / KSPLIT), E + 1). In K tile t (64
// columns = 8 code words and 4 block scales per feature), lane (gid = lane / 4, tig = lane % 4) decodes block
// tig of features n0 + 16 j + gid and n0 + 16 j + 8 + gid (code words 2 tig, 2 tig + 1: 16 weights and one
// scale each, so one table per 16 weights) and feeds them to four mma's, k step q in 0..3 taking the block's
// elements 4q .. 4q + 3. The mma's logical k index (2 tig + {0, 1}, 2 tig + 8 + {0, 1}) is thereby mapped to
// the physical columns 16 tig + 4 q + {0, 1}, {2, 3}; the activation fragments use the same map (a lane reads
// the 16 columns 16 tig .. 16 tig + 15 of its row, two 16-byte loads whose words are the B fragments as they
// are), so every product pairs a weight with its own activation and the sum over the 64 columns is complete (in
// another order than the Triton kernel's). NT tiles of 8 rows are accumulated per pass over K; an expert with
// more rows takes more passes.
//
// Requirements (checked by the launcher, w4a16_cuda.py): K a multiple of 64 (no padding columns), x and
// out BF16 row-major with 16-byte aligned rows, N a multiple of 16 NG WARPS / KSPLIT.

#ifdef QUADS_OFFLINE_SASS  // compiled without the CUDA headers (scripts/sass_w4a16_cuda.py)
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __forceinline__ __attribute__((always_inline))
#define __launch_bounds__(a, b) __attribute__((launch_bounds(a, b)))
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#define __shared__ __attribute__((shared))
#define QUADS_SYNCTHREADS() asm volatile("bar.sync 0;" ::: "memory")
#else
#define QUADS_SYNCTHREADS() __syncthreads()

#endif

namespace quads_w4a16 {

struct alignas(16) U4 { uint32_t x, y, z, w; };
struct alignas(8) U2 { uint32_t x, y; };

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// fp32 lo, hi -> bf16(lo) in bits 0-15, bf16(hi) in bits 16-31 (round to nearest even)
__device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ float fmul(float a, float b) {  // one IEEE product, never contracted into an FMA
  float d;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// E4M3 byte -> fp32, exact (0x7F / 0xFF are NaN): the hardware convert to f16x2, then to fp32
__device__ __forceinline__ float e4m3_to_f32(uint32_t byte) {
  uint32_t h2;
  unsigned short b16 = (unsigned short)(byte & 0xFF);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(b16));
  float f;
  unsigned short h = (unsigned short)(h2 & 0xFFFF);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// The 8 magnitudes of a block, bf16(fp32(s * m) * g) for m = 0, .5, 1, 1.5, 2, 3, 4, 6, as bf16 pairs (m0, m.5),
// (m1, m1.5), (m2, m3), (m4, m6): w4a16._decode_pairs' table, computed the reference's way (8 products, 8 roundings)
__device__ __forceinline__ void table_exact(float s, float g, uint32_t t[4]) {
  t[0] = bf16x2(fmul(fmul(s, 0.0f), g), fmul(fmul(s, 0.5f), g));
  t[1] = bf16x2(fmul(s, g), fmul(fmul(s, 1.5f), g));
  t[2] = bf16x2(fmul(fmul(s, 2.0f), g), fmul(fmul(s, 3.0f), g));
  t[3] = bf16x2(fmul(fmul(s, 4.0f), g), fmul(fmul(s, 6.0f), g));
}

// The same table from two roundings: with b1 = bf16(fp32(s * g)) and b3 = bf16(fp32((3 s) * g)) (3 s is exact),
// every magnitude is b1 or b3 times a power of two (m = 0.5, 1, 2, 4 and 1.5, 3, 6), and scaling by 2^k commutes
// with both roundings while every value stays normal and finite, so the power of two is an integer add to the
// BF16 exponent field. That holds when b1's biased exponent is in [2, 252] (b1 / 2 .. 4 b1 normal) and b3's in
// [2, 253]; m = 0 gives a zero with b1's sign (the sign of s * g, as (s * 0) * g has). A block of scale +-0 with
// a finite g is all zeros of that sign. Any other block (subnormal or huge products, NaN or inf) takes
// table_exact. Bit for bit the exact table in every case (tests/test_kernels_w4a16_cuda.py, all 256 scale bytes
// against several g).
__device__ __forceinline__ void table(float s, float g, uint32_t t[4]) {
  const uint32_t q = bf16x2(fmul(s, g), fmul(fmul(s, 3.0f), g));  // b1 in bits 0-15, b3 in 16-31
  const uint32_t e1 = (q >> 7) & 0xFFu, e3 = (q >> 23) & 0xFFu;
  if (e1 - 2u <= 250u && e3 - 2u <= 251u) {
    t[0] = (q & 0x8000u) | ((q - 0x80u) << 16);  // (+-0, b1 / 2)
    t[1] = q - 0x00800000u;                      // (b1, b3 / 2)
    t[2] = q + 0x00000080u;                      // (2 b1, b3)
    t[3] = q + 0x00800100u;                      // (4 b1, 2 b3)
  }
#ifndef QUADS_SASS_FAST_PATH  // (scripts/sass_w4a16_cuda.py counts the loop without the rare branches)
  else if (s == 0.0f && (q & 0x7FFF7FFFu) == 0u) {
    t[0] = t[1] = t[2] = t[3] = (q & 0x8000u) * 0x10001u;
  } else {
    table_exact(s, g, t);
  }
#endif
}

// The 16 weights of one block: code words w0 (elements 0-7), w1 (8-15), E4M3 scale byte sbyte, S_dec g ->
// bf16 pairs p[i] = (element 2i, element 2i + 1), the first in bits 0-15 (w4a16._decode_pairs)
__device__ __forceinline__ void decode_block(uint32_t w0, uint32_t w1, uint32_t sbyte, float g, uint32_t p[8]) {
  uint32_t t[4];
  table(e4m3_to_f32(sbyte), g, t);
  const uint32_t lo0 = prmt(t[0], t[1], 0x6420), lo1 = prmt(t[2], t[3], 0x6420);
  const uint32_t hi0 = prmt(t[0], t[1], 0x7531), hi1 = prmt(t[2], t[3], 0x7531);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t w = h ? w1 : w0;
    const uint32_t mag = w & 0x77777777u, mag_hi = mag >> 16;
    const uint32_t lo_a = prmt(lo0, lo1, mag), hi_a = prmt(hi0, hi1, mag) ^ (w & 0x80808080u);
    const uint32_t lo_b = prmt(lo0, lo1, mag_hi), hi_b = prmt(hi0, hi1, mag_hi) ^ ((w << 4) & 0x80808080u);
    p[4 * h + 0] = prmt(lo_a, hi_a, 0x5140);
    p[4 * h + 1] = prmt(lo_a, hi_a, 0x7362);
    p[4 * h + 2] = prmt(lo_b, hi_b, 0x5140);
    p[4 * h + 3] = prmt(lo_b, hi_b, 0x7362);
  }
}

__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 BF16 activations of row `row` from column `col` (two 16-byte loads), zeros for a row past `end`
__device__ __forceinline__ void load_x(const uint32_t* __restrict__ x, long long row, int end, long long stride_w,
                                       int col, uint32_t a[8]) {
  if (row < end) {
    const U4* src = reinterpret_cast<const U4*>(x + row * stride_w + col / 2);
    const U4 v0 = src[0], v1 = src[1];
    a[0] = v0.x; a[1] = v0.y; a[2] = v0.z; a[3] = v0.w;
    a[4] = v1.x; a[5] = v1.y; a[6] = v1.z; a[7] = v1.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = 0u;
  }
}

template <int NG, int NT>
struct Tile {  // one K tile's operands of one lane: 2 NG blocks (code words, scale byte), NT rows of x
  U2 w[NG][2];
  uint32_t s[NG][2];
  uint32_t x[NT][8];
};

template <int NG, int NT>
__device__ __forceinline__ void load_tile(Tile<NG, NT>& t, const uint32_t* __restrict__ codes,
                                          const uint32_t* __restrict__ scales, const uint32_t* __restrict__ x,
                                          int kt, int N, int n0, int gid, int tig, long long m0, int end,
                                          long long stride_w) {
#pragma unroll
  for (int j = 0; j < NG; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long row = (long long)kt * N + n0 + 16 * j + 8 * h + gid;
      t.w[j][h] = *reinterpret_cast<const U2*>(codes + row * 8 + 2 * tig);
      t.s[j][h] = (scales[row] >> (8 * tig)) & 0xFFu;
    }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) load_x(x, m0 + 8 * nt + gid, end, stride_w, 64 * kt + 16 * tig, t.x[nt]);
}

// acc += one K tile's products. The weights are the mma's A operand (16 features x 16 k), the activations its B
// operand (16 k x 8 rows), so a lane's B fragment (b0, b1) is two consecutive words of its row as loaded and its
// A fragment is written by the decode itself: the tensor cores compute out^T, as Marlin-style decode kernels do.
template <int NG, int NT>
__device__ __forceinline__ void tile_products(float (&acc)[NT][NG][4], const Tile<NG, NT>& t, float g) {
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    uint32_t pa[8], pb[8];  // features gid and gid + 8 of group j
    decode_block(t.w[j][0].x, t.w[j][0].y, t.s[j][0], g, pa);
    decode_block(t.w[j][1].x, t.w[j][1].y, t.s[j][1], g, pb);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        mma_bf16(acc[nt][j], pa[2 * q], pb[2 * q], pa[2 * q + 1], pb[2 * q + 1], t.x[nt][2 * q], t.x[nt][2 * q + 1]);
  }
}

// x, out: BF16 [T, K] / [T, N] (as 32-bit words: two BF16 per word); codes int32 [E, K/64, N, 8];
// scales int32 [E, K/64, N]; gscale fp32 [E]; ends int32 [E]. A block holds WARPS / KSPLIT feature groups of
// 16 NG features; KSPLIT warps share a group, warp p of them taking the K tiles p, p + KSPLIT, ... (more warps
// and loads in flight, chains KSPLIT times shorter), their fp32 partials summed in p order through shared
// memory (deterministic); a pass over K accumulates 8 NT rows. With KSPLIT > 1 (4x the blocks) and NT <= 2 the
// registers are capped for 4 resident blocks (128 per thread; compiled offline without spills, 16 warps per SM
// instead of 12); elsewhere the compiler's choice.
template <int NG, int NT, int WARPS, int KSPLIT>
__global__ void __launch_bounds__(WARPS * 32, (KSPLIT > 1 && NT <= 2) ? 4 : 1) grouped_decode_kernel(
    const uint32_t* __restrict__ x, const uint32_t* __restrict__ codes, const uint32_t* __restrict__ scales,
    const float* __restrict__ gscale, const int* __restrict__ ends, uint32_t* __restrict__ out, int T, int N, int K,
    int E, long long stride_xm) {
  static_assert(WARPS % KSPLIT == 0, "KSPLIT warps per feature group");
  constexpr int GROUPS = WARPS / KSPLIT;
#ifdef QUADS_OFFLINE_SASS
  const int tid = (int)__nvvm_read_ptx_sreg_tid_x();
  int bx, by;
  asm("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
  asm("mov.u32 %0, %%ctaid.y;" : "=r"(by));
#else
  const int tid = threadIdx.x, bx = blockIdx.x, by = blockIdx.y;
#endif
  const int lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int fg = warp / KSPLIT, part = warp % KSPLIT;
  const int n0 = (bx * GROUPS + fg) * 16 * NG;  // N is a multiple of the block's 16 NG GROUPS features
  const int e = by;
  const int start = e > 0 ? ends[e - 1] : 0;
  unsigned short* out16 = reinterpret_cast<unsigned short*>(out);
  if (e == E) {  // the rows past the last expert's (masked slots): zeros
    if (part == 0)
      for (long long r = start + gid; r < T; r += 8) {
#pragma unroll
        for (int j = 0; j < 2 * NG; ++j) out[(r * N + n0) / 2 + 4 * j + tig] = 0u;  // 8 NG words
      }
    return;
  }
  const int end = ends[e];
  const int KT = K / 64;
  const float g = gscale[e];
  const uint32_t* ce = codes + (long long)e * KT * N * 8;
  const uint32_t* se = scales + (long long)e * KT * N;
  const long long stride_w = stride_xm / 2;
  constexpr int ACC = NT * NG * 4;
  __shared__ float partial[KSPLIT > 1 ? WARPS : 1][ACC][32];
  for (long long m0 = start; m0 < end; m0 += 8 * NT) {  // experts without rows read no weights
    float acc[NT][NG][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][j][i] = 0.0f;
    Tile<NG, NT> t0, t1;  // two K tiles in flight: one computed while the next one loads
    if (part < KT) load_tile<NG, NT>(t0, ce, se, x, part, N, n0, gid, tig, m0, end, stride_w);
    for (int kt = part; kt < KT; kt += 2 * KSPLIT) {
      if (kt + KSPLIT < KT) load_tile<NG, NT>(t1, ce, se, x, kt + KSPLIT, N, n0, gid, tig, m0, end, stride_w);
      tile_products<NG, NT>(acc, t0, g);
      if (kt + KSPLIT < KT) {
        if (kt + 2 * KSPLIT < KT) load_tile<NG, NT>(t0, ce, se, x, kt + 2 * KSPLIT, N, n0, gid, tig, m0, end, stride_w);
        tile_products<NG, NT>(acc, t1, g);
      }
    }
    if (KSPLIT > 1) {  // the group's partials, summed by its first warp in part order
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < NG; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) partial[warp][(nt * NG + j) * 4 + i][lane] = acc[nt][j][i];
      QUADS_SYNCTHREADS();
      if (part == 0) {
#pragma unroll
        for (int p = 1; p < KSPLIT; ++p)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < NG; ++j)
#pragma unroll
              for (int i = 0; i < 4; ++i) acc[nt][j][i] += partial[warp + p][(nt * NG + j) * 4 + i][lane];
      }
      QUADS_SYNCTHREADS();  // the next pass writes the partials again
    }
    if (part != 0) continue;
    // acc[nt][j] = out^T tile: (c0, c1) = features gid of group j at rows 2 tig, 2 tig + 1; (c2, c3) = feature gid + 8
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const long long r = m0 + 8 * nt + 2 * tig + i;
        if (r < end) {
#pragma unroll
          for (int j = 0; j < NG; ++j) {
            const uint32_t v = bf16x2(acc[nt][j][i], acc[nt][j][2 + i]);  // features gid, gid + 8 of row r
            out16[r * N + n0 + 16 * j + gid] = (unsigned short)(v & 0xFFFFu);
            out16[r * N + n0 + 16 * j + 8 + gid] = (unsigned short)(v >> 16);
          }
        }
      }
  }
}

}  // namespace quads_w4a16

namespace quads_w4a16 {

// The decode alone (tests): codes int32 [E, KT, N, 8], scales int32 [E, KT, N], gscale fp32 [E] -> out BF16
// [E, N, 64 KT] (as 16-bit words), one thread per (expert, K tile, feature, block)
__global__ void decode_kernel(const uint32_t* __restrict__ codes, const uint32_t* __restrict__ scales,
                              const float* __restrict__ gscale, unsigned short* __restrict__ out, int E, int KT,
                              int N) {
#ifdef QUADS_OFFLINE_SASS
  int i;
  asm("mov.u32 %0, %%ctaid.x;" : "=r"(i));
  i = i * 128 + (int)__nvvm_read_ptx_sreg_tid_x();
#else
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
#endif
  if (i >= (long long)E * KT * N * 4) return;
  const int b = (int)(i % 4);
  const long long row = i / 4;  // (e, kt, n)
  const int n = (int)(row % N);
  const long long ekt = row / N;
  const int kt = (int)(ekt % KT);
  const int e = (int)(ekt / KT);
  const U2 w = *reinterpret_cast<const U2*>(codes + row * 8 + 2 * b);
  uint32_t p[8];
  decode_block(w.x, w.y, (scales[row] >> (8 * b)) & 0xFFu, gscale[e], p);
  unsigned short* dst = out + ((long long)e * N + n) * (64LL * KT) + 64 * kt + 16 * b;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    dst[2 * j] = (unsigned short)(p[j] & 0xFFFFu);
    dst[2 * j + 1] = (unsigned short)(p[j] >> 16);
  }
}

}  // namespace quads_w4a16
