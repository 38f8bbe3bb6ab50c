// The decode step's whole W4A4 + RAC activation operand of rows sorted by group (expert) in one launch: what
// factored.operands computes with group_units (the W4A4 term), then rac_units' selection and units kernels (the RAC
// term), the same outputs bit for bit. One block per group g (its rows [offs[g], offs[g + 1]), thread t holding the
// channels [t E, (t + 1) E)), in four phases separated by block barriers:
//
//   A. the group amax: the NaN-ignoring max |x| over the group's rows (= the max of its rows' maxima, group_units'
//      amax), and its global scales (nvfp4_quant._global_scales);
//   B. row by row (ROWS rows' loads in flight): the canonical NVFP4 cast of each 16-channel block (the arithmetic of
//      nvfp4_quant._quantize_tile / _units_tile: a block spans 16 / E lanes, its amax and NaN flag by warp shuffles),
//      u = e2m1 * s into out[i, 0], S_dec into g[i, 0], the residual r = x - u * S_dec (no FMA) into the fp32 scratch
//      r[i], and the selection's fp64 norms and |r| maxima of the thread's channels, row by row in row order;
//   C. the selection of rac_select.cuh's select_kernel: the keys, the bitonic sort (sort_pairs), S[g] = the first n
//      channels, and the residual's amax gmax = the max over S of the |r| maxima (its global scales);
//   D. row by row: the gathered R[i, S] (thread t now holding sorted positions [t E, (t + 1) E): r[i, channel]),
//      the same NVFP4 cast over blocks of 16 consecutive positions, u scattered to its channel in out[i, 1] and 0 at
//      the channels of position >= n (every channel of the row written once), S_dec into g[i, 1].
//
// The blocks past the G groups write the rows of no group (rows [offs[G], M): the masked slots of a fixed-slot
// decode) as zero rows, u = 0 in both terms and S_dec = 1 (factored.operands' definition). The references are the
// Triton kernels (factored_quant.group_units, rac_select.rac_units) and through them the PyTorch steps of
// factored.operands; tests/test_rac_operand_cuda.py compares the outputs byte for byte on the GPU.
#pragma once

#include <cstdint>

#include "nvfp4_cast.cuh"
#include "rac_select.cuh"

namespace quads_rac {

// fp32 -> the output's element, RNE (BF16 by bits: nvfp4_cast.cuh's bf16_bits)
template <typename T>
__device__ __forceinline__ T to_out(float v);
template <>
__device__ __forceinline__ float to_out<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float v) {
  return __ushort_as_bfloat16(quads_nvfp4::bf16_bits(v));
}

// The canonical NVFP4 cast of a thread's E consecutive elements of one row, its 16-element block spread over 16 / E
// consecutive lanes (every lane of the warp calls it): u = e2m1 * s (nvfp4_quant._units_tile)
template <int E>
__device__ __forceinline__ void units_of(const float (&x)[E], float s_enc, float s_dec, float (&u)[E]) {
  constexpr int L = 16 / E;
  float bm = 0.f;  // the block's NaN-ignoring amax (fmaxf drops NaN; an all-NaN block gives 0, as the reference)
  int bn = 0;      // whether the block holds a NaN
#pragma unroll
  for (int e = 0; e < E; ++e) {
    bm = fmaxf(bm, fabsf(x[e]));
    bn |= x[e] != x[e];
  }
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) {
    bm = fmaxf(bm, __shfl_xor_sync(kFull, bm, o));
    bn |= __shfl_xor_sync(kFull, bn, o);
  }
  float enc, s16;
  quads_nvfp4::block_scale(bm, bn != 0, s_enc, s_dec, enc, s16);
#pragma unroll
  for (int e = 0; e < E; ++e) u[e] = quads_nvfp4::element_unit(x[e], enc, s16);
}

