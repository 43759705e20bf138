// linear_traits<cuda>: fused linear cross-entropy on the GPU, with the caller's cuBLAS handle.
//
// Rows are taken a chunk at a time (as many as the workspace holds, linear_plan.cuh). Before the
// chunks one small kernel sums the mean's normaliser W over the whole call and writes each row's
// upstream gradient (scale / W for mean, scale for sum) on the device, so nothing waits on the
// host. For a chunk X_c of hidden rows, every step on exec.stream:
//   1. L = X_c · Wᵀ (+ b) by cublasGemmEx into the workspace, in the inputs' dtype T with float
//      accumulation (tensor cores for bf16 / fp16). Logits in T, as PyTorch eager keeps them:
//      half the bytes of float logits for the core to read and write and for chunk room, and the
//      gradient GEMMs take their tensor-core inputs in T anyway. The cost is one rounding of each
//      logit to T; the core then works in float on those values. The bias, when given, is
//      broadcast into L first and the GEMM adds to it (beta = 1): one rounding of the sum;
//   2. the cross-entropy core (backend_traits<cuda>) on L as reduction none with the rows'
//      upstream gradients, writing the logit gradient G over L in place (rounded once to T); the
//      loss math lives there only;
//   3. d_weight += Gᵀ · X_c with a float C (the caller's float d_weight, or the float accumulator
//      of dw_accumulation::fp32), or in d_weight's own dtype (dw_accumulation::output: rounded once
//      per chunk); d_bias += column sums of G in float; d_hidden rows = G · W with a float C,
//      rounded once into d_hidden when it is not float.
// Chunks have as many rows as the workspace holds; in training with the float d_weight accumulator
// and a 16-bit d_weight without row padding, the logits go in d_weight instead when it holds more
// rows (d_weight is written only after the last chunk; linear_logits_room says why it matters).
// The first chunk's GEMMs write (beta = 0) and later ones add (beta = 1), so nothing is zeroed
// first. After the chunks: the float accumulators are rounded into d_weight / d_bias, and one CTA
// sums the row losses (a fixed order: deterministic) into the reduced loss and counts num_correct.
//
// GEMMs: bf16 / fp16 inputs with CUBLAS_COMPUTE_32F; float inputs with CUBLAS_COMPUTE_32F_PEDANTIC,
// so a handle whose math mode allows TF32 still computes float GEMMs in float (TF32 is not
// offered). For the call's duration the handle's math mode also disallows reduced-precision
// split-K reductions (cuBLAS's default allows them when C is bf16 / fp16), so every sum is float
// until its one rounding; the mode is restored after.
//
// The forward on Hopper (sm_90a builds): bf16 calls without bias, label smoothing, softcap or
// argmax / num_correct take stats_gemm.cuh instead of steps 1-2, a GEMM whose epilogue keeps
// each row's max and sum of exponentials per 256 columns, so the logits are never written (its
// statistics are of the logits rounded to T, as this path's: the same losses up to the order of
// the sums).
//
// Training on Hopper (sm_90a builds, policy::scaled_probs): bf16 fused calls with the same
// options and no d_bias take scaled_probs.cuh instead of steps 1-2: the GEMM's epilogue stores
// each chunk's exp(z - ref) and row statistics, and steps 3 take each row's scale aside (the
// scaled hidden rows for d_weight, the scale in d_hidden's rounding), so no pass over the chunk's
// logits runs between the GEMMs.
//
// One chunk of every row: training with the float accumulator needs none when all the rows fit
// one chunk (linear_plan.cuh, plan_linear): its d_weight GEMM writes d_weight directly.
//
// Each chunk's steps run back to back on exec.stream. Running a chunk's cross-entropy pass on a
// caller-lent second stream beside the next chunk's GEMMs (two logits buffers of half the rows,
// events between the streams) was built and measured slower on every line, also at equal chunk size
// (H200: 8192 x 4096 x 128256 forward 13.19 -> 13.73 ms), likely because a GEMM leaves no room on
// an SM for a kernel beside it (not profiled).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../backend.hpp"
#include "../error.hpp"
#include "../linear/options.hpp"
#include "../linear/plan.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "backend.cuh"
#include "block/dtype.cuh"
#include "cuda.cuh"
#include "dispatch/accumulate_gemm.cuh"
#include "dispatch/linear_plan.cuh"
#include "dispatch/rows.cuh"
#include "dispatch/scaled_probs.cuh"
#include "dispatch/stats_gemm.cuh"
#include "kernels/linear_kernels.cuh"
#include "runtime.cuh"
#include "tuning/policy.cuh"

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

enum class linear_mode { forward, fused, backward };

/// One call: its operands (as device dtypes), its plan and the workspace's buffers.
template <class T, class G>
struct linear_call {
  using DT = device_t<T>;
  using DG = device_t<G>;
  static constexpr bool float_grads = std::is_same<DG, float>::value;

  const cuda& exec;
  const cublas_scope& blas;
  matrix_view<const DT> hidden, weight;
  const DT* bias;
  matrix_view<DG> d_hidden, d_weight;
  DG* d_bias;
  linear_plan plan;  ///< its buffers say how d_weight is summed (dw, dw_block)
  char* base;        ///< the workspace's first 256-byte-aligned address
  DT* logits_data;   ///< the chunk's logits: in the workspace, or in d_weight (plan.logits absent)

