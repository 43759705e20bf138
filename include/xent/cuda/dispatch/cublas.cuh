// The caller's cuBLAS handle as a call uses it, and the GEMM call of the fused linear paths.
//
// GEMMs: bf16 / fp16 inputs with CUBLAS_COMPUTE_32F; float inputs with CUBLAS_COMPUTE_32F_PEDANTIC,
// so a handle whose math mode allows TF32 still computes float GEMMs in float (TF32 is not
// offered). For the call's duration the handle's math mode also disallows reduced-precision
// split-K reductions (cuBLAS's default allows them when C is bf16 / fp16), so every sum is float
// until its one rounding; the mode is restored after.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../cuda.cuh"
#include "../runtime.cuh"

namespace xent {

/// A cuBLAS call failed while enqueueing work.
class cublas_error : public std::runtime_error {
 public:
  cublas_error(const char* fn, cublasStatus_t s)
      : std::runtime_error(std::string(fn) + ": cuBLAS error: " + cublasGetStatusString(s)),
        code_(s) {}
  cublasStatus_t code() const noexcept { return code_; }

 private:
  cublasStatus_t code_;
};

namespace cuda_detail {

inline void check_cublas(const char* fn, cublasStatus_t s) {
  if (s != CUBLAS_STATUS_SUCCESS) throw cublas_error(fn, s);
}

template <class T>
constexpr cudaDataType_t cublas_type() {
  if constexpr (std::is_same<T, float>::value)
    return CUDA_R_32F;
  else if constexpr (std::is_same<T, __nv_bfloat16>::value)
    return CUDA_R_16BF;
  else
    return CUDA_R_16F;
}

/// The handle set up for a call: bound to exec.stream with host-side alpha / beta, no atomics and
/// no reduced-precision split-K sums, the caller's stream and modes restored when the call ends
/// (also by an exception). A handle bound to another stream than exec.stream is rebound, which
/// resets a workspace given by cublasSetWorkspace to cuBLAS's own (cuBLAS's rule): bind the
/// handle to the call's stream to keep one.
class cublas_scope {
 public:
  cublas_scope(const char* fn, const cuda& exec) : fn_(fn), handle_(exec.cublas) {
    check_cublas(fn, cublasGetStream(handle_, &stream_));
    check_cublas(fn, cublasGetPointerMode(handle_, &mode_));
    if (stream_ != exec.stream) check_cublas(fn, cublasSetStream(handle_, exec.stream));
    restore_stream_ = stream_ != exec.stream;
    if (mode_ != CUBLAS_POINTER_MODE_HOST)
      check_cublas(fn, cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
    // Split-K partial sums stay in float even when C is bf16 / fp16 (a one-chunk d_weight GEMM
    // writes d_weight directly; the float accumulation xent promises must hold there too).
    // Deterministic sums whatever the caller's handle allows (a new handle's default).
    check_cublas(fn, cublasGetAtomicsMode(handle_, &atomics_));
    if (atomics_ != CUBLAS_ATOMICS_NOT_ALLOWED)
      check_cublas(fn, cublasSetAtomicsMode(handle_, CUBLAS_ATOMICS_NOT_ALLOWED));
    check_cublas(fn, cublasGetMathMode(handle_, &math_));
    if (!(math_ & CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION))
      check_cublas(fn, cublasSetMathMode(
                           handle_, static_cast<cublasMath_t>(
                                        math_ | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  }
  ~cublas_scope() {  // no throwing from here: a failure to restore leaves the handle as it is
    if (restore_stream_) cublasSetStream(handle_, stream_);
    if (mode_ != CUBLAS_POINTER_MODE_HOST) cublasSetPointerMode(handle_, mode_);
    if (atomics_ != CUBLAS_ATOMICS_NOT_ALLOWED) cublasSetAtomicsMode(handle_, atomics_);
    if (!(math_ & CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION))
      cublasSetMathMode(handle_, math_);
  }
  cublas_scope(const cublas_scope&) = delete;
  cublas_scope& operator=(const cublas_scope&) = delete;

  cublasHandle_t handle() const { return handle_; }
  const char* fn() const { return fn_; }

 private:
  const char* fn_;
  cublasHandle_t handle_;
  cudaStream_t stream_ = nullptr;
  cublasPointerMode_t mode_ = CUBLAS_POINTER_MODE_HOST;
  cublasMath_t math_ = CUBLAS_DEFAULT_MATH;
  cublasAtomicsMode_t atomics_ = CUBLAS_ATOMICS_NOT_ALLOWED;
  bool restore_stream_ = false;
};

/// C (m x n, column-major, ldc) = op_a(A) · op_b(B) + beta C with A and B of dtype AB and C of
/// dtype `c_type`, accumulated in float. Row-major views are column-major transposes, so the
/// callers below pass row-major operands with their roles swapped.
template <class AB>
void gemm(const cublas_scope& blas, cudaStream_t stream, cublasOperation_t op_a,
          cublasOperation_t op_b, std::int64_t m, std::int64_t n, std::int64_t k, const AB* a,
          std::int64_t lda, const AB* b, std::int64_t ldb, float beta, void* c,
          cudaDataType_t c_type, std::size_t c_size, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // no products (D = 0): C = beta C; cuBLAS is not asked about empty inner sums
    if (beta == 0.0f)
      check_cuda(blas.fn(), cudaMemset2DAsync(c, static_cast<std::size_t>(ldc) * c_size, 0,
                                              static_cast<std::size_t>(m) * c_size,
                                              static_cast<std::size_t>(n), stream));
    return;
  }
  const float alpha = 1.0f;
  const cublasComputeType_t compute =
      std::is_same<AB, float>::value ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  auto i = [](std::int64_t v) { return static_cast<int>(std::max<std::int64_t>(v, 1)); };
  check_cublas(blas.fn(), cublasGemmEx(blas.handle(), op_a, op_b, i(m), i(n), i(k), &alpha, a,
                                       cublas_type<AB>(), i(lda), b, cublas_type<AB>(), i(ldb),
                                       &beta, c, c_type, i(ldc), compute, CUBLAS_GEMM_DEFAULT));
}

/// Zeroes a rows x cols matrix of G with leading dimension ld (0 bits are 0 in every dtype).
template <class G>
void zero_matrix(const char* fn, G* data, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                 cudaStream_t stream) {
  if (!data || rows == 0 || cols == 0) return;
  check_cuda(fn, cudaMemset2DAsync(data, sizeof(G) * static_cast<std::size_t>(ld), 0,
                                   sizeof(G) * static_cast<std::size_t>(cols),
                                   static_cast<std::size_t>(rows), stream));
}

}  // namespace cuda_detail
}  // namespace xent
