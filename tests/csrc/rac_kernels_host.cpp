// RAC's CUDA kernels run on the host through cuda_host_shim.h: rac_operand.cuh's operand_kernel and rac_select.cuh's
// select_kernel, for tests/test_rac_operand_cuda.py and tests/test_rac_select_cuda.py to compare with their Triton
// twins and the reference on the CPU (the GPU tests compare the compiled kernels). Build:
// g++ -O1 -std=c++20 -pthread -ffp-contract=off -fPIC -shared -Wno-unknown-pragmas -I tests/csrc
//     -I quads/kernels/csrc tests/csrc/rac_kernels_host.cpp -o lib.so
#include "cuda_host_shim.h"

#include "rac_operand.cuh"

namespace {

template <int LOG_KP, int WARPS, typename T>
void run(const void* x, const long long* offs, void* out, float* g, float* r, long long* s, int M, int K, int n, int G,
         int zero_blocks) {
  host_launch((unsigned)(G + zero_blocks), WARPS * 32, [=] {
    quads_rac::operand_kernel<LOG_KP, WARPS, T, T>(static_cast<const T*>(x), offs, static_cast<T*>(out), g, r, s, M,
                                                   K, n, G, K);
  });
}

template <int LOG_KP, int WARPS>
void run_select(const float* r, const long long* group, long long* s, int* rank, float* gmax, int M, int K, int n, int G,
                bool per_token) {
  host_launch((unsigned)G, WARPS * 32,
              [=] { quads_rac::select_kernel<LOG_KP, WARPS>(r, group, s, rank, gmax, M, K, n, per_token); });
}

}  // namespace

extern "C" {

// r [M, K] fp32, group [M] int64 sorted (G: rows of no group) -> s [G, n], rank [G, K], gmax [G]; 0, or 1 for a
// (log_kp, warps) not instantiated here
int quads_rac_select_host(const float* r, const long long* group, long long* s, int* rank, float* gmax, int M, int K,
                          int n, int G, int log_kp, int warps, int per_token) {
#define QUADS_HOST_CASE(L, W)                                                \
  if (log_kp == L && warps == W) {                                           \
    run_select<L, W>(r, group, s, rank, gmax, M, K, n, G, per_token != 0);   \
    return 0;                                                                \
  }
  QUADS_HOST_CASE(6, 1)
  QUADS_HOST_CASE(8, 2)
  QUADS_HOST_CASE(8, 8)
#undef QUADS_HOST_CASE
  return 1;
}

// x [M, K] (fp32, or BF16 bits with bf16 != 0), offs [G + 1], out [M, 2, K] in x's type, g [M, 2], r [M, K] scratch,
// s [G, n]; returns 0, or 1 for a (log_kp, warps) not instantiated here
int quads_rac_operand_host(const void* x, const long long* offs, void* out, float* g, float* r, long long* s, int M,
                           int K, int n, int G, int log_kp, int warps, int zero_blocks, int bf16) {
#define QUADS_HOST_CASE(L, W)                                                                        \
  if (log_kp == L && warps == W) {                                                                   \
    if (bf16) {                                                                                      \
      run<L, W, __nv_bfloat16>(x, offs, out, g, r, s, M, K, n, G, zero_blocks);                      \
    } else {                                                                                         \
      run<L, W, float>(x, offs, out, g, r, s, M, K, n, G, zero_blocks);                              \
    }                                                                                                \
    return 0;                                                                                        \
  }
  QUADS_HOST_CASE(5, 1)   // 1 channel a thread
  QUADS_HOST_CASE(6, 1)   // 2
  QUADS_HOST_CASE(7, 1)   // 4
  QUADS_HOST_CASE(8, 1)   // 8
  QUADS_HOST_CASE(7, 2)
  QUADS_HOST_CASE(8, 4)
  QUADS_HOST_CASE(10, 16)  // the 1b gate_up config
#undef QUADS_HOST_CASE
  return 1;
}

}  // extern "C"
