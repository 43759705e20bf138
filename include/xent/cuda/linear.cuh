// linear_traits<cuda>: fused linear cross-entropy on the GPU, with the caller's cuBLAS handle.
// The chunked call (the fast order), its GEMMs and the Hopper paths are dispatch/linear.cuh's; the
// low-memory order is dispatch/linear_panels.cuh's, its sparse backward
// (linear_options::sparse_threshold) dispatch/linear_sparse.cuh's; cublas_error is
// dispatch/cublas.cuh's.
#pragma once

#include <algorithm>
#include <cstddef>

#include "../backend.hpp"
#include "../linear/options.hpp"
#include "../linear/plan.hpp"
#include "../linear/validate.hpp"
#include "../options.hpp"
#include "../views.hpp"
#include "cuda.cuh"
#include "dispatch/linear.cuh"
#include "dispatch/linear_panels.cuh"
#include "dispatch/linear_plan.cuh"
#include "instances.cuh"

namespace xent {

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
  ///
  /// The low-memory order (linear_order::low_memory, dispatch/linear_panels.cuh): the statistics'
  /// or a panel's buffers, whichever is larger (a panel of P weight rows: chunk rows x P elements
  /// of T of logits, with G not float and fewer chunk rows than N a float panel of d_weight,
  /// P x D), then per row 8 bytes of LSE and mass and, G not float, D floats of d_hidden's sum.
  /// The query answers the widest panel (P from 1024, in steps of 256, up to V) of every row whose
  /// whole workspace fits `budget`, when one does (the order's bound: 256 MiB beyond the gradients
  /// by default); else the 1024-row panel's plan within the budget on top of its fixed buffers
  /// (query_low_memory).
  ///
  /// A sparse threshold (the low-memory order's) adds a byte per tile of 64 rows x 256 classes:
  /// 64 KiB at 8192 x 128256.
  template <class T, class G>
  static linear_workspace_sizes workspace_size(const cuda&, const linear_shape& shape,
                                               linear_pass pass, dw_accumulation accumulate,
                                               linear_order order, std::size_t budget,
                                               bool sparse) {
    if (pass == linear_pass::training && order == linear_order::low_memory) {
      const std::size_t least = cuda_detail::least_low_memory_bytes<T, G>(shape, sparse);
      const auto plan = cuda_detail::query_low_memory<T, G>(shape, budget, sparse);
      return {least, std::max(plan.bytes, least), std::min(plan.panel.chunk_rows, shape.rows)};
    }
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
    constexpr const char* fn = "xent::linear_forward_backward";
    if (opts.order == linear_order::low_memory)
      cuda_detail::run_low_memory(fn, exec, hidden, weight, bias, targets, opts, up,
                                  static_cast<const vector_view<const float>*>(nullptr), out, grads,
                                  ws);
    else
      cuda_detail::run_linear<cuda_detail::linear_mode::fused>(
          fn, exec, hidden, weight, bias, targets, opts, &up, {}, out, grads, ws);
  }

  template <class T, class Tgt, class G>
  static void backward(const cuda& exec, matrix_view<const T> hidden, matrix_view<const T> weight,
                       vector_view<const T> bias, const Tgt& targets, const linear_options& opts,
                       vector_view<const float> lse, const upstream& up,
                       const linear_grads<G>& grads, const linear_workspace& ws) {
    constexpr const char* fn = "xent::linear_backward";
    if (opts.order == linear_order::low_memory)
      cuda_detail::run_low_memory(fn, exec, hidden, weight, bias, targets, opts, up, &lse,
                                  forward_outputs{}, grads, ws);
    else
      cuda_detail::run_linear<cuda_detail::linear_mode::backward>(
          fn, exec, hidden, weight, bias, targets, opts, &up, lse, forward_outputs{}, grads, ws);
  }
};

}  // namespace xent