  std::int64_t rows() const { return hidden.rows; }
  std::int64_t dim() const { return hidden.cols; }
  std::int64_t vocab() const { return weight.rows; }
  template <class U>
  U* buffer(std::size_t offset) const {
    return offset == linear_absent ? nullptr : reinterpret_cast<U*>(base + offset);
  }
  DT* logits() const { return logits_data; }
  /// Hidden row r0's address. Hidden of no columns may have null data (validation accepts it as
  /// empty) and null + offset is undefined, so then every row is at `data`.
  const DT* hidden_row(std::int64_t r0) const { return dim() == 0 ? hidden.data : hidden.row(r0); }
  float* dw_accumulator() const { return buffer<float>(plan.dw); }
  /// d_bias's float accumulator: the caller's d_bias when G is float.
  float* db_sum() const {
    if (!d_bias) return nullptr;
    if constexpr (float_grads) {
      return d_bias;
    } else {
      return buffer<float>(plan.db);
    }
  }
};

/// Whether the Hopper GEMM (stats_gemm.cuh, form F, clusters of policy::stats_gemm_cluster)
/// takes this call's operands on its device: bf16 without bias, D a multiple of 8 and V within
/// int (no tensor map holds a dimension of 0: the cuBLAS path's logits are then the bias, or 0),
/// 16-byte aligned rows, and the kernel's sm_90a build running there (sg::ready).
template <stats_gemm::form F, class I, class T, class G>
bool hopper_gemm_fits(const linear_call<T, G>& c, const device_facts& dev) {
  const std::int64_t D = c.dim(), V = c.vocab();
  return !c.bias && D > 0 && D % 8 == 0 && D <= INT_MAX && V > 0 && V <= INT_MAX &&
         aligned16(c.hidden.data, c.hidden.ld * 2) && aligned16(c.weight.data, c.weight.ld * 2) &&
         tuning_for(dev.major).wgmma && stats_gemm::ready<F, I>(dev.id, policy::stats_gemm_cluster);
}

/// L = X_c · Wᵀ for the chunk's n rows starting at r0 by the Hopper GEMM's logits-storing form
/// (stats_gemm.cuh, policy::stats_gemm_logits), where it applies: bf16 operands without bias, D
/// a multiple of 8, 16-byte aligned operands, an sm_90 device running the kernel's sm_90a build.
/// False, enqueuing nothing, elsewhere.
template <class T, class G>
bool hopper_chunk_logits(const linear_call<T, G>& c, std::int64_t r0, std::int64_t n) {
  namespace sg = stats_gemm;
  using DT = typename linear_call<T, G>::DT;
  if constexpr (!std::is_same<DT, __nv_bfloat16>::value || !policy::stats_gemm ||
                !policy::stats_gemm_logits) {
    return false;
  } else {
    const char* fn = c.blas.fn();
    const device_facts dev = query_device(fn);
    // The chunk's logits buffer is 256-byte aligned with rows of whole 16-byte vectors.
    if (n > INT_MAX || !aligned16(c.logits(), c.plan.ld * 2) ||
        !hopper_gemm_fits<sg::form::logits, std::int64_t>(c, dev))
      return false;
    const auto a = sg::shape_args<std::int64_t>(n, c.vocab(), c.dim());
    sg::launch<sg::form::logits>(fn, c.hidden.row(r0), c.hidden.ld, c.weight.data, c.weight.ld, a,
                                 dev.sms, policy::stats_gemm_cluster, c.exec.stream, c.logits(),
                                 c.plan.ld);
    return true;
  }
}

/// L = X_c · Wᵀ (+ b) for the chunk's n rows starting at r0.
template <class T, class G>
void chunk_logits(const linear_call<T, G>& c, std::int64_t r0, std::int64_t n) {
  using DT = typename linear_call<T, G>::DT;
  const cudaStream_t s = c.exec.stream;
  if (hopper_chunk_logits(c, r0, n)) return;
  if (c.bias) launch_rows_kernel(fill_bias_op<DT>{c.logits(), c.plan.ld, c.bias}, n, c.vocab(), s);
  gemm(c.blas, s, CUBLAS_OP_T, CUBLAS_OP_N, c.vocab(), n, c.dim(), c.weight.data, c.weight.ld,
       c.hidden_row(r0), c.hidden.ld, c.bias ? 1.0f : 0.0f, c.logits(), cublas_type<DT>(),
       sizeof(DT), c.plan.ld);
}

