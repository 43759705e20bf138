// The public entry points. Each takes an execution object first (xent::cpu{...}, xent::cuda{...});
// backend_traits maps it to an implementation. Arguments are checked here, for every backend, and
// a bad one throws xent::error before anything is written.
//
// None of these calls materialises probabilities or any other N x V array: forward reads each row
// once; forward_backward reads it and writes its gradient, in place over the logits if asked.
#pragma once

#include <type_traits>

#include "accumulator.hpp"
#include "backend.hpp"
#include "detail/disjoint.hpp"
#include "detail/static_shape.hpp"
#include "detail/validate.hpp"
#include "options.hpp"
#include "targets.hpp"
#include "views.hpp"

namespace xent {
namespace detail {

template <class Exec, class L, class Targets>
void check_common(const char* fn, const matrix_view<L>& logits, const Targets& targets,
                  const options& opts) {
  static_assert(has_backend<Exec>::value,
                "xent: no backend for this execution object (include its backend header)");
  static_assert(backend_traits<Exec>::template supports_dtype<std::remove_const_t<L>>,
                "xent: unsupported logits dtype for this backend (float, bfloat16 and half are; "
                "double only on the CPU backend)");
  static_assert(target_traits<Targets>::valid,
                "xent: targets must be vector_view<int32_t / int64_t> or soft_targets<dtype>");
  check_logits(fn, logits);
  check_targets(fn, dynamic_targets(targets), logits.rows, logits.cols);
  check_options(fn, opts, logits.cols);
}

}  // namespace detail

/// Loss of every row, and the reduced loss, without touching a gradient.
///
/// The outputs, and in the other calls the upstream gradient and LSE, are of the logits'
/// accumulator type (accumulator.hpp): float (forward_outputs, upstream) for float, bfloat16 and
/// half logits; double (basic_forward_outputs<double>, basic_upstream<double>) for double ones.
///
/// logits: N x V (any ld >= V); targets: N class ids (int32 / int64) or soft_targets (N x V).
/// outputs: the reduction's result (`loss` for mean / sum, `row_loss` for none) is required;
/// per-row LSE (for backward), argmax and the count of correct rows are optional. Rows whose target
/// is ignore_index are not read: their loss and LSE are 0 and their argmax -1.
///
/// Every view may carry static extents (views.hpp): those of two arguments for the same size must
/// agree (a static_assert otherwise). This and the other entry points check them, then run on the
/// run-time sized views.
template <class Exec, class L, class LE, class Tgt, class W = dynamic_extent, class A,
          class OE = dynamic_extent>
void forward(const Exec& exec, matrix_view<L, LE> static_logits, const Tgt& static_targets,
             const basic_options<W>& static_opts, const basic_forward_outputs<A, OE>& static_out) {
  constexpr const char* fn = "xent::forward";
  detail::static_call<LE::rows, LE::cols, Tgt, W, OE, dynamic_extent>();

  using Targets = typename detail::target_traits<Tgt>::type;
  const matrix_view<L> logits(static_logits);
  const Targets targets = detail::dynamic_targets(static_targets);
  const options opts(static_opts);
  const basic_forward_outputs<A> outputs = detail::dynamic_outputs(static_out);
  detail::check_common<Exec>(fn, logits, targets, opts);
  detail::require_accumulator<L, A>();
  detail::check_outputs(fn, outputs, opts, logits.rows, detail::target_traits<Targets>::soft, true);
  detail::check_forward_memory(fn, exec, logits, targets, opts, outputs);
  backend_traits<Exec>::forward(exec, detail::backend_logits<Exec>(static_logits),
                                detail::dynamic_targets(targets), opts, outputs);
}

/// Gradient of the loss with respect to the logits, from the per-row LSE that forward saved.
///
/// The upstream gradient is a scalar for mean / sum and per row for none (see xent::upstream);
/// per-row scales are applied to each row before anything is summed. grad may be the logits
/// themselves (in place). Ignored rows get a zero gradient.
template <class Exec, class L, class LE, class Tgt, class W = dynamic_extent, class A,
          class LseT = const A, class LseE = dynamic_extent, class UE = dynamic_extent, class G,
          class GE>
void backward(const Exec& exec, matrix_view<L, LE> static_logits, const Tgt& static_targets,
              const basic_options<W>& static_opts, vector_view<LseT, LseE> static_lse,
              const basic_upstream<A, UE>& static_up, matrix_view<G, GE> static_grad) {
  constexpr const char* fn = "xent::backward";
  detail::static_call<LE::rows, LE::cols, Tgt, W, dynamic_extent, UE>();

  detail::static_lse<LE::rows, A, LseT, LseE>();
  detail::static_grad<LE, GE>();
  using Targets = typename detail::target_traits<Tgt>::type;
  const matrix_view<L> logits(static_logits);
  const Targets targets = detail::dynamic_targets(static_targets);
  const options opts(static_opts);
  const vector_view<const A> lse(static_lse);
  const basic_upstream<A> up = detail::dynamic_upstream(static_up);
  const matrix_view<G> grad(static_grad);
  static_assert(!std::is_const<G>::value, "xent::backward: grad must be writable");
  static_assert(backend_traits<Exec>::template supports_gradient<std::remove_const_t<L>, G>,
                "xent: unsupported gradient dtype for these logits on this backend (CUDA: a "
                "gradient at least as wide as the logits)");
  detail::check_common<Exec>(fn, logits, targets, opts);
  detail::require_accumulator<L, A>();
  detail::check_vector(fn, "lse", lse, logits.rows, false);
  detail::check_upstream(fn, up, opts, logits.rows);
  detail::check_gradient(fn, logits, grad);
  detail::check_gradient_memory(fn, exec, logits, targets, opts, lse, up,
                                basic_forward_outputs<A>{}, grad);
  backend_traits<Exec>::backward(exec, detail::backend_logits<Exec>(static_logits),
                                 detail::dynamic_targets(targets), opts, lse, up, grad);
}

/// One call for training: loss and gradient together, each row read once and its gradient written
/// while the row is still in cache. The upstream gradient is given up front (llm.c's dloss), so no
/// second call is needed; grad may be the logits themselves. Every output is optional here.
template <class Exec, class L, class LE, class Tgt, class W = dynamic_extent, class A,
          class UE = dynamic_extent, class B, class OE = dynamic_extent, class G, class GE>
void forward_backward(const Exec& exec, matrix_view<L, LE> static_logits, const Tgt& static_targets,
                      const basic_options<W>& static_opts, const basic_upstream<A, UE>& static_up,
                      const basic_forward_outputs<B, OE>& static_out,
                      matrix_view<G, GE> static_grad) {
  constexpr const char* fn = "xent::forward_backward";
  detail::static_call<LE::rows, LE::cols, Tgt, W, OE, UE>();

  detail::static_grad<LE, GE>();
  using Targets = typename detail::target_traits<Tgt>::type;
  const matrix_view<L> logits(static_logits);
  const Targets targets = detail::dynamic_targets(static_targets);
  const options opts(static_opts);
  const basic_upstream<A> up = detail::dynamic_upstream(static_up);
  const basic_forward_outputs<B> outputs = detail::dynamic_outputs(static_out);
  const matrix_view<G> grad(static_grad);
  static_assert(!std::is_const<G>::value, "xent::forward_backward: grad must be writable");
  static_assert(backend_traits<Exec>::template supports_gradient<std::remove_const_t<L>, G>,
                "xent: unsupported gradient dtype for these logits on this backend (CUDA: a "
                "gradient at least as wide as the logits)");
  detail::check_common<Exec>(fn, logits, targets, opts);
  detail::require_accumulator<L, A>();
  detail::require_accumulator<L, B>();
  detail::check_outputs(fn, outputs, opts, logits.rows, detail::target_traits<Targets>::soft,
                        false);
  detail::check_upstream(fn, up, opts, logits.rows);
  detail::check_gradient(fn, logits, grad);
  detail::check_gradient_memory(fn, exec, logits, targets, opts, vector_view<const A>{}, up,
                                outputs, grad);
  backend_traits<Exec>::forward_backward(exec, detail::backend_logits<Exec>(static_logits),
                                         detail::dynamic_targets(targets), opts, up, outputs, grad);
}

}  // namespace xent
