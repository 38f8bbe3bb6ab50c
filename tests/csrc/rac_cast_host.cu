// The CUDA kernels' NVFP4 cast (quads/kernels/csrc/rac_select.cuh: global_scales, block_cast, unit, bf16_bits)
// compiled for the HOST by nvcc, so that the CPU test suite checks its numerics against the PyTorch reference
// (tests/test_rac_select_cuda.py::test_cuda_cast_on_the_host_is_the_reference_cast). The kernel runs the same
// functions; only the block max comes from warp shuffles there and from this loop here.
//
// stdin: int32 M, int32 K (a multiple of 16), fp32 x [M, K], fp32 amax [M]
// stdout: fp32 u [M, K] (e2m1 * scale), BF16 bits of u [M, K], fp32 S_dec [M]
#include <cmath>
#include <cstdio>
#include <vector>

#include "rac_select.cuh"

int main() {
  int m = 0, k = 0;
  if (fread(&m, 4, 1, stdin) != 1 || fread(&k, 4, 1, stdin) != 1 || m < 0 || k % 16) return 2;
  std::vector<float> x((size_t)m * k), amax(m), u((size_t)m * k), s_dec(m);
  std::vector<unsigned short> ub((size_t)m * k);
  if (fread(x.data(), 4, x.size(), stdin) != x.size() || fread(amax.data(), 4, m, stdin) != (size_t)m) return 2;
  for (int i = 0; i < m; ++i) {
    float s_enc;
    quads_rac::global_scales(amax[i], s_enc, s_dec[i]);
    for (int b = 0; b < k; b += 16) {
      const float* xb = &x[(size_t)i * k + b];
      float bm = 0.f;
      bool bn = false;
      for (int j = 0; j < 16; ++j) {
        bm = fmaxf(bm, fabsf(xb[j]));
        bn = bn || xb[j] != xb[j];
      }
      float scale, enc;
      quads_rac::block_cast(bm, bn, s_enc, s_dec[i], scale, enc);
      for (int j = 0; j < 16; ++j) {
        const size_t at = (size_t)i * k + b + j;
        u[at] = quads_rac::unit(xb[j], enc, scale);
        ub[at] = quads_rac::bf16_bits(u[at]);
      }
    }
  }
  fwrite(u.data(), 4, u.size(), stdout);
  fwrite(ub.data(), 2, ub.size(), stdout);
  fwrite(s_dec.data(), 4, s_dec.size(), stdout);
  return 0;
}
