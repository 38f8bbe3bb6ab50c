// PyTorch binding of RAC's CUDA channel selection (rac_select.cuh), built on first use by
// quads/kernels/rac_select_cuda.py (torch.utils.cpp_extension.load). Registers quads_rac_cuda::rac_select (CUDA
// only), which writes S, rank and gmax in place, as rac_select.py's _rac_select_kernel does.
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "rac_select.cuh"

namespace {

template <int LOG_KP, int WARPS>
void launch(const at::Tensor& r, const at::Tensor& group, at::Tensor& s, at::Tensor& rank, at::Tensor& gmax,
            int64_t n, int64_t groups, bool per_token) {
  quads_rac::select_kernel<LOG_KP, WARPS><<<(unsigned)groups, WARPS * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      r.data_ptr<float>(), reinterpret_cast<const long long*>(group.data_ptr<int64_t>()),
      reinterpret_cast<long long*>(s.data_ptr<int64_t>()), rank.data_ptr<int>(), gmax.data_ptr<float>(),
      (int)r.size(0), (int)r.size(1), (int)n, per_token);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rac_select(const at::Tensor& r, const at::Tensor& group, at::Tensor& s, at::Tensor& rank, at::Tensor& gmax,
                int64_t n, int64_t groups, bool per_token, int64_t warps) {
  TORCH_CHECK(r.scalar_type() == at::kFloat && r.dim() == 2 && r.is_contiguous(), "r: a contiguous fp32 [M, K]");
  const int64_t M = r.size(0), K = r.size(1);
  TORCH_CHECK(K % 16 == 0 && K <= 1024 && reinterpret_cast<uintptr_t>(r.data_ptr()) % 16 == 0,
              "K a multiple of 16 up to 1024, r 16-byte aligned");
  TORCH_CHECK(n > 0 && n <= K && n % 16 == 0 && groups >= 1, "0 < n <= K, n a multiple of 16, groups >= 1");
  TORCH_CHECK(group.scalar_type() == at::kLong && group.is_contiguous() && group.numel() == M, "group: int64 [M]");
  TORCH_CHECK(s.scalar_type() == at::kLong && s.is_contiguous() && s.numel() == groups * n, "s: int64 [G, n]");
  TORCH_CHECK(rank.scalar_type() == at::kInt && rank.is_contiguous() && rank.numel() == groups * K,
              "rank: int32 [G, K]");
  TORCH_CHECK(gmax.scalar_type() == at::kFloat && gmax.is_contiguous() && gmax.numel() >= groups,
              "gmax: fp32 [G]");
  const c10::cuda::CUDAGuard guard(r.device());
  int log_kp = 5;
  while ((1LL << log_kp) < K) ++log_kp;
#define QUADS_CASE(L, W)                                      \
  if (log_kp == L && warps == W) {                            \
    launch<L, W>(r, group, s, rank, gmax, n, groups, per_token); \
    return;                                                   \
  }
  // the instantiations: rac_select_cuda.CONFIGS, the same list (2^L / (32 W) pairs a thread: 1, 2, 4 or 8)
  QUADS_CASE(5, 1)
  QUADS_CASE(6, 1)
  QUADS_CASE(6, 2)
  QUADS_CASE(7, 1)
  QUADS_CASE(7, 2)
  QUADS_CASE(7, 4)
  QUADS_CASE(8, 1)
  QUADS_CASE(8, 2)
  QUADS_CASE(8, 4)
  QUADS_CASE(8, 8)
  QUADS_CASE(9, 2)
  QUADS_CASE(9, 4)
  QUADS_CASE(9, 8)
  QUADS_CASE(9, 16)
  QUADS_CASE(10, 4)
  QUADS_CASE(10, 8)
  QUADS_CASE(10, 16)
  QUADS_CASE(10, 32)
#undef QUADS_CASE
  TORCH_CHECK(false, "rac_select: no instantiation for K=", K, " (padded 2^", log_kp, ") warps=", warps);
}

}  // namespace

TORCH_LIBRARY(quads_rac_cuda, m) {
  m.def("rac_select(Tensor r, Tensor group, Tensor(a!) s, Tensor(b!) rank, Tensor(c!) gmax, int n, int groups, "
        "bool per_token, int warps) -> ()");
}

TORCH_LIBRARY_IMPL(quads_rac_cuda, CUDA, m) { m.impl("rac_select", &rac_select); }
