// RAC's per-expert channel selection in CUDA: the drop-in for rac_select.py's _rac_select_kernel (the sort path,
// one run), the same outputs bit for bit. One block per group g (rows sorted by group, group [M] int64 in [0, G]):
//
//   1. the group's rows [start, end) counted over `group` (start = #{group < g}, end = #{group <= g});
//   2. norms[c] = the sum over those rows, ROW BY ROW in row order, of r[i, c]^2 in fp64 (each square of an fp32
//      value is exact in fp64, so an FMA gives the same sum), and cmax[c] = max |r[i, c]| with NaN ignored;
//   3. key[c] = the fp64 bits of norms[c] (NaN: one key above +inf; channels past K: -1, after every real one);
//      a bitonic sort of the KP (key, channel) pairs, key descending and equal keys by channel ascending
//      (torch.argsort(descending=True, stable=True)): pairs in registers, the exchanges of partners up to 32 E
//      positions apart by warp shuffles, farther ones through shared memory (double-buffered: one barrier a step);
//   4. S[g, p] = the channel at position p < n (int64), rank[g, c] = c's position (int32), and unless per_token
//      gmax[g] = max over S of cmax; the last group's block also gmax[G], the rows of no group [end, M) over S;
//   5. with `units` (out not null), also the work of the Triton units kernel _rac_units_sel_kernel for the
//      group's rows (and, in the last group's block, the rows of no group): each row's gathered R[i, S] in the
//      order of S, its amax (the row's own over S with per_token, else gmax of its group), the canonical NVFP4
//      cast of nvfp4_quant._quantize_tile / _units_tile in blocks of 16 positions of S (a block's 16 values are
//      held by 16 / E neighbouring threads, their max and NaN flag exchanged by shuffles), u = e2m1 * scale
//      stored to its channel in the output's dtype (BF16 by the bits, RNE, as cast_out), 0 outside S, and S_dec.
//
// The reference for each step is the Triton kernels (rac_select.py's module docstring) and, through them, the
// PyTorch reference factored.operands; tests/test_rac_select_cuda.py compares the outputs byte for byte.
#pragma once

#include <cstdint>
#include <cstring>

namespace quads_rac {

constexpr long long kNanKey = 0x7FF8000000000000LL;  // every NaN norm: above +inf (0x7FF0...)
constexpr unsigned kFull = 0xffffffffu;

// whether pair (ka, ia) comes before (kb, ib): key descending, equal keys by channel ascending (channels distinct)
__device__ __forceinline__ bool before(long long ka, int ia, long long kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// the max of v (>= 0, never NaN) over the block, in every thread; `red` holds WARPS floats
template <int WARPS>
__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  __syncthreads();  // red's last readers are done
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) v = fmaxf(v, red[w]);
  return v;
}

// E consecutive fp32 values at p (16 * E bytes aligned when E is 2 or 4: K a multiple of 16, c0 a multiple of E)
template <int E>
__device__ __forceinline__ void load_row(const float* p, float (&v)[E]) {
  if constexpr (E == 4) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  } else if constexpr (E == 2) {
    const float2 q = __ldg(reinterpret_cast<const float2*>(p));
    v[0] = q.x; v[1] = q.y;
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = __ldg(p + e);
  }
}

// The scalar steps of the cast, host and device (the host build is tests/csrc/rac_cast_host.cu's check on the CPU).
#define QUADS_HD __host__ __device__ __forceinline__

QUADS_HD int as_int(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_int(v);
#else
  int i;
  memcpy(&i, &v, 4);
  return i;
#endif
}

