// The CUDA kernels' NVFP4 cast (quads/kernels/csrc/nvfp4_cast.cuh) compiled for the host, for
// tests/test_rac_operand_cuda.py to compare with the reference bit for bit on the CPU. Build:
// g++ -O2 -std=c++17 -ffp-contract=off -fPIC -shared -I quads/kernels/csrc tests/csrc/nvfp4_cast_host.cpp -o lib.so
#include <cmath>
#include <cstdint>

#include "nvfp4_cast.cuh"

extern "C" {

// Rows x [M, K] (K a multiple of 16) with a global amax per row (>= 0, not NaN) -> u = e2m1 * s [M, K] (fp32 and
// its BF16 bits), S_dec [M] and the residual r = x - u * S_dec [M, K]: the per-element work of the kernels, each
// block's amax and NaN flag taken by a loop here (by warp shuffles there).
void quads_units_rows(const float* x, const float* amax, int M, int K, float* u, uint16_t* u_bf16, float* g,
                      float* r) {
  using namespace quads_nvfp4;
  for (int i = 0; i < M; ++i) {
    float s_enc, s_dec;
    global_scales(amax[i], s_enc, s_dec);
    g[i] = s_dec;
    for (int b = 0; b < K; b += 16) {
      const float* xb = x + (long long)i * K + b;
      float bm = 0.f;
      bool has_nan = false;
      for (int j = 0; j < 16; ++j) {
        bm = std::fmax(bm, std::fabs(xb[j]));  // NaN-ignoring
        has_nan |= xb[j] != xb[j];
      }
      float enc, s16;
      block_scale(bm, has_nan, s_enc, s_dec, enc, s16);
      for (int j = 0; j < 16; ++j) {
        const long long o = (long long)i * K + b + j;
        u[o] = element_unit(xb[j], enc, s16);
        u_bf16[o] = bf16_bits(u[o]);
        r[o] = sub(xb[j], mul(u[o], s_dec));
      }
    }
  }
}

// v [n] in [0, 448] -> e4m3(v) RNE as fp32 and its byte
void quads_e4m3_rne(const float* v, int n, float* val, int* byte) {
  for (int i = 0; i < n; ++i) val[i] = quads_nvfp4::e4m3_rne(v[i], byte[i]);
}

}  // extern "C"
