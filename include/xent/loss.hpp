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
  check_targets(fn, typename target_traits<Targets>::type(targets), logits.rows, logits.cols);
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
template <class Exec, class L, class Targets, class A>
void forward(const Exec& exec, matrix_view<L> logits, const Targets& targets, const options& opts,
             const basic_forward_outputs<A>& outputs) {
  constexpr const char* fn = "xent::forward";
  detail::check_common<Exec>(fn, logits, targets, opts);
  detail::require_accumulator<L, A>();
  detail::check_outputs(fn, outputs, opts, logits.rows, detail::target_traits<Targets>::soft, true);
  detail::check_forward_memory(fn, exec, logits, targets, opts, outputs);
  using T = std::remove_const_t<L>;
  backend_traits<Exec>::forward(exec, matrix_view<const T>(logits),
                                typename detail::target_traits<Targets>::type(targets), opts,
                                outputs);
}

/// Gradient of the loss with respect to the logits, from the per-row LSE that forward saved.
///
/// The upstream gradient is a scalar for mean / sum and per row for none (see xent::upstream);
/// per-row scales are applied to each row before anything is summed. grad may be the logits
/// themselves (in place). Ignored rows get a zero gradient.
template <class Exec, class L, class Targets, class A, class G>
void backward(const Exec& exec, matrix_view<L> logits, const Targets& targets, const options& opts,
              vector_view<const detail::non_deduced_t<A>> lse, const basic_upstream<A>& up,
              matrix_view<G> grad) {
  constexpr const char* fn = "xent::backward";
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
  using T = std::remove_const_t<L>;
  backend_traits<Exec>::backward(exec, matrix_view<const T>(logits),
                                 typename detail::target_traits<Targets>::type(targets), opts, lse,
                                 up, grad);
}

/// One call for training: loss and gradient together, each row read once and its gradient written
/// while the row is still in cache. The upstream gradient is given up front (llm.c's dloss), so no
/// second call is needed; grad may be the logits themselves. Every output is optional here.
template <class Exec, class L, class Targets, class A, class B, class G>
void forward_backward(const Exec& exec, matrix_view<L> logits, const Targets& targets,
                      const options& opts, const basic_upstream<A>& up,
                      const basic_forward_outputs<B>& outputs, matrix_view<G> grad) {
  constexpr const char* fn = "xent::forward_backward";
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
  using T = std::remove_const_t<L>;
  backend_traits<Exec>::forward_backward(exec, matrix_view<const T>(logits),
                                         typename detail::target_traits<Targets>::type(targets),
                                         opts, up, outputs, grad);
}

}  // namespace xent