QUADS_HD float as_float(unsigned u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

QUADS_HD float div_rn(float a, float b) {  // IEEE division, round to nearest even
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// nvfp4_quant._global_scales: amax (fp32) -> (S_enc, S_dec)
QUADS_HD void global_scales(float amax, float& s_enc, float& s_dec) {
  s_enc = fminf(div_rn(2688.f, amax), 3.4028234663852886e38f);
  if (amax == 0.f || s_enc == 0.f) s_enc = 1.f;
  s_dec = div_rn(1.f, s_enc);
}

// _common.e4m3_rne: v in [0, 448] (no NaN) -> the E4M3 byte of v, round to nearest even; `val` its value
QUADS_HD int e4m3_rne(float v, float& val) {
  const int bits = as_int(v);
  const int rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576;
  const float sub = (v + 16384.f) - 16384.f;  // multiples of 2^-9 below 2^-6
  if (v < 0.015625f) {
    val = sub;
    return (int)(sub * 512.f);
  }
  val = as_float((unsigned)rb);
  return ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7);
}

// _common.e4m3_to_f32 of a byte of e4m3_rne or 0x7F (NaN, bits 0x7FC00000 as Triton's constant)
QUADS_HD float e4m3_value(int b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  if ((b & 0x7F) == 0x7F) return as_float(0x7FC00000u);
  return e == 0 ? (float)m * 0.001953125f : as_float((unsigned)(((e + 120) << 23) | (m << 20)));
}

// _common.e2m1_code_bits: y = x * enc (enc > 0) -> the 4-bit E2M1 code, RNE, sign from x, NaN x -> 0
QUADS_HD int e2m1_code(float y, float x) {
  const unsigned b = (unsigned)as_int(y) & 0x7FFFFFFFu;
  const float m = as_float(b);
  const int sub = as_int(m + 4194304.f) - 0x4A800000;
  const int nrm = (int)((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252;
  const int c = (m < 1.f ? sub : (nrm < 7 ? nrm : 7)) | ((as_int(x) >> 28) & 8);
  return x != x ? 0 : c;
}

// the signed E2M1 value of code c, times the block's scale: _common.e2m1_times_scale's product (exact, the same
// FMUL where the scale is NaN)
QUADS_HD float e2m1_times(int c, float scale) {
  const unsigned e = (c >> 1) & 3, m = c & 1;
  unsigned bits = e ? (((126u + e) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  bits |= (unsigned)(c & 8) << 28;
  return as_float(bits) * scale;
}

// one block of 16's cast (nvfp4_quant._quantize_tile): from its max |x| with NaN ignored (`bm`), whether it holds a
// NaN (`bn`) and its row's scales -> its E4M3 byte (0x7F for a NaN block), the byte's value `scale` and the factor
// `enc` its elements are multiplied by before their E2M1 rounding
QUADS_HD int block_cast(float bm, bool bn, float s_enc, float s_dec, float& scale, float& enc) {
  float s_val;
  const int b0 = e4m3_rne(fminf(bm * (s_enc * 0.16666667163372040f), 448.f), s_val);
  enc = fminf(div_rn(1.f, s_val * s_dec), 3.4028234663852886e38f);
  const int byte = bn ? 0x7F : b0;
  scale = e4m3_value(byte);
  return byte;
}

// an element's unit u = e2m1 * scale (the exact value; u * S_dec is the dequantized one)
QUADS_HD float unit(float x, float enc, float scale) { return e2m1_times(e2m1_code(x * enc, x), scale); }

// _common.f32_to_bf16_rne: fp32 -> BF16 bits, round to nearest even, NaN stays a quiet NaN
QUADS_HD unsigned short bf16_bits(float v) {
  const unsigned bits = (unsigned)as_int(v);
  const unsigned r = v != v ? (bits | 0x400000u) : bits + 0x7FFFu + ((bits >> 16) & 1u);
  return (unsigned short)(r >> 16);
}

// One block per group. Thread t holds positions [t E, (t + 1) E) of the KP pairs; before the sort, position c is
// channel c. ROWS: rows whose loads are issued together when summing the norms (the same sums in the same order).
template <int LOG_KP, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) select_kernel(
    const float* __restrict__ r, const long long* __restrict__ group, long long* __restrict__ s_out,
    int* __restrict__ rank_out, float* __restrict__ gmax, int M, int K, int n, int G, bool per_token,
    void* __restrict__ u_out, bool u_bf16, long long stride_um, float* __restrict__ s_dec_out) {
  constexpr int KP = 1 << LOG_KP;
  constexpr int T = WARPS * 32;
  constexpr int E = KP / T;  // pairs per thread
  constexpr int ROWS = E >= 8 ? 8 : 16;  // rows whose loads are in flight together: a latency chain of end - start rows / ROWS
  static_assert(E >= 1 && E <= 8 && (E & (E - 1)) == 0, "KP / threads must be 1, 2, 4 or 8");
  __shared__ long long sk[2][KP];  // the exchanges' pairs, position p at [p % E][p / E] (conflict-free reads)
  __shared__ int si[2][KP];
  __shared__ float red[WARPS];
  __shared__ int cnt[2][WARPS];
  __shared__ long long kth_key;
  __shared__ int kth_idx;
  constexpr int RB = E >= 2 ? 32 / E : 16;  // rows a units pass gathers together
  __shared__ float row_red[WARPS][RB];

  const int g = blockIdx.x;
  const int t = threadIdx.x;
  const int c0 = t * E;

  // 1. the group's rows
  int lo = 0, hi = 0;
  for (int i = t; i < M; i += T) {
    const long long v = group[i];
    lo += v < g;
    hi += v <= g;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo += __shfl_xor_sync(kFull, lo, o);
    hi += __shfl_xor_sync(kFull, hi, o);
  }
  if ((t & 31) == 0) {
    cnt[0][t >> 5] = lo;
    cnt[1][t >> 5] = hi;
  }
  __syncthreads();
  int start = 0, end = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    start += cnt[0][w];
    end += cnt[1][w];
  }

  // 2. norms and maxima, row by row in row order
  double acc[E];
  float cmax[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    acc[e] = 0.0;
    cmax[e] = 0.f;
  }
  const bool live = c0 < K;  // K a multiple of 16 >= E: a thread's channels are all real or all padding
  if (live) {
    for (int i0 = start; i0 < end; i0 += ROWS) {
      float v[ROWS][E];
#pragma unroll
      for (int q = 0; q < ROWS; ++q) {
        if (i0 + q < end) {
          load_row<E>(r + (long long)(i0 + q) * K + c0, v[q]);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) v[q][e] = 0.f;
        }
      }
#pragma unroll
      for (int q = 0; q < ROWS; ++q) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const double d = (double)v[q][e];
          acc[e] = acc[e] + d * d;  // d * d is exact in fp64: FMA or not, one rounding, the same sum
          cmax[e] = fmaxf(cmax[e], v[q][e] != v[q][e] ? 0.f : fabsf(v[q][e]));
        }
      }
    }
  }

  // 3. the sort
  long long key[E], okey[E];
  int idx[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    key[e] = !live ? -1LL : acc[e] != acc[e] ? kNanKey : __double_as_longlong(acc[e]);
    okey[e] = key[e];
    idx[e] = c0 + e;
  }
  int buf = 0;
#pragma unroll
  for (int s = 1; s <= LOG_KP; ++s) {
#pragma unroll
    for (int j = s - 1; j >= 0; --j) {
      const int D = 1 << j;  // partners D positions apart; runs of 2^s, ascending where bit s of p is 0
      if (D < E) {  // partner in this thread
#pragma unroll
        for (int e = 0; e < E; ++e) {
          if ((e & D) == 0) {
            const bool asc = (((c0 + e) >> s) & 1) == 0;
            if (before(key[e + D], idx[e + D], key[e], idx[e]) == asc) {
              const long long k2 = key[e];
              const int i2 = idx[e];
              key[e] = key[e + D];
              idx[e] = idx[e + D];
              key[e + D] = k2;
              idx[e + D] = i2;
            }
          }
        }
      } else {
        const int m = D / E;  // the partner thread is t ^ m
        if (m >= 32) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            sk[buf][e * T + t] = key[e];
            si[buf][e * T + t] = idx[e];
          }
          __syncthreads();
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
          long long pk;
          int pi;
          if (m < 32) {
            pk = __shfl_xor_sync(kFull, key[e], m);
            pi = __shfl_xor_sync(kFull, idx[e], m);
          } else {
            pk = sk[buf][e * T + (t ^ m)];
            pi = si[buf][e * T + (t ^ m)];
          }
          const int p = c0 + e;
          const bool want_first = ((p & D) == 0) == (((p >> s) & 1) == 0);  // the lower slot of an ascending run
          if (before(pk, pi, key[e], idx[e]) == want_first) {
            key[e] = pk;
            idx[e] = pi;
          }
        }
        if (m >= 32) buf ^= 1;  // the next exchange writes the other buffer: no second barrier
      }
    }
  }

  // 4. S, rank, gmax
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int p = c0 + e;
    if (p < n) s_out[(long long)g * n + p] = idx[e];
    if (idx[e] < K) rank_out[(long long)g * K + idx[e]] = p;
    if (p == n - 1) {
      kth_key = key[e];
      kth_idx = idx[e];
    }
  }
  __syncthreads();
  float gm = 0.f, gmm = 0.f;  // the group's and the rows of no group's amax of R[:, S] (not per_token)
  bool sel[E];
  if (!per_token) {
    const long long kk = kth_key;
    const int ki = kth_idx;
    float mine = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int c = c0 + e;
      sel[e] = c < K && (okey[e] > kk || (okey[e] == kk && c <= ki));
      if (sel[e]) mine = fmaxf(mine, cmax[e]);
    }
    gm = block_max<WARPS>(mine, red);
    if (t == 0) gmax[g] = gm;
    if (g == G - 1) {  // the rows of no group [end, M) (group G) take this group's S
      float mm = 0.f;
      if (live) {
        for (int i = end; i < M; ++i) {
          float v[E];
          load_row<E>(r + (long long)i * K + c0, v);
#pragma unroll
          for (int e = 0; e < E; ++e) {
            if (sel[e]) mm = fmaxf(mm, v[e] != v[e] ? 0.f : fabsf(v[e]));
          }
        }
      }
      gmm = block_max<WARPS>(mm, red);
      if (t == 0) gmax[G] = gmm;
    }
  }
  if (u_out == nullptr) return;

  // 5. the units of the group's rows [start, end) and, in the last group's block, of the rows of no group
  const int last = g == G - 1 ? M : end;
  for (int i0 = start; i0 < last; i0 += RB) {
    float x[RB][E];
#pragma unroll
    for (int q = 0; q < RB; ++q) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int p = c0 + e;
        x[q][e] = (i0 + q < last && p < n) ? __ldg(r + (long long)(i0 + q) * K + idx[e]) : 0.f;
      }
    }
    float amax[RB];
    if (per_token) {  // the row's own max over S, NaN ignored
#pragma unroll
      for (int q = 0; q < RB; ++q) {
        float a = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) a = fmaxf(a, x[q][e] != x[q][e] ? 0.f : fabsf(x[q][e]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(kFull, a, o));
        amax[q] = a;
      }
      __syncthreads();  // row_red's last readers are done
      if ((t & 31) == 0) {
#pragma unroll
        for (int q = 0; q < RB; ++q) row_red[t >> 5][q] = amax[q];
      }
      __syncthreads();
#pragma unroll
      for (int q = 0; q < RB; ++q) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) a = fmaxf(a, row_red[w][q]);
        amax[q] = a;
      }
    } else {
#pragma unroll
      for (int q = 0; q < RB; ++q) amax[q] = i0 + q < end ? gm : gmm;
    }
