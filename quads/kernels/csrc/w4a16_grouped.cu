// PyTorch binding of the CUDA grouped W4A16 decode kernel (w4a16_grouped.cuh), built on first use by
// quads/kernels/w4a16_cuda.py (torch.utils.cpp_extension.load, sm_90). Registers the ops
// quads_cuda::w4a16_grouped_decode and quads_cuda::w4a16_decode (CUDA only); the launcher checks shapes.
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "w4a16_grouped.cuh"

namespace {

template <int NG, int NT, int WARPS, int KSPLIT>
void launch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& gscale,
            const at::Tensor& ends, at::Tensor& out, int64_t n, int64_t k) {
  const int E = (int)codes.size(0);
  const dim3 grid((unsigned)(n / (16 * NG * (WARPS / KSPLIT))), (unsigned)(E + 1));
  quads_w4a16::grouped_decode_kernel<NG, NT, WARPS, KSPLIT><<<grid, WARPS * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(x.data_ptr()), reinterpret_cast<const uint32_t*>(codes.data_ptr()),
      reinterpret_cast<const uint32_t*>(scales.data_ptr()), gscale.data_ptr<float>(), ends.data_ptr<int>(),
      reinterpret_cast<uint32_t*>(out.data_ptr()), (int)x.size(0), (int)n, (int)k, E, (long long)x.stride(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor grouped_decode(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& gscale, const at::Tensor& ends, int64_t n, int64_t k, int64_t ng,
                          int64_t nt, int64_t warps, int64_t ksplit) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, "x: BF16 [T, K] rows");
  TORCH_CHECK(k % 64 == 0 && x.size(1) == k && x.stride(0) % 8 == 0, "K a multiple of 64, rows 16-byte aligned");
  TORCH_CHECK(codes.scalar_type() == at::kInt && codes.is_contiguous() && scales.is_contiguous(), "packed layout");
  TORCH_CHECK(ksplit >= 1 && warps % ksplit == 0 && n % (16 * ng * (warps / ksplit)) == 0,
              "N a multiple of 16 ng (warps / ksplit)");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
#define QUADS_CASE(NG, NT, W, KS)                                                  \
  if (ng == NG && nt == NT && warps == W && ksplit == KS) {                        \
    launch<NG, NT, W, KS>(x, codes, scales, gscale, ends, out, n, k);              \
    return out;                                                                    \
  }
  // the instantiations: w4a16_cuda.CONFIGS, the same list
  QUADS_CASE(1, 2, 4, 1)
  QUADS_CASE(2, 1, 4, 1)
  QUADS_CASE(2, 2, 4, 1)
  QUADS_CASE(2, 4, 4, 1)
  QUADS_CASE(4, 2, 4, 1)
  QUADS_CASE(2, 2, 8, 1)
  QUADS_CASE(2, 1, 4, 4)
  QUADS_CASE(2, 2, 4, 4)
  QUADS_CASE(2, 4, 4, 4)
  QUADS_CASE(1, 4, 4, 4)
  QUADS_CASE(2, 2, 4, 2)
  QUADS_CASE(2, 4, 8, 4)
#undef QUADS_CASE
  TORCH_CHECK(false, "w4a16_grouped_decode: no instantiation for ng=", ng, " nt=", nt, " warps=", warps, " ksplit=",
              ksplit);
}

at::Tensor decode(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& gscale) {
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kInt && codes.is_contiguous(), "codes [E, KT, N, 8]");
  const c10::cuda::CUDAGuard guard(codes.device());
  const int E = (int)codes.size(0), KT = (int)codes.size(1), N = (int)codes.size(2);
  auto out = at::empty({E, N, 64LL * KT}, codes.options().dtype(at::kBFloat16));
  const long long threads = (long long)E * KT * N * 4;
  if (threads == 0) return out;
  quads_w4a16::decode_kernel<<<(unsigned)((threads + 127) / 128), 128, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(codes.data_ptr()), reinterpret_cast<const uint32_t*>(scales.data_ptr()),
      gscale.data_ptr<float>(), reinterpret_cast<unsigned short*>(out.data_ptr()), E, KT, N);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY(quads_cuda, m) {
  m.def("w4a16_grouped_decode(Tensor x, Tensor codes, Tensor scales, Tensor gscale, Tensor ends, int n, int k, "
        "int ng, int nt, int warps, int ksplit) -> Tensor");
  m.def("w4a16_decode(Tensor codes, Tensor scales, Tensor gscale) -> Tensor");
}

TORCH_LIBRARY_IMPL(quads_cuda, CUDA, m) {
  m.impl("w4a16_grouped_decode", &grouped_decode);
  m.impl("w4a16_decode", &decode);
}