/// d_weight += Gᵀ · X_c, d_bias += column sums of G, d_hidden rows = G · W. With `row_scale`
/// (the scaled-probabilities path, scaled_probs.cuh: no bias there) the chunk's buffer holds P'
/// and G = diag(row_scale) P': `x` (leading dimension ldx) is then the hidden rows already
/// scaled, and each d_hidden row takes its scale as it is rounded.
template <class T, class G>
void chunk_grads(const linear_call<T, G>& c, std::int64_t r0, std::int64_t n, bool first,
                 const typename linear_call<T, G>::DT* x, std::int64_t ldx,
                 const float* row_scale = nullptr) {
  using DT = typename linear_call<T, G>::DT;
  using DG = typename linear_call<T, G>::DG;
  const cudaStream_t s = c.exec.stream;
  const std::int64_t V = c.vocab(), D = c.dim(), ld = c.plan.ld;
  const DT* grad = c.logits();
  const float beta = first ? 0.0f : 1.0f;
  if (c.d_weight.data) {
    // The float V x D sum (dw_accumulation::fp32's accumulator with G not float, or a float
    // d_weight, its own accumulator), by cuBLASLt with the tile chosen for it where it offers one
    // (accumulate_gemm.cuh).
    float* acc = c.dw_accumulator();
    std::int64_t ld_acc = D;
    if constexpr (linear_call<T, G>::float_grads) {
      acc = c.d_weight.data;
      ld_acc = c.d_weight.ld;
    }
    bool added = false;
    if constexpr (policy::accumulate_by_lt && !std::is_same<DT, float>::value)
      added = acc && c.plan.dw_block == 0 && c.plan.lt_work != linear_absent &&
              accumulate_gemm(c.blas.handle(), s, cublas_type<DT>(), D, V, n, x, ldx, grad, ld,
                              beta, acc, ld_acc, c.template buffer<void>(c.plan.lt_work),
                              linear_lt_workspace);
    if (added) {
      // done
    } else if (acc && c.plan.dw_block == 0) {
      gemm(c.blas, s, CUBLAS_OP_N, CUBLAS_OP_T, D, V, n, x, ldx, grad, ld, beta, acc, CUDA_R_32F,
           sizeof(float), ld_acc);
    } else if (c.plan.dw_block == 0) {
      // dw_accumulation::output with G == T adds in G.
      gemm(c.blas, s, CUBLAS_OP_N, CUBLAS_OP_T, D, V, n, x, ldx, grad, ld, beta, c.d_weight.data,
           cublas_type<DG>(), sizeof(DG), c.d_weight.ld);
    } else {
      // dw_accumulation::output with G neither float nor T: a block of weight rows at a time.
      for (std::int64_t v0 = 0; v0 < V; v0 += c.plan.dw_block) {
        const std::int64_t nb = std::min(c.plan.dw_block, V - v0);
        gemm(c.blas, s, CUBLAS_OP_N, CUBLAS_OP_T, D, nb, n, x, ldx, grad + v0, ld, 0.0f, acc,
             CUDA_R_32F, sizeof(float), D);
        launch_rows_kernel(add_rounded_op<DG>{acc, D, c.d_weight.row(v0), c.d_weight.ld, first}, nb,
                           D, s);
      }
    }
  }
  if (float* db = c.db_sum()) {
    if (V > 0)
      column_sums_kernel<<<static_cast<unsigned>((V + linear_threads - 1) / linear_threads),
                           linear_threads, 0, s>>>(grad, ld, n, V, db, first);
  }
  if (c.d_hidden.data) {
    if constexpr (linear_call<T, G>::float_grads) {
      gemm(c.blas, s, CUBLAS_OP_N, CUBLAS_OP_N, D, n, V, c.weight.data, c.weight.ld, grad, ld, 0.0f,
           c.d_hidden.row(r0), CUDA_R_32F, sizeof(float), c.d_hidden.ld);
      if (row_scale) {
        float* dh = c.d_hidden.row(r0);
        launch_round(round_op<float>{dh, c.d_hidden.ld, dh, c.d_hidden.ld, row_scale}, n, D, s);
      }
    } else {
      // A float C, rounded once into d_hidden: cuBLAS may reduce split-K partial sums (K = V
      // here) in C's dtype when C is bf16 / fp16.
      float* dx = c.template buffer<float>(c.plan.dx);
      gemm(c.blas, s, CUBLAS_OP_N, CUBLAS_OP_N, D, n, V, c.weight.data, c.weight.ld, grad, ld, 0.0f,
           dx, CUDA_R_32F, sizeof(float), D);
      launch_round(round_op<DG>{dx, D, c.d_hidden.row(r0), c.d_hidden.ld, row_scale}, n, D, s);
    }
  }
  check_cuda(c.blas.fn(), cudaGetLastError());  // the small kernels' launches
}

/// After the chunks: the float accumulators rounded into d_weight and d_bias, or zeros when there
/// were no chunks (N = 0).
template <class T, class G>
void finish_grads(const linear_call<T, G>& c) {
  using DG = typename linear_call<T, G>::DG;
  const cudaStream_t s = c.exec.stream;
  const std::int64_t V = c.vocab(), D = c.dim();
  if (c.rows() == 0) {
    zero_matrix(c.blas.fn(), c.d_weight.data, V, D, c.d_weight.ld, s);
    zero_matrix(c.blas.fn(), c.d_bias, 1, V, V, s);
    return;
  }
  if constexpr (!linear_call<T, G>::float_grads) {
    if (c.d_weight.data && c.plan.dw_block == 0 && c.dw_accumulator())
      launch_round(round_op<DG>{c.dw_accumulator(), D, c.d_weight.data, c.d_weight.ld}, V, D, s);
    if (c.d_bias) launch_round(round_op<DG>{c.db_sum(), V, c.d_bias, V}, 1, V, s);
  }
  check_cuda(c.blas.fn(), cudaGetLastError());
}

