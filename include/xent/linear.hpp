// Fused linear cross-entropy: the loss of the logits hidden · weightᵀ (+ bias) and its gradients
// with respect to hidden, weight and bias, without materialising the N x V logits. Each call
// computes them a chunk of rows at a time in a caller-sized workspace, runs the cross-entropy core
// (loss.hpp's backends) in place on the chunk, and folds the chunk's logit gradient into d_hidden,
// d_weight and d_bias. Extra memory beyond the workspace: O(N) (the caller's per-row outputs).
//
//   auto ws = xent::linear_workspace_size<bf16>(exec, {N, D, V}, xent::linear_pass::training);
//   xent::linear_forward_backward(exec, hidden, weight, bias, targets, opts, xent::upstream{},
//                                 outputs, {d_hidden, d_weight, d_bias}, {buffer, ws.bytes});
//
// Training runs in one of two orders (linear_order): rows outer (fast, 3 GEMMs, a V x D float
// d_weight sum for 16-bit gradients) or the vocabulary outer (low_memory, 4 GEMMs in
// forward_backward, no V x D buffer); by default the workspace's size chooses. The low-memory
// order can skip the gradient work of tiles whose probabilities are all below
// linear_options::sparse_threshold (off by default; linear/options.hpp states what it drops).
//
// Every loss option of xent::options applies, with the semantics of loss.hpp; the mean's
// normaliser W is the whole call's, not a chunk's. Arguments are checked here for every backend
// and a bad one throws xent::error before anything is written.
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "accumulator.hpp"
#include "backend.hpp"
#include "detail/static_shape.hpp"
#include "detail/validate.hpp"
#include "linear/options.hpp"
#include "linear/validate.hpp"
#include "options.hpp"
#include "targets.hpp"
#include "views.hpp"