// Blocks [0, G): one group each; blocks [G, gridDim.x): the rows of no group, one row in (gridDim.x - G) each.
// x [M, K] (row stride stride_xm), offs [G + 1] int64 (each group's first row, then that of the rows of no group),
// out [M, 2, K], g [M, 2] fp32 (each term's S_dec), r [M, K] fp32 scratch, s_out [G, n] int64.
template <int LOG_KP, int WARPS, typename TX, typename TU>
__global__ void __launch_bounds__(WARPS * 32) operand_kernel(
    const TX* __restrict__ x, const long long* __restrict__ offs, TU* __restrict__ out, float* __restrict__ g2,
    float* __restrict__ r, long long* __restrict__ s_out, int M, int K, int n, int G,
    long long stride_xm) {
  constexpr int KP = 1 << LOG_KP;
  constexpr int T = WARPS * 32;
  constexpr int E = KP / T;  // channels (then sorted positions) per thread
  constexpr int ROWS = E >= 8 ? 8 : 16;  // rows whose loads are in flight together
  static_assert(E >= 1 && E <= 8 && (E & (E - 1)) == 0, "KP / threads must be 1, 2, 4 or 8");
  __shared__ long long sk[2][KP];
  __shared__ int si[2][KP];
  __shared__ float red[WARPS];
  __shared__ long long kth_key;
  __shared__ int kth_idx;

  const int t = threadIdx.x;
  const int c0 = t * E;
  const bool live = c0 < K;  // K a multiple of 16: a 16-block's lanes are all live or all padding
  const long long K2 = 2LL * K;

  if ((int)blockIdx.x >= G) {  // the rows of no group: zero rows
    const TU zero = to_out<TU>(0.f);
    for (long long i = offs[G] + (blockIdx.x - G); i < M; i += gridDim.x - G) {
      for (int c = t; c < K; c += T) {
        out[i * K2 + c] = zero;
        out[i * K2 + K + c] = zero;
      }
      if (t == 0) {
        g2[2 * i] = 1.f;
        g2[2 * i + 1] = 1.f;
      }
    }
    return;
  }
  const int g = blockIdx.x;
  const int start = (int)offs[g], end = (int)offs[g + 1];

  // A. the group amax and the W4A4 term's global scales
  float am = 0.f;
  for (int i0 = start; i0 < end; i0 += ROWS) {
    float v[ROWS][E];
    load_rows<ROWS, E, TX>(x, stride_xm, i0, end, c0, live, v);
#pragma unroll
    for (int q = 0; q < ROWS; ++q) {
#pragma unroll
      for (int e = 0; e < E; ++e) am = fmaxf(am, fabsf(v[q][e]));
    }
  }
  float s_enc, s_dec;
  quads_nvfp4::global_scales(block_max<WARPS>(am, red), s_enc, s_dec);

  // B. the W4A4 term, the residual, its norms and maxima
  double acc[E] = {};
  float cmax[E] = {};
  for (int i0 = start; i0 < end; i0 += ROWS) {
    float v[ROWS][E];
    load_rows<ROWS, E, TX>(x, stride_xm, i0, end, c0, live, v);
#pragma unroll
    for (int q = 0; q < ROWS; ++q) {
      const long long i = i0 + q;
      if (i0 + q >= end) break;  // uniform over the block
      float u[E];
      units_of<E>(v[q], s_enc, s_dec, u);
      if (live) {
        float rv[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          rv[e] = quads_nvfp4::sub(v[q][e], quads_nvfp4::mul(u[e], s_dec));
          out[i * K2 + c0 + e] = to_out<TU>(u[e]);
          r[i * K + c0 + e] = rv[e];
        }
        add_norms<E>(rv, acc, cmax);
      }
      if (t == 0) g2[2 * i] = s_dec;
    }
  }

  // C. the selection (select_kernel's steps 3-4); its barrier also makes phase B's scratch r visible to the block
  int idx[E];
  const float gm = select_channels<LOG_KP, WARPS, E>(acc, cmax, live, K, n, g, s_out, nullptr, true, idx, sk, si, red,
                                                     &kth_key, &kth_idx);
  float r_enc, r_dec;
  quads_nvfp4::global_scales(gm, r_enc, r_dec);

  // D. the RAC term: R[i, S] in selection order, scattered back to its channels
  const bool sel = c0 < n;  // n a multiple of 16: a 16-block of positions is all in S or all out
  for (int i0 = start; i0 < end; i0 += ROWS) {
    float v[ROWS][E];
#pragma unroll
    for (int q = 0; q < ROWS; ++q) {
#pragma unroll
      for (int e = 0; e < E; ++e) v[q][e] = sel && i0 + q < end ? r[(long long)(i0 + q) * K + idx[e]] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < ROWS; ++q) {
      const long long i = i0 + q;
      if (i0 + q >= end) break;  // uniform over the block
      float u[E];
      units_of<E>(v[q], r_enc, r_dec, u);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        if (idx[e] < K) out[i * K2 + K + idx[e]] = to_out<TU>(sel ? u[e] : 0.f);
      }
      if (t == 0) g2[2 * i + 1] = r_dec;
    }
  }
}

}  // namespace quads_rac