/// Sizes cuBLAS takes as int.
inline void require_int(const char* fn, const char* arg, std::int64_t v) {
  if (v > INT_MAX)
    throw error(fn, arg,
                "has a size or leading dimension of " + std::to_string(v) +
                    ", more than cuBLAS's int (" + std::to_string(INT_MAX) + ")");
}

/// What a call checks before it enqueues anything: the caller's cuBLAS handle, and sizes cuBLAS
/// takes as int.
template <class T, class G>
void check_linear_call(const char* fn, const cuda& exec, matrix_view<const T> hidden,
                       matrix_view<const T> weight, const linear_grads<G>& grads,
                       const linear_plan& plan) {
  if (exec.cublas == nullptr)
    throw error(fn, "exec.cublas",
                "fused linear cross-entropy needs the caller's cuBLAS handle (cublasCreate); "
                "xent never creates one");
  require_int(fn, "weight", std::max({weight.rows, hidden.cols, weight.ld, plan.ld}));
  require_int(fn, "hidden", std::max({hidden.ld, plan.chunk_rows}));
  require_int(fn, "grads.d_weight", grads.d_weight.ld);
  require_int(fn, "grads.d_hidden", grads.d_hidden.ld);
}

/// A call over the caller's workspace `ws`, laid out by `plan` from its first 256-byte-aligned
/// address (the plan's bytes include the slack), its operands as device dtypes. A plan without
/// logits in the workspace puts them at d_weight's first 256-byte-aligned address
/// (linear_logits_room).
template <class T, class G>
linear_call<T, G> make_linear_call(const cuda& exec, const cublas_scope& blas,
                                   matrix_view<const T> hidden, matrix_view<const T> weight,
                                   vector_view<const T> bias, const linear_grads<G>& grads,
                                   const linear_plan& plan, void* ws) {
  using DT = device_t<T>;
  using DG = device_t<G>;
  const std::uintptr_t address = reinterpret_cast<std::uintptr_t>(ws);
  const std::uintptr_t aligned =
      (address + linear_alignment - 1) / linear_alignment * linear_alignment;
  char* const base = static_cast<char*>(ws) + (aligned - address);
  const auto dw = reinterpret_cast<std::uintptr_t>(grads.d_weight.data);
  DT* const logits = plan.logits != linear_absent
                         ? reinterpret_cast<DT*>(base + plan.logits)
                         : reinterpret_cast<DT*>((dw + linear_alignment - 1) / linear_alignment *
                                                 linear_alignment);
  return {exec,
          blas,
          {reinterpret_cast<const DT*>(hidden.data), hidden.rows, hidden.cols, hidden.ld},
          {reinterpret_cast<const DT*>(weight.data), weight.rows, weight.cols, weight.ld},
          reinterpret_cast<const DT*>(bias.data),
          {reinterpret_cast<DG*>(grads.d_hidden.data), grads.d_hidden.rows, grads.d_hidden.cols,
           grads.d_hidden.ld},
          {reinterpret_cast<DG*>(grads.d_weight.data), grads.d_weight.rows, grads.d_weight.cols,
           grads.d_weight.ld},
          reinterpret_cast<DG*>(grads.d_bias.data),
          plan,
          base,
          logits};
}

/// The whole call's bookkeeping around its chunks: the mean's W and the rows' upstream gradient
/// (written before the first chunk), and where the reduced loss and num_correct are summed from
/// after the last (the caller's per-row outputs, or the workspace's).
struct linear_totals {
  double* normalizer = nullptr;
  float* row_up = nullptr;  ///< mean / sum training: each chunk row's upstream gradient
  float* row_loss = nullptr;
  std::int64_t* argmax = nullptr;
  bool want_loss = false, want_correct = false;
};

/// Enqueues the prologue (linear_prologue_kernel) of a call over `rows` rows of `vocab` classes
/// (the whole vocabulary: class ids are checked and weighed against it): its W and, with `up`
/// for mean / sum, each chunk row's upstream gradient; and picks the per-row buffers of the
/// reduced outputs `out` asks for (null: a backward call).
template <class T, class G, class Tgt>
linear_totals start_totals(const char* fn, const linear_call<T, G>& c, Tgt targets,
                           std::int64_t rows, std::int64_t vocab, const linear_options& opts,
                           const upstream* up, const forward_outputs* out) {
  linear_totals t;
  t.normalizer = c.template buffer<double>(c.plan.scalars);
  if (up && opts.reduce != reduction::none) t.row_up = c.template buffer<float>(c.plan.row_up);
  linear_prologue_kernel<<<1, linear_threads, 0, c.exec.stream>>>(
      targets, rows, vocab, opts.ignore_index, opts.class_weights.data, opts.reduce, t.normalizer,
      up ? up->scale : 1.0f, up ? up->scale_ptr : nullptr, t.row_up,
      std::min(c.plan.chunk_rows, std::max<std::int64_t>(rows, 1)));
  check_cuda(fn, cudaGetLastError());
  if (!out) return t;
  t.want_loss = out->loss && opts.reduce != reduction::none;
  t.want_correct = out->num_correct != nullptr;
  t.row_loss = out->row_loss.data
                   ? out->row_loss.data
                   : (t.want_loss ? c.template buffer<float>(c.plan.row_loss) : nullptr);
  t.argmax = out->argmax.data
                 ? out->argmax.data
                 : (t.want_correct ? c.template buffer<std::int64_t>(c.plan.argmax) : nullptr);
  return t;
}

