// PyTorch binding of the decode step's W4A4 + RAC operand in one launch (rac_operand.cuh), built on first use by
// quads/kernels/rac_operand_cuda.py (torch.utils.cpp_extension.load). Registers quads_rac_operand_cuda::rac_operand
// (CUDA only): writes out [M, 2, K] (u of the W4A4 term, then of the RAC term), g [M, 2] (their S_dec) and
// s [G, n] (each group's RAC channels, selection order) in place.
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "rac_operand.cuh"

namespace {

// T: the element type of x and of out (the same, checked below)
template <int LOG_KP, int WARPS, typename T>
void launch(const at::Tensor& x, const at::Tensor& offsets, at::Tensor& out, at::Tensor& g,
            at::Tensor& s, int64_t n, int64_t groups, int64_t zero_blocks) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor r = at::empty({M, K}, x.options().dtype(at::kFloat));  // the residual, phase B -> phase D
  quads_rac::operand_kernel<LOG_KP, WARPS, T, T>
      <<<(unsigned)(groups + zero_blocks), WARPS * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const long long*>(offsets.data_ptr<int64_t>()),
          reinterpret_cast<T*>(out.data_ptr()), g.data_ptr<float>(), r.data_ptr<float>(),
          reinterpret_cast<long long*>(s.data_ptr<int64_t>()), (int)M, (int)K, (int)n, (int)groups, x.stride(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int LOG_KP, int WARPS>
void dispatch_x(const at::Tensor& x, const at::Tensor& offsets, at::Tensor& out, at::Tensor& g,
                at::Tensor& s, int64_t n, int64_t groups, int64_t zero_blocks) {
  if (x.scalar_type() == at::kFloat) {
    launch<LOG_KP, WARPS, float>(x, offsets, out, g, s, n, groups, zero_blocks);
  } else {
    launch<LOG_KP, WARPS, __nv_bfloat16>(x, offsets, out, g, s, n, groups, zero_blocks);
  }
}

void rac_operand(const at::Tensor& x, const at::Tensor& offsets, at::Tensor& out, at::Tensor& g,
                 at::Tensor& s, int64_t n, int64_t groups, int64_t warps, int64_t zero_blocks) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: fp32 or bf16 [M, K], unit stride along K");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 16 == 0 && K <= 1024 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  (x.stride(0) * x.element_size()) % 16 == 0,
              "K a multiple of 16 up to 1024, x's rows 16-byte aligned");
  TORCH_CHECK(n > 0 && n <= K && n % 16 == 0 && groups >= 1 && zero_blocks >= 1,
              "0 < n <= K, n a multiple of 16, groups >= 1, zero_blocks >= 1");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() == groups + 1,
              "offsets: int64 [G + 1]");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && out.size(0) == M && out.size(1) == 2 && out.size(2) == K &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == x.scalar_type(),
              "out: contiguous [M, 2, K] of x's dtype");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.is_contiguous() && g.numel() == 2 * M, "g: fp32 [M, 2]");
  TORCH_CHECK(s.scalar_type() == at::kLong && s.is_contiguous() && s.numel() == groups * n, "s: int64 [G, n]");
  const c10::cuda::CUDAGuard guard(x.device());
  int log_kp = 5;
  while ((1LL << log_kp) < K) ++log_kp;
#define QUADS_CASE(L, W)                                                           \
  if (log_kp == L && warps == W) {                                                 \
    dispatch_x<L, W>(x, offsets, out, g, s, n, groups, zero_blocks);          \
    return;                                                                        \
  }
  // the instantiations: rac_operand_cuda.CONFIGS, the same list (2^L / (32 W) channels a thread: 1, 2, 4 or 8)
  QUADS_CASE(5, 1)
  QUADS_CASE(6, 1)
  QUADS_CASE(7, 2)
  QUADS_CASE(8, 2)
  QUADS_CASE(8, 4)
  QUADS_CASE(8, 8)
  QUADS_CASE(9, 8)
  QUADS_CASE(10, 8)
  QUADS_CASE(10, 16)
#undef QUADS_CASE
  TORCH_CHECK(false, "rac_operand: no instantiation for K=", K, " (padded 2^", log_kp, ") warps=", warps);
}

}  // namespace

TORCH_LIBRARY(quads_rac_operand_cuda, m) {
  m.def("rac_operand(Tensor x, Tensor offsets, Tensor(a!) out, Tensor(b!) g, Tensor(c!) s, int n, int groups, "
        "int warps, int zero_blocks) -> ()");
}

TORCH_LIBRARY_IMPL(quads_rac_operand_cuda, CUDA, m) { m.impl("rac_operand", &rac_operand); }
