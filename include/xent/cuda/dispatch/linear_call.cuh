// A fused linear cross-entropy call's operands and buffers, and the steps of one chunk of its
// rows that every CUDA form of the call shares (dispatch/linear.cuh runs them on one device,
// dispatch/vocab_parallel_linear.cuh on each rank): the chunk's logits, its weight, bias and
// hidden gradients, and the whole call's totals around the chunks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../../error.hpp"
#include "../../linear/options.hpp"
#include "../../linear/plan.hpp"
#include "../../options.hpp"
#include "../../targets.hpp"
#include "../../views.hpp"
#include "../block/dtype.cuh"
#include "../cuda.cuh"
#include "../kernels/linear_kernels.cuh"
#include "../runtime.cuh"
#include "../tuning/policy.cuh"
#include "accumulate_gemm.cuh"
#include "cublas.cuh"
#include "launch.cuh"
#include "linear_plan.cuh"
#include "stats_gemm.cuh"

namespace xent {
namespace cuda_detail {

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
  /// d_weight's float sum and its leading dimension: the caller's d_weight when G is float, else
  /// dw_accumulation::fp32's accumulator (null without one).
  std::pair<float*, std::int64_t> dw_float_sum() const {
    if constexpr (float_grads) {
      return {d_weight.data, d_weight.ld};
    } else {
      return {dw_accumulator(), dim()};
    }
  }
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
    sg::launch<sg::form::logits>(fn, c.hidden_row(r0), c.hidden.ld, c.weight.data, c.weight.ld, a,
                                 dev, policy::stats_gemm_cluster, c.exec.stream, c.logits(),
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

/// d_bias (its float sum) += the column sums of the chunk's n rows of G in the call's logits
/// buffer (`first`: written, not added).
template <class T, class G>
void chunk_bias_grads(const linear_call<T, G>& c, std::int64_t n, bool first) {
  const std::int64_t V = c.vocab();
  if (float* db = c.db_sum())
    if (V > 0)
      column_sums_kernel<<<static_cast<unsigned>((V + linear_threads - 1) / linear_threads),
                           linear_threads, 0, c.exec.stream>>>(c.logits(), c.plan.ld, n, V, db,
                                                               first);
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
    const auto [acc, ld_acc] = c.dw_float_sum();
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
  chunk_bias_grads(c, n, first);
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

}  // namespace cuda_detail
}  // namespace xent