/// Rows [r0, r0 + n)'s upstream gradient for the core, which runs each chunk as reduction none:
/// the caller's per row (none), or the prologue's scalar / W (mean, sum).
inline upstream chunk_upstream(const upstream* up, const linear_options& opts,
                               const linear_totals& t, std::int64_t r0, std::int64_t n) {
  upstream u;
  if (up && opts.reduce == reduction::none) {
    u.scale = up->scale;
    u.rows = detail::rows_slice(up->rows, r0, n);
  } else if (up) {
    u.rows = {t.row_up, n};
  }
  return u;
}

/// The forward outputs of rows [r0, r0 + n) that the core (or a vocab-parallel merge) writes.
inline forward_outputs chunk_outputs(const forward_outputs& out, const linear_totals& t,
                                     std::int64_t r0, std::int64_t n) {
  forward_outputs o;
  if (t.row_loss) o.row_loss = {t.row_loss + r0, n};
  o.lse = detail::rows_slice(out.lse, r0, n);
  if (t.argmax) o.argmax = {t.argmax + r0, n};
  return o;
}

/// After the chunks: the reduced loss and num_correct from every row's loss and argmax.
template <class Tgt>
void finish_totals(const char* fn, cudaStream_t stream, const linear_totals& t, Tgt targets,
                   std::int64_t rows, std::int64_t vocab, const linear_options& opts,
                   const forward_outputs& out) {
  if (!t.want_loss && !t.want_correct) return;
  linear_finish_kernel<<<1, linear_threads, 0, stream>>>(
      targets, rows, vocab, opts.ignore_index, t.row_loss, t.argmax, t.normalizer, opts.reduce,
      t.want_loss ? out.loss : nullptr, t.want_correct ? out.num_correct : nullptr);
  check_cuda(fn, cudaGetLastError());
}

/// Whether a call's options are those the Hopper GEMM's row statistics cover (stats_forward and
/// the scaled-probabilities training): no label smoothing or softcap (class ids are the caller's
/// check), and no argmax asked for (num_correct).
inline bool plain_class_options(const linear_options& opts, const linear_totals& t) {
  return opts.label_smoothing == 0.0f && opts.softcap == 0.0f && !t.argmax;
}

/// The merge kernels' view of a call over V classes: the core's row arguments as reduction none,
/// with the call's class weights, loss constants, ignore index and error count; the caller sets
/// the rows, targets, outputs and upstream gradient of each launch.
template <class DT, class I, class T, class G>
row_args<DT, DT, class_ids<I>> merge_args(const linear_call<T, G>& c, const linear_options& opts) {
  const std::int64_t V = c.vocab();
  row_args<DT, DT, class_ids<I>> m{};
  m.cols = m.vocab = V;
  m.weights = opts.class_weights.data;
  m.k = make_loss_constants(opts, V, static_cast<float>(V));
  m.ignore_index = opts.ignore_index;
  m.reduce = reduction::none;
  m.error_count = c.exec.error_count;
  return m;
}

