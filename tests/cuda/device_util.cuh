// What the CUDA test executables share: the no-GPU skip, device buffers, and the rounding units
// their tolerances are made of.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

namespace xent_test {

inline std::string no_gpu_reason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(e);
  if (count == 0) return "no CUDA device";
  return {};
}

#define REQUIRE_GPU()                                              \
  do {                                                             \
    const std::string why = xent_test::no_gpu_reason();            \
    if (!why.empty()) GTEST_SKIP() << why << " (CUDA tests skip)"; \
  } while (0)

inline void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

/// The current device's multiprocessors: the batch sizes that reach a kernel's grid scale with it.
inline int sm_count() {
  int device = 0, sms = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  return sms;
}

/// A device buffer (on the device current at construction) with host mirror helpers.
template <class T>
struct dbuf {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit dbuf(std::size_t count = 0) : n(count) {
    if (n) {  // zero-filled: a workspace must be (see xent::cuda)
      EXPECT_EQ(cudaMalloc(&ptr, n * sizeof(T)), cudaSuccess);
      EXPECT_EQ(cudaMemset(ptr, 0, n * sizeof(T)), cudaSuccess);
    }
  }
  dbuf(const std::vector<T>& h) : dbuf(h.size()) { upload(h); }
  ~dbuf() { cudaFree(ptr); }
  dbuf(const dbuf&) = delete;
  void upload(const std::vector<T>& h) {
    EXPECT_EQ(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

template <class T>
double dbl(T v) {
  return static_cast<double>(static_cast<float>(v));
}

/// Half the spacing of the dtype's subnormals: the absolute rounding error of a tiny gradient.
template <class T>
double subnormal_half_step() {
  if (std::is_same<T, Eigen::half>::value) return std::ldexp(1.0, -25);
  if (std::is_same<T, Eigen::bfloat16>::value) return std::ldexp(1.0, -134);
  return std::ldexp(1.0, -150);
}

template <class T>
double unit_roundoff() {
  if (std::is_same<T, float>::value) return std::ldexp(1.0, -24);
  if (std::is_same<T, Eigen::bfloat16>::value) return std::ldexp(1.0, -8);
  return std::ldexp(1.0, -11);
}

/// The backend tests' tolerance for a gradient element of dtype T whose float64 value is `want`
/// and whose terms have magnitude `magnitude` (oracle::result::grad_magnitude): a rounding to T,
/// a few float ulps of the terms, half a subnormal step.
template <class T>
double gradient_tolerance(double want, double magnitude) {
  return 2 * unit_roundoff<T>() * std::fabs(want) +
         64 * std::ldexp(1.0, -24) * (magnitude + 1e-30) + subnormal_half_step<T>() + 1e-37;
}

}  // namespace xent_test
