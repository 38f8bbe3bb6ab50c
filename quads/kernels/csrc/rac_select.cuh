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
//      gmax[g] = max over S of cmax. The rows of no group (group G, the masked slots) are zero rows
//      (factored.operands): no block walks them, and the units kernel reads their amax as 0.
//
// The reference for each step is the Triton kernel (rac_select.py's module docstring) and, through it, the
// PyTorch reference factored.operands; tests/test_rac_select_cuda.py compares the outputs byte for byte.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)  // else a host shim provides the types (tests/csrc/cuda_host_shim.h)
#include <cuda_bf16.h>
#endif

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

// an element of an fp32 or BF16 input as fp32 (exact)
template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// E consecutive elements of x at p (aligned to E elements: K a multiple of 16, c0 a multiple of E)
template <int E, typename TX>
__device__ __forceinline__ void load_x(const TX* p, float (&v)[E]) {
  if constexpr (sizeof(TX) * E == 16) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const TX* h = reinterpret_cast<const TX*>(&q);
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = to_f32<TX>(h[e]);
  } else if constexpr (sizeof(TX) * E == 8) {
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
    const TX* h = reinterpret_cast<const TX*>(&q);
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = to_f32<TX>(h[e]);
  } else if constexpr (E > 1 && sizeof(TX) * E == 4) {  // two BF16; one element: the plain load below
    const unsigned q = __ldg(reinterpret_cast<const unsigned*>(p));
    const TX* h = reinterpret_cast<const TX*>(&q);
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = to_f32<TX>(h[e]);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = to_f32<TX>(p[e]);
  }
}

// Rows [i0, i0 + ROWS) of x (channels c0 .. c0 + E - 1, row stride stride_xm), their loads issued together; rows
// past `end`, and every row of a thread that is not `live`, as zeros
template <int ROWS, int E, typename TX>
__device__ __forceinline__ void load_rows(const TX* x, long long stride_xm, int i0, int end, int c0, bool live,
                                          float (&v)[ROWS][E]) {
#pragma unroll
  for (int q = 0; q < ROWS; ++q) {
    if (live && i0 + q < end) {
      load_x<E, TX>(x + (long long)(i0 + q) * stride_xm + c0, v[q]);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) v[q][e] = 0.f;
    }
  }
}

// One row's residuals v (the thread's E channels) into the selection's fp64 norms and NaN-ignoring |r| maxima (rows
// summed one after another in row order, the order every selection kernel sums them in)
template <int E>
__device__ __forceinline__ void add_norms(const float (&v)[E], double (&acc)[E], float (&cmax)[E]) {
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const double d = (double)v[e];
    acc[e] = acc[e] + d * d;  // d * d is exact in fp64: FMA or not, one rounding, the same sum
    cmax[e] = fmaxf(cmax[e], v[e] != v[e] ? 0.f : fabsf(v[e]));
  }
}

// The bitonic sort of a block's KP = 2^LOG_KP (key, channel) pairs, thread t holding positions [t E, (t + 1) E)
// (E = KP / (32 WARPS)), into key descending, equal keys by channel ascending (`before`): pairs in registers, the
// exchanges of partners up to 32 E positions apart by warp shuffles, farther ones through the shared buffers sk / si
// (double-buffered: one barrier a step). A caller that reuses sk / si after it needs a barrier first.
template <int LOG_KP, int WARPS, int E>
__device__ __forceinline__ void sort_pairs(long long (&key)[E], int (&idx)[E], long long (*sk)[1 << LOG_KP],
                                           int (*si)[1 << LOG_KP]) {
  constexpr int T = WARPS * 32;
  static_assert((1 << LOG_KP) == E * T, "KP = E pairs x 32 WARPS threads");
  const int t = threadIdx.x;
  const int c0 = t * E;
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
}

// A group's selection from its channels' fp64 norms acc and |r| maxima cmax (thread t holding channels [t E, (t + 1)
// E), `live` if they are real): the keys (NaN: kNanKey; padding: -1), the sort (`sort_pairs`; idx: the channel at each
// of the thread's positions after it), S[g, p] = the channel at position p < n into s_out, rank[g, c] = c's position
// into rank_out unless it is null, and, with `want_gmax`, the max over S of cmax in every thread (0 without). kth_key /
// kth_idx: two shared slots for the n-th pair, the threshold (c is in S iff its pair is not after it).
template <int LOG_KP, int WARPS, int E>
__device__ __forceinline__ float select_channels(const double (&acc)[E], const float (&cmax)[E], bool live, int K,
                                                 int n, int g, long long* s_out, int* rank_out, bool want_gmax,
                                                 int (&idx)[E], long long (*sk)[1 << LOG_KP], int (*si)[1 << LOG_KP],
                                                 float* red, long long* kth_key, int* kth_idx) {
  const int c0 = threadIdx.x * E;
  long long key[E], okey[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    key[e] = !live ? -1LL : acc[e] != acc[e] ? kNanKey : __double_as_longlong(acc[e]);
    okey[e] = key[e];
    idx[e] = c0 + e;
  }
  sort_pairs<LOG_KP, WARPS, E>(key, idx, sk, si);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int p = c0 + e;
    if (p < n) s_out[(long long)g * n + p] = idx[e];
    if (rank_out != nullptr && idx[e] < K) rank_out[(long long)g * K + idx[e]] = p;
    if (p == n - 1) {
      *kth_key = key[e];
      *kth_idx = idx[e];
    }
  }
  if (!want_gmax) return 0.f;  // uniform over the block
  __syncthreads();  // the n-th pair
  const long long kk = *kth_key;
  const int ki = *kth_idx;
  float mine = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int c = c0 + e;
    if (c < K && (okey[e] > kk || (okey[e] == kk && c <= ki))) mine = fmaxf(mine, cmax[e]);
  }
  return block_max<WARPS>(mine, red);
}

// One block per group. Thread t holds positions [t E, (t + 1) E) of the KP pairs; before the sort, position c is
// channel c. ROWS: rows whose loads are issued together when summing the norms (the same sums in the same order).
template <int LOG_KP, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) select_kernel(
    const float* __restrict__ r, const long long* __restrict__ group, long long* __restrict__ s_out,
    int* __restrict__ rank_out, float* __restrict__ gmax, int M, int K, int n, bool per_token) {
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
  double acc[E] = {};
  float cmax[E] = {};
  const bool live = c0 < K;  // K a multiple of 16 >= E: a thread's channels are all real or all padding
  if (live) {
    for (int i0 = start; i0 < end; i0 += ROWS) {
      float v[ROWS][E];
      load_rows<ROWS, E, float>(r, K, i0, end, c0, true, v);
#pragma unroll
      for (int q = 0; q < ROWS; ++q) add_norms<E>(v[q], acc, cmax);
    }
  }

  // 3-4. the sort; S, rank, gmax
  int idx[E];
  const float gm = select_channels<LOG_KP, WARPS, E>(acc, cmax, live, K, n, g, s_out, rank_out, !per_token, idx, sk,
                                                     si, red, &kth_key, &kth_idx);
  if (!per_token && t == 0) gmax[g] = gm;
}

}  // namespace quads_rac