/// The forward by the Hopper GEMM whose epilogue keeps each row's statistics (stats_gemm.cuh),
/// where it applies: bf16 operands, class-id targets without label smoothing, softcap, bias or an
/// argmax asked for (num_correct), D a multiple of 8 and 16-byte aligned operands, on an sm_90
/// device running the kernel's sm_90a build (policy::stats_gemm). The row partials and target
/// logits go where the chunk logits would (the workspace's logits buffer), as many rows per
/// launch as they fit; the merge writes each row's loss and LSE as the core does, so the
/// reduced loss is formed after as on the cuBLAS path. The statistics are of the logits rounded
/// to bf16, as the cuBLAS path stores them and PyTorch eager has them. False, enqueuing nothing,
/// where the path does not apply.
template <class T, class G, class I>
bool stats_forward(const char* fn, const linear_call<T, G>& c, class_ids<I> targets,
                   const linear_options& opts, const linear_totals& t, const forward_outputs& out) {
  namespace sg = stats_gemm;
  using DT = typename linear_call<T, G>::DT;
  if constexpr (!std::is_same<DT, __nv_bfloat16>::value || !policy::stats_gemm) {
    return false;
  } else {
    const std::int64_t N = c.rows(), D = c.dim(), V = c.vocab();
    if (!plain_class_options(opts, t) || N == 0) return false;
    const device_facts dev = query_device(fn);
    if (!hopper_gemm_fits<sg::form::stats, I>(c, dev)) return false;
    const int col_tiles = static_cast<int>((V + sg::tile_n - 1) / sg::tile_n);
    const std::size_t room = sizeof(DT) * static_cast<std::size_t>(c.plan.chunk_rows) *
                             static_cast<std::size_t>(c.plan.ld);
    const std::size_t per_row = sizeof(sg::partial) * static_cast<std::size_t>(col_tiles) + 4;
    // Rows per launch: as many as the buffer holds, with the launch's rows and tile count in int.
    const std::int64_t most = std::min<std::int64_t>(
        {static_cast<std::int64_t>(room / per_row), INT_MAX / sg::tile_m * sg::tile_m,
         std::int64_t{INT_MAX} / col_tiles * sg::tile_m});
    if (most < 1) return false;
    // The merge's view of the call: outputs only (no reduction here).
    auto m = merge_args<DT, I>(c, opts);
    for (std::int64_t r0 = 0; r0 < N; r0 += most) {
      const std::int64_t n = std::min(most, N - r0);
      auto a = sg::shape_args<I>(n, V, D);
      a.targets = targets.ids + r0;
      a.partials = reinterpret_cast<sg::partial*>(c.logits());
      a.target_logit = reinterpret_cast<float*>(a.partials + n * col_tiles);
      sg::launch<sg::form::stats>(fn, c.hidden.data + r0 * c.hidden.ld, c.hidden.ld, c.weight.data,
                                  c.weight.ld, a, dev.sms, policy::stats_gemm_cluster,
                                  c.exec.stream);
      m.rows = n;
      m.targets.ids = a.targets;
      m.row_loss = t.row_loss ? t.row_loss + r0 : nullptr;
      m.lse_out = out.lse.data ? out.lse.data + r0 : nullptr;
      const auto blocks = static_cast<unsigned>((n * 32 + linear_threads - 1) / linear_threads);
      sg::merge_kernel<<<blocks, linear_threads, 0, c.exec.stream>>>(m, a.partials, a.target_logit,
                                                                     col_tiles);
      check_cuda(fn, cudaGetLastError());
    }
    return true;
  }
}

/// Whether fused training takes the scaled-probabilities path (scaled_probs.cuh) on this call:
/// policy::scaled_probs, bf16 operands, class-id targets without label smoothing or softcap, no
/// bias or d_bias, no argmax asked for (num_correct), the plan's room for its buffers, chunks
/// and tile counts within int, D a multiple of 8 and 16-byte aligned operands and logits rows, on
/// an sm_90 device running the kernel's sm_90a build.
template <class T, class G, class I>
bool scaled_probs_fit(const char* fn, const linear_call<T, G>& c, class_ids<I>,
                      const linear_options& opts, const linear_totals& t) {
  namespace sg = stats_gemm;
  using DT = typename linear_call<T, G>::DT;
  if constexpr (!std::is_same<DT, __nv_bfloat16>::value || !policy::stats_gemm ||
                !policy::scaled_probs) {
    return false;
  } else {
    const std::int64_t R = c.plan.chunk_rows, V = c.vocab();
    if (!plain_class_options(opts, t) || c.d_bias || c.plan.probs == linear_absent ||
        c.rows() == 0 || R > INT_MAX / 2)
      return false;
    const std::int64_t col_tiles = (V + sg::tile_n - 1) / sg::tile_n;
    if ((R + sg::tile_m - 1) / sg::tile_m > INT_MAX / std::max<std::int64_t>(col_tiles, 1))
      return false;
    if (!aligned16(c.logits(), c.plan.ld * 2)) return false;
    const device_facts dev = query_device(fn);
    return hopper_gemm_fits<sg::form::probs, I>(c, dev) &&
           hopper_gemm_fits<sg::form::stats, I>(c, dev);
  }
}

