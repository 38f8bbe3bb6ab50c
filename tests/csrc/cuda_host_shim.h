// Just enough of CUDA's programming model on the host to run a quads kernel's block code in a test: each block's
// threads as std::threads, __syncthreads as a block barrier, __shfl_xor_sync as an exchange through a warp's slots
// between two warp barriers, __shared__ variables as statics (the blocks run one after another). Correctness only:
// no timing means anything here. Used by tests/csrc/rac_kernels_host.cpp (g++ -std=c++20 -pthread).
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static

struct HostDim {
  unsigned x = 0;
};
inline thread_local HostDim threadIdx;
inline HostDim blockIdx, gridDim;

struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
inline __nv_bfloat16 __ushort_as_bfloat16(uint16_t b) { return {b}; }
inline float __bfloat162float(__nv_bfloat16 v) {
  const uint32_t u = (uint32_t)v.bits << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline long long __double_as_longlong(double d) {
  long long v;
  memcpy(&v, &d, 8);
  return v;
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}

namespace host_shim {
struct Warp {
  std::barrier<> bar{32};
  uint64_t slot[32];
};
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<std::unique_ptr<Warp>> warps;
}  // namespace host_shim

inline void __syncthreads() { host_shim::block_barrier->arrive_and_wait(); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "a register-sized value");
  host_shim::Warp& w = *host_shim::warps[threadIdx.x >> 5];
  const unsigned lane = threadIdx.x & 31;
  uint64_t b = 0;
  memcpy(&b, &v, sizeof(T));
  w.slot[lane] = b;
  w.bar.arrive_and_wait();
  const uint64_t got = w.slot[lane ^ (unsigned)lane_mask];
  w.bar.arrive_and_wait();
  T out;
  memcpy(&out, &got, sizeof(T));
  return out;
}

// Runs `block()` for every block of the grid, one block at a time, with `threads` threads (a multiple of 32).
template <class F>
void host_launch(unsigned grid, unsigned threads, F block) {
  gridDim.x = grid;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    std::barrier<> bar((std::ptrdiff_t)threads);
    host_shim::block_barrier = &bar;
    host_shim::warps.clear();
    for (unsigned w = 0; w < threads / 32; ++w) host_shim::warps.push_back(std::make_unique<host_shim::Warp>());
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&block, t] {
        threadIdx.x = t;
        block();
      });
    }
    for (auto& th : pool) th.join();
  }
}