#pragma unroll
    for (int q = 0; q < RB; ++q) {
      const int i = i0 + q;
      float s_enc, s_dec;
      global_scales(amax[q], s_enc, s_dec);
      if (t == 0 && i < last) s_dec_out[i] = s_dec;
      // this thread's E positions lie in one block of 16: its max |x| (NaN ignored) and NaN flag over the block
      float bm = 0.f;
      int bn = 0;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        bm = fmaxf(bm, fabsf(x[q][e]));
        bn |= x[q][e] != x[q][e];
      }
#pragma unroll
      for (int o = 1; o < 16 / E; o <<= 1) {
        bm = fmaxf(bm, __shfl_xor_sync(kFull, bm, o));
        bn |= __shfl_xor_sync(kFull, bn, o);
      }
      float scale, enc;
      block_cast(bm, bn != 0, s_enc, s_dec, scale, enc);
      if (i < last) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int p = c0 + e;
          if (idx[e] >= K) continue;  // padding positions
          const float u = p < n ? unit(x[q][e], enc, scale) : 0.f;
          const long long off = (long long)i * stride_um + idx[e];
          if (u_bf16) {
            reinterpret_cast<unsigned short*>(u_out)[off] = bf16_bits(u);
          } else {
            reinterpret_cast<float*>(u_out)[off] = u;
          }
        }
      }
    }
  }
}

}  // namespace quads_rac