/// One chunk of fused training by the scaled-probabilities path (scaled_probs.cuh has the steps):
/// rows [r0, r0 + n) into the chunk's buffer as P', their outputs written, then the gradients.
template <class T, class G, class I>
void scaled_probs_chunk(const char* fn, const linear_call<T, G>& c, class_ids<I> targets,
                        const linear_options& opts, const upstream& up, const forward_outputs& out,
                        std::int64_t r0, std::int64_t n) {
  namespace sg = stats_gemm;
  namespace sp = scaled_probs;
  using DT = typename linear_call<T, G>::DT;
  if constexpr (std::is_same<DT, __nv_bfloat16>::value) {
    const cudaStream_t s = c.exec.stream;
    const std::int64_t D = c.dim(), V = c.vocab();
    const int rows = static_cast<int>(n);
    const probs_layout layout = make_probs_layout(c.plan.chunk_rows, V, D);
    const sp::buffers b = sp::make_buffers(c.base + c.plan.probs, layout);
    const DT* x = c.hidden_row(r0);
    const I* y = targets.ids + r0;
    const auto warps = static_cast<unsigned>((n * 32 + linear_threads - 1) / linear_threads);
    sp::reference_kernel<<<warps, linear_threads, 0, s>>>(x, c.hidden.ld, c.weight.data,
                                                          c.weight.ld, static_cast<int>(D), y, rows,
                                                          V, opts.ignore_index, b.ref);
    check_cuda(fn, cudaGetLastError());
    const device_facts dev = query_device(fn);
    auto a = sg::shape_args<I>(n, V, D);
    a.targets = y;
    a.partials = b.partials;
    a.target_logit = b.target_logit;
    a.ref = b.ref;
    sg::launch<sg::form::probs>(fn, x, c.hidden.ld, c.weight.data, c.weight.ld, a, dev.sms,
                                policy::stats_gemm_cluster, s, c.logits(), c.plan.ld);
    check_cuda(fn, cudaMemsetAsync(b.tile_flags, 0, sizeof(int) * (layout.row_tiles + 1), s));
    // The merge's view of the chunk: its rows, outputs and upstream gradient.
    auto m = merge_args<DT, I>(c, opts);
    m.rows = n;
    m.targets.ids = y;
    m.scale = up.scale;
    m.up_rows = up.rows.data;
    m.row_loss = out.row_loss.data;
    m.lse_out = out.lse.data;
    sp::merge_kernel<<<warps, linear_threads, 0, s>>>(m, b, a.col_tiles, x, c.hidden.ld,
                                                      static_cast<int>(D));
    check_cuda(fn, cudaGetLastError());
    // The rows the first pass could not scale (none: each launch below leaves at once): their
    // statistics again from bf16 logits (the forward's form over their row tiles), their outputs,
    // then P' over the same logits by their LSE.
    auto st = sg::shape_args<I>(n, V, D);
    st.targets = y;
    st.partials = b.partials;
    st.target_logit = b.target_logit;
    st.tile_flags = b.tile_flags;
    st.flagged = b.flagged();
    sg::launch<sg::form::stats>(fn, x, c.hidden.ld, c.weight.data, c.weight.ld, st, dev.sms,
                                policy::stats_gemm_cluster, s);
    sp::second_merge_kernel<<<warps, linear_threads, 0, s>>>(m, b, a.col_tiles);
    check_cuda(fn, cudaGetLastError());
    a.partials = nullptr;
    a.target_logit = nullptr;
    a.mult = b.mult;
    a.tile_flags = b.tile_flags;
    a.flagged = b.flagged();
    a.logit_rows = b.second;
    sg::launch<sg::form::probs>(fn, x, c.hidden.ld, c.weight.data, c.weight.ld, a, dev.sms,
                                policy::stats_gemm_cluster, s, c.logits(), c.plan.ld);
    sp::patch_kernel<<<static_cast<unsigned>((n + linear_threads - 1) / linear_threads),
                       linear_threads, 0, s>>>(c.logits(), c.plan.ld, y, rows, V, opts.ignore_index,
                                               b.patch);
    check_cuda(fn, cudaGetLastError());
    chunk_grads(c, r0, n, r0 == 0, b.hidden, D, b.beta);
  }
}

template <linear_mode Mode, class T, class G, class Tgt>
void run_linear(const char* fn, const cuda& exec, matrix_view<const T> hidden,
                matrix_view<const T> weight, vector_view<const T> bias, const Tgt& targets,
                const linear_options& opts, const upstream* up, vector_view<const float> lse,
                const forward_outputs& out, const linear_grads<G>& grads,
                const linear_workspace& ws) {
  const std::int64_t N = hidden.rows, D = hidden.cols, V = weight.rows;
  const linear_pass pass =
      Mode == linear_mode::forward ? linear_pass::forward : linear_pass::training;
  const std::size_t room =
      linear_logits_room<T>(pass, opts.accumulate, grads.d_weight.data, V, D, grads.d_weight.ld);
  const linear_plan plan = plan_linear<T, G>({N, D, V}, pass, opts.accumulate, ws.bytes, room);
  check_linear_call(fn, exec, hidden, weight, grads, plan);
  const cublas_scope blas(fn, exec);
  const linear_call<T, G> c =
      make_linear_call(exec, blas, hidden, weight, bias, grads, plan, ws.data);
  const auto dt = device_targets(targets);
  // The whole call's W, and each row's upstream gradient for mean and sum, before any chunk.
  const linear_totals totals =
      start_totals(fn, c, dt, N, V, opts, up, Mode == linear_mode::backward ? nullptr : &out);

  if constexpr (Mode == linear_mode::forward && !decltype(dt)::soft) {
    if (stats_forward(fn, c, dt, opts, totals, out)) {
      finish_totals(fn, exec.stream, totals, dt, N, V, opts, out);
      return;
    }
  }
  // The core sees each chunk as a problem of its own with reduction none; the reduced loss and
  // num_correct are formed after the chunks from every row's loss and argmax.
  options core = opts;
  core.reduce = reduction::none;
  const cuda core_exec{exec.stream, nullptr, 0, exec.error_count, nullptr};
  bool scaled = false;
  if constexpr (Mode == linear_mode::fused && !decltype(dt)::soft)
    scaled = scaled_probs_fit(fn, c, dt, opts, totals);
  for (std::int64_t r0 = 0; r0 < N; r0 += plan.chunk_rows) {
    const std::int64_t n = std::min(plan.chunk_rows, N - r0);
    if constexpr (Mode == linear_mode::fused && !decltype(dt)::soft) {
      if (scaled) {
        scaled_probs_chunk(fn, c, dt, opts, chunk_upstream(up, opts, totals, r0, n),
                           chunk_outputs(out, totals, r0, n), r0, n);
        continue;
      }
    }
    chunk_logits(c, r0, n);
    const matrix_view<T> chunk(reinterpret_cast<T*>(c.logits()), n, V, plan.ld);
    const auto chunk_targets = detail::target_rows(targets, r0, n);
    const upstream chunk_up = chunk_upstream(up, opts, totals, r0, n);
    if constexpr (Mode == linear_mode::backward) {
      backend_traits<cuda>::backward(core_exec, matrix_view<const T>(chunk), chunk_targets, core,
                                     detail::rows_slice(lse, r0, n), chunk_up, chunk);
    } else if constexpr (Mode == linear_mode::fused) {
      backend_traits<cuda>::forward_backward(core_exec, matrix_view<const T>(chunk), chunk_targets,
                                             core, chunk_up, chunk_outputs(out, totals, r0, n),
                                             chunk);
    } else {
      backend_traits<cuda>::forward(core_exec, matrix_view<const T>(chunk), chunk_targets, core,
                                    chunk_outputs(out, totals, r0, n));
    }
    if constexpr (Mode != linear_mode::forward)
      chunk_grads(c, r0, n, r0 == 0, c.hidden_row(r0), c.hidden.ld);
  }
  if constexpr (Mode != linear_mode::forward) finish_grads(c);
  if constexpr (Mode != linear_mode::backward)
    finish_totals(fn, exec.stream, totals, dt, N, V, opts, out);
}

}  // namespace cuda_detail

