// What the CUDA test binaries share: the reason a test skips without a GPU, and a device buffer
// with host copies.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

namespace xt_cuda {

/// Empty when a CUDA device is usable, else why not.
inline std::string no_gpu_reason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(e);
  if (count == 0) return "no CUDA device";
  return {};
}

#define REQUIRE_GPU()                                              \
  do {                                                             \
    const std::string why = ::xt_cuda::no_gpu_reason();            \
    if (!why.empty()) GTEST_SKIP() << why << " (CUDA tests skip)"; \
  } while (0)

inline void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

/// A device buffer with host mirror helpers, zero-filled (a workspace must be: see xent::cuda).
template <class T>
struct dbuf {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit dbuf(std::size_t count = 0) : n(count) {
    if (n) {
      EXPECT_EQ(cudaMalloc(&ptr, n * sizeof(T)), cudaSuccess);
      EXPECT_EQ(cudaMemset(ptr, 0, n * sizeof(T)), cudaSuccess);
    }
  }
  dbuf(const std::vector<T>& h) : dbuf(h.size()) { upload(h); }  // NOLINT: a copy to the device
  ~dbuf() { cudaFree(ptr); }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  void upload(const std::vector<T>& h) {
    EXPECT_EQ(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

}  // namespace xt_cuda