namespace xent {

namespace detail {

/// What a size query answers for `order` (linear_workspace_sizes says what) from `of(o)`, the
/// sizes of order o: forward calls and linear_order::fast the fast order's; low_memory its own;
/// automatic the fast order's with the smaller minimal of the two. fast_minimal is the fast
/// order's minimal in each.
template <class Of>
linear_workspace_sizes sizes_of_order(linear_pass pass, linear_order order, Of&& of) {
  linear_workspace_sizes fast = of(linear_order::fast);
  fast.fast_minimal = fast.minimal;
  if (pass == linear_pass::forward || order == linear_order::fast) return fast;
  linear_workspace_sizes low = of(linear_order::low_memory);
  low.fast_minimal = fast.minimal;
  if (order == linear_order::low_memory) return low;
  fast.minimal = std::min(fast.minimal, low.minimal);
  return fast;
}

}  // namespace detail

/// Workspace bytes for calls of `shape` on `exec`, with hidden / weight / bias of dtype T and
/// gradients of dtype G: the least any call accepts (one row per chunk), and what a call uses
/// when its row chunks are given `budget` bytes on top of the buffers every chunk size needs
/// (the largest row chunk that fits, at most every row; those fixed buffers, such as the float
/// d_weight accumulator, are counted outside the budget). A call plans its chunks from the
/// workspace it is given, all of it counted; a training call without d_weight accepts `minimal`
/// of either accumulation mode. A training query with a sparse threshold and
/// linear_order::automatic answers the low-memory order's sizes (the order such a call runs). The
/// CPU's
/// figure is (floats being doubles for double T: the accumulator), per chunk row, V floats of
/// logits and one float of row loss, plus D floats of converted hidden row (T not float) and of
/// d_hidden row (training, G not float); and once a converted weight block per thread (T not
/// float), V floats of bias (T not float) and, for training with G not float, V floats of d_bias
/// and either the V x D float d_weight accumulator (dw_accumulation::fp32) or a weight block per
/// thread (dw_accumulation::output).
template <class T, class G = T, class Exec>
linear_workspace_sizes linear_workspace_size(const Exec& exec, const linear_shape& shape,
                                             linear_pass pass, const linear_options& opts = {},
                                             std::size_t budget = linear_default_budget) {
  static_assert(detail::has_linear_backend<Exec>::value,
                "xent: no fused linear backend for this execution object");
  detail::check_linear_shape("xent::linear_workspace_size", "shape", shape);
  detail::check_accumulation("xent::linear_workspace_size", opts);
  detail::check_order("xent::linear_workspace_size", opts);
  detail::check_sparse("xent::linear_workspace_size", opts);
  detail::check_pass("xent::linear_workspace_size", pass);
  // The sparse backward runs in the low-memory order only: its sizes are that order's.
  const linear_order order = opts.sparse_threshold > 0.0f && pass == linear_pass::training
                                 ? linear_order::low_memory
                                 : opts.order;
  return detail::sizes_of_order(pass, order, [&](linear_order o) {
    return linear_traits<Exec>::template workspace_size<T, G>(exec, shape, pass, opts.accumulate, o,
                                                              budget, opts.sparse_threshold > 0.0f);
  });
}

namespace detail {

/// The static requirements of a fused linear call on `Exec`: a backend (`HasBackend`), its dtype,
/// the kind of targets.
template <class Exec, bool HasBackend, class T, class Targets>
void require_linear_types() {
  static_assert(HasBackend,
                "xent: no fused linear backend for this execution object (include its header)");
  static_assert(backend_traits<Exec>::template supports_dtype<T>,
                "xent: unsupported hidden / weight dtype for this backend (float, bfloat16 and "
                "half are; double only on the CPU backend)");
  static_assert(target_traits<Targets>::valid,
                "xent: targets must be vector_view<int32_t / int64_t> or soft_targets<dtype>");
}

template <class Exec, class T, class Targets>
void check_linear_call(const char* fn, const matrix_view<const T>& hidden,
                       const matrix_view<const T>& weight, const vector_view<const T>& bias,
                       const Targets& targets, const linear_options& opts) {
  require_linear_types<Exec, has_linear_backend<Exec>::value, T, Targets>();
  check_linear_inputs(fn, hidden, weight, bias, dynamic_targets(targets), opts, weight.rows);
}

/// A forward call's workspace: at least `need` bytes (`query` says how to size it), not
/// overlapping the inputs or the outputs. `mem` holds the call's targets and outputs.
template <class T>
void check_forward_workspace(const char* fn, const matrix_view<const T>& hidden,
                             const matrix_view<const T>& weight, const vector_view<const T>& bias,
                             const linear_workspace& ws, std::size_t need, const char* query,
                             call_memory mem) {
  check_workspace(fn, ws, need, query);
  mem.reads("hidden", hidden)
      .reads("weight", weight)
      .reads("bias", bias)
      .writes_bytes("workspace", ws.data, ws.bytes)
      .check();
}

/// A training call's upstream gradient, gradients and workspace (at least `need` bytes; `query`
/// says how to size it); nothing it writes overlaps what it reads, or anything else it writes.
/// `mem` holds the call's targets and its outputs or saved LSE.
template <class Exec, class T, class G, class A>
void check_linear_training(const char* fn, const matrix_view<const T>& hidden,
                           const matrix_view<const T>& weight, const vector_view<const T>& bias,
                           const linear_options& opts, const basic_upstream<A>& up,
                           const linear_grads<G>& grads, const linear_workspace& ws,
                           std::size_t need, const char* query, call_memory mem) {
  static_assert(!std::is_const<G>::value, "xent: gradients must be writable");
  static_assert(backend_traits<Exec>::template supports_dtype<G>,
                "xent: unsupported gradient dtype for this backend");
  check_upstream(fn, up, opts, hidden.rows);
  check_linear_grads(fn, grads, hidden, weight, bias);
  check_workspace(fn, ws, need, query);
  mem.reads("hidden", hidden)
      .reads("weight", weight)
      .reads("bias", bias)
      .reads_upstream(up)
      .writes("grads.d_hidden", grads.d_hidden)
      .writes("grads.d_weight", grads.d_weight)
      .writes("grads.d_bias", grads.d_bias)
      .writes_bytes("workspace", ws.data, ws.bytes)
      .check();
}

/// The targets and class weights a linear call reads.
template <class Targets>
call_memory linear_memory(const char* fn, const Targets& targets, const linear_options& opts) {
  call_memory mem(fn);
  mem.reads_targets(targets, opts);
  return mem;
}

/// The least workspace a single-device call of this shape accepts (in the order of `opts`).
template <class T, class G, class Exec>
std::size_t linear_minimal(const Exec& exec, const matrix_view<const T>& hidden,
                           const matrix_view<const T>& weight, linear_pass pass,
                           const linear_options& opts) {
  return linear_workspace_size<T, G>(exec, {hidden.rows, hidden.cols, weight.rows}, pass, opts, 0)
      .minimal;
}

/// `opts` with linear_order::automatic resolved for a training workspace of `bytes`: fast when it
/// holds fast's minimal (or fast needs no more than low_memory), else low_memory; low_memory
/// whatever the bytes with a sparse threshold (only that order skips tiles).
template <class T, class G, class Exec>
linear_options resolved_order(const Exec& exec, const matrix_view<const T>& hidden,
                              const matrix_view<const T>& weight, linear_options opts,
                              std::size_t bytes) {
  if (opts.order != linear_order::automatic) return opts;
  if (opts.sparse_threshold > 0.0f) {
    opts.order = linear_order::low_memory;
    return opts;
  }
  const std::size_t fast =
      linear_workspace_size<T, G>(exec, {hidden.rows, hidden.cols, weight.rows},
                                  linear_pass::training, opts, 0)
          .fast_minimal;
  opts.order = linear_order::low_memory;
  const bool low_fits =
      linear_minimal<T, G>(exec, hidden, weight, linear_pass::training, opts) < fast;
  opts.order = bytes >= fast || !low_fits ? linear_order::fast : linear_order::low_memory;
  return opts;
}

/// The options a training call plans its workspace with. Without d_weight (a frozen LM head)
/// nothing is summed over row chunks and both modes give the same results, so the one with the
/// smaller buffers is planned: the V x D float accumulator (4 V D bytes: 2 GiB at 128256 x 4096)
/// is never required, nor output's weight blocks where V is smaller than them, and no such call
/// needs more than linear_workspace_size(...).minimal for the caller's mode.
/// The order is then resolved from the workspace's `bytes` (resolved_order).
template <class T, class G, class Exec>
linear_options planned_options(const Exec& exec, const matrix_view<const T>& hidden,
                               const matrix_view<const T>& weight, const linear_options& opts,
                               const linear_grads<G>& grads, std::size_t bytes) {
  if (grads.d_weight.data) return resolved_order<T, G>(exec, hidden, weight, opts, bytes);
  linear_options fp32 = opts, output = opts;
  fp32.accumulate = dw_accumulation::fp32;
  output.accumulate = dw_accumulation::output;
  return resolved_order<T, G>(
      exec, hidden, weight,
      linear_minimal<T, G>(exec, hidden, weight, linear_pass::training, fp32) <
              linear_minimal<T, G>(exec, hidden, weight, linear_pass::training, output)
          ? fp32
          : output,
      bytes);
}

}  // namespace detail

/// Evaluation: the loss of every row and the reduced loss, from hidden (N x D), weight (V x D),
/// an optional bias (V; an empty view for none) and targets (N class ids, int32 / int64, or
/// soft_targets N x V). outputs as xent::forward's: the reduction's result is required, per-row
/// LSE (for linear_backward), argmax and num_correct optional. workspace: at least
/// linear_workspace_size(..., linear_pass::forward).minimal bytes; more makes row chunks larger.
/// Outputs, upstream gradients and LSE are of the inputs' accumulator type, as in loss.hpp:
/// double for double hidden / weight (CPU only), float otherwise.
///
/// Views may carry static extents (views.hpp); those of two arguments for the same size (N, D,
/// V) must agree, a static_assert otherwise. The training calls check their gradients' too.
template <class Exec, class H, class HE, class WT = const std::remove_const_t<H>,
          class WE = dynamic_extents, class BT = const std::remove_const_t<H>,
          class BE = dynamic_extent, class Tgt, class W = dynamic_extent, class A,
          class OE = dynamic_extent>
void linear_forward(const Exec& exec, matrix_view<H, HE> hidden, matrix_view<WT, WE> static_weight,
                    vector_view<BT, BE> static_bias, const Tgt& static_targets,
                    const basic_linear_options<W>& static_opts,
                    const basic_forward_outputs<A, OE>& static_out,
                    const linear_workspace& workspace) {
  constexpr const char* fn = "xent::linear_forward";
  using T = std::remove_const_t<H>;
  detail::static_call<HE::rows, WE::rows, Tgt, W, OE, dynamic_extent>();

  const auto in = detail::dynamic_linear_inputs(hidden, static_weight, static_bias, static_targets,
                                                static_opts);
  using Targets = decltype(in.targets);
  const auto& [x, weight, bias, targets, opts] = in;
  const basic_forward_outputs<A> outputs = detail::dynamic_outputs(static_out);
  detail::check_linear_call<Exec>(fn, x, weight, bias, targets, opts);
  detail::require_accumulator<T, A>();
  detail::check_outputs(fn, outputs, opts, x.rows, detail::target_traits<Targets>::soft, true);
  detail::check_forward_workspace(
      fn, x, weight, bias, workspace,
      detail::linear_minimal<T, T>(exec, x, weight, linear_pass::forward, opts),
      "xent::linear_workspace_size",
      detail::linear_memory(fn, targets, opts).writes_outputs(outputs));
  linear_traits<Exec>::forward(exec, x, weight, bias, detail::dynamic_targets(targets), opts,
                               outputs, workspace);
}

/// Training in one call: loss (every output optional) and d_hidden, d_weight, d_bias (each
/// optional, see linear_grads) with the upstream gradient given up front (a scalar for mean /
/// sum, per row for none). Per-row upstream gradients scale each row's logit gradient before it
/// is summed over rows into d_weight and d_bias (Liger #678 / #968 summed first).
template <class Exec, class H, class HE, class WT = const std::remove_const_t<H>,
          class WE = dynamic_extents, class BT = const std::remove_const_t<H>,
          class BE = dynamic_extent, class Tgt, class W = dynamic_extent, class A,
          class UE = dynamic_extent, class B, class OE = dynamic_extent, class G, class GHE,
          class GWE>
void linear_forward_backward(const Exec& exec, matrix_view<H, HE> hidden,
                             matrix_view<WT, WE> static_weight, vector_view<BT, BE> static_bias,
                             const Tgt& static_targets, const basic_linear_options<W>& static_opts,
                             const basic_upstream<A, UE>& static_up,
                             const basic_forward_outputs<B, OE>& static_out,
                             const linear_grads<G, GHE, GWE>& static_grads,
                             const linear_workspace& workspace) {
  constexpr const char* fn = "xent::linear_forward_backward";
  using T = std::remove_const_t<H>;
  detail::static_call<HE::rows, WE::rows, Tgt, W, OE, UE>();

  detail::static_linear_grads<HE, WE, GHE, GWE>();
  const auto in = detail::dynamic_linear_inputs(hidden, static_weight, static_bias, static_targets,
                                                static_opts);
  using Targets = decltype(in.targets);
  const auto& [x, weight, bias, targets, opts] = in;
  const basic_upstream<A> up = detail::dynamic_upstream(static_up);
  const basic_forward_outputs<B> outputs = detail::dynamic_outputs(static_out);
  const linear_grads<G> grads = detail::dynamic_grads(static_grads);
  detail::check_linear_call<Exec>(fn, x, weight, bias, targets, opts);
  detail::require_accumulator<T, A>();
  detail::require_accumulator<T, B>();
  detail::check_outputs(fn, outputs, opts, x.rows, detail::target_traits<Targets>::soft, false);
  const linear_options planned =
      detail::planned_options<T>(exec, x, weight, opts, grads, workspace.bytes);
  detail::check_linear_training<Exec>(
      fn, x, weight, bias, opts, up, grads, workspace,
      detail::linear_minimal<T, G>(exec, x, weight, linear_pass::training, planned),
      "xent::linear_workspace_size",
      detail::linear_memory(fn, targets, opts).writes_outputs(outputs));
  linear_traits<Exec>::forward_backward(exec, x, weight, bias, detail::dynamic_targets(targets),
                                        planned, up, outputs, grads, workspace);
}

/// The gradients from the per-row LSE that linear_forward saved, recomputing each chunk's logits
/// (the N x V logits are never kept between the calls). The upstream gradient is a scalar for
/// mean / sum and per row for none, applied to each row before any sum over rows.
template <class Exec, class H, class HE, class WT = const std::remove_const_t<H>,
          class WE = dynamic_extents, class BT = const std::remove_const_t<H>,
          class BE = dynamic_extent, class Tgt, class W = dynamic_extent, class A,
          class LseT = const A, class LseE = dynamic_extent, class UE = dynamic_extent, class G,
          class GHE, class GWE>
void linear_backward(const Exec& exec, matrix_view<H, HE> hidden, matrix_view<WT, WE> static_weight,
                     vector_view<BT, BE> static_bias, const Tgt& static_targets,
                     const basic_linear_options<W>& static_opts, vector_view<LseT, LseE> static_lse,
                     const basic_upstream<A, UE>& static_up,
                     const linear_grads<G, GHE, GWE>& static_grads,
                     const linear_workspace& workspace) {
  constexpr const char* fn = "xent::linear_backward";
  using T = std::remove_const_t<H>;
  detail::static_call<HE::rows, WE::rows, Tgt, W, dynamic_extent, UE>();

  detail::static_lse<HE::rows, A, LseT, LseE>();
  detail::static_linear_grads<HE, WE, GHE, GWE>();
  const auto in = detail::dynamic_linear_inputs(hidden, static_weight, static_bias, static_targets,
                                                static_opts);
  const auto& [x, weight, bias, targets, opts] = in;
  const vector_view<const A> lse(static_lse);
  const basic_upstream<A> up = detail::dynamic_upstream(static_up);
  const linear_grads<G> grads = detail::dynamic_grads(static_grads);
  detail::check_linear_call<Exec>(fn, x, weight, bias, targets, opts);
  detail::require_accumulator<T, A>();
  detail::check_vector(fn, "lse", lse, x.rows, false);
  const linear_options planned =
      detail::planned_options<T>(exec, x, weight, opts, grads, workspace.bytes);
  detail::check_linear_training<Exec>(
      fn, x, weight, bias, opts, up, grads, workspace,
      detail::linear_minimal<T, G>(exec, x, weight, linear_pass::training, planned),
      "xent::linear_workspace_size", detail::linear_memory(fn, targets, opts).reads("lse", lse));
  linear_traits<Exec>::backward(exec, x, weight, bias, detail::dynamic_targets(targets), planned,
                                lse, up, grads, workspace);
}

}  // namespace xent