template <>
struct linear_traits<cuda> {
  /// The workspace of a call (linear_plan.cuh has the layout). Per chunk row: V elements of T
  /// (V rounded up to 16 bytes) of logits, plus for training a float of upstream gradient and,
  /// with G not float, D floats of d_hidden. Once: 8 bytes, 12 bytes per row of hidden (row
  /// losses and argmax kept for the reduced loss and num_correct when the caller keeps none),
  /// and for training with G not float V floats of d_bias and either the V x D float d_weight
  /// accumulator (dw_accumulation::fp32) or, with dw_accumulation::output and G not T, a block
  /// of 1024 weight rows in float; bf16 training with policy::scaled_probs adds about V / 32 +
  /// 2 D + 20 bytes per chunk row (linear_plan.cuh's probs_layout). Every buffer is 256-byte
  /// aligned. Training with
  /// dw_accumulation::fp32 and 16-bit gradients plans one chunk of every row without the
  /// accumulator when that fits the bytes the accumulator's plan would take (the figure returned
  /// is then that plan's); otherwise, with a d_weight without row padding, a call may take larger
  /// chunks than the figure returned: it keeps the logits in d_weight when that holds more rows.
  template <class T, class G>
  static linear_workspace_sizes workspace_size(const cuda&, const linear_shape& shape,
                                               linear_pass pass, dw_accumulation accumulate,
                                               std::size_t budget) {
    const auto least = cuda_detail::make_linear_plan<T, G>(shape, pass, accumulate, 1);
    const auto fixed = cuda_detail::make_linear_plan<T, G>(shape, pass, accumulate, 0);
    const auto plan = cuda_detail::plan_linear<T, G>(shape, pass, accumulate,
                                                     detail::chunk_budget(fixed.bytes, budget));
    // Never below the minimum: the one-chunk plan can need fewer bytes than the one-row plan
    // with the accumulator, but a call accepts any workspace of the minimum or more.
    return {least.bytes, std::max(plan.bytes, least.bytes), std::min(plan.chunk_rows, shape.rows)};
  }

  template <class T, class Tgt>
  static void forward(const cuda& exec, matrix_view<const T> hidden, matrix_view<const T> weight,
                      vector_view<const T> bias, const Tgt& targets, const linear_options& opts,
                      const forward_outputs& out, const linear_workspace& ws) {
    cuda_detail::run_linear<cuda_detail::linear_mode::forward>("xent::linear_forward", exec, hidden,
                                                               weight, bias, targets, opts, nullptr,
                                                               {}, out, linear_grads<T>{}, ws);
  }

  template <class T, class Tgt, class G>
  static void forward_backward(const cuda& exec, matrix_view<const T> hidden,
                               matrix_view<const T> weight, vector_view<const T> bias,
                               const Tgt& targets, const linear_options& opts, const upstream& up,
                               const forward_outputs& out, const linear_grads<G>& grads,
                               const linear_workspace& ws) {
    cuda_detail::run_linear<cuda_detail::linear_mode::fused>("xent::linear_forward_backward", exec,
                                                             hidden, weight, bias, targets, opts,
                                                             &up, {}, out, grads, ws);
  }

  template <class T, class Tgt, class G>
  static void backward(const cuda& exec, matrix_view<const T> hidden, matrix_view<const T> weight,
                       vector_view<const T> bias, const Tgt& targets, const linear_options& opts,
                       vector_view<const float> lse, const upstream& up,
                       const linear_grads<G>& grads, const linear_workspace& ws) {
    cuda_detail::run_linear<cuda_detail::linear_mode::backward>(
        "xent::linear_backward", exec, hidden, weight, bias, targets, opts, &up, lse,
        forward_outputs{}, grads, ws);
  }
};

}  // namespace xent
