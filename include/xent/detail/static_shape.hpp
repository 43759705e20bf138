// The compile-time half of the argument checks: where two arguments of a call both carry a static
// extent (views.hpp) for the same size, they must agree, and a call where they do not is a
// static_assert naming the argument. Sizes known only at run time are checked by validate.hpp,
// after the entry point has turned every view into its run-time sized form (dynamic_outputs and
// the others below), which is the only form the backends see.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../backend.hpp"
#include "../linear/options.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"

namespace xent {
namespace detail {

/// The arguments sized by the rows and the classes of a call of `Rows` x `Cols` (the logits', or
/// hidden's rows by the weight's): targets, class weights (W; unless `Weights` is false, as in a
/// vocab-parallel call, whose weights are all V), per-row outputs (OE) and upstream (UE).
template <std::int64_t Rows, std::int64_t Cols, class Targets, class W, class OE, class UE,
          bool Weights = true>
constexpr void static_call() {
  using tt = target_traits<Targets>;
  static_assert(compatible_extent(tt::rows, Rows),
                "xent: the targets' static row count differs from the logits' (hidden's) static "
                "rows");
  static_assert(compatible_extent(tt::cols, Cols),
                "xent: the soft targets' static column count differs from the logits' static "
                "columns (the weight's static rows)");
  static_assert(!Weights || compatible_extent(W::size, Cols),
                "xent: options.class_weights has a static size other than the static class count "
                "(the logits' columns, the weight's rows): one weight per class");
  static_assert(compatible_extent(OE::size, Rows),
                "xent: the per-row outputs' static size differs from the logits' (hidden's) "
                "static rows");
  static_assert(compatible_extent(UE::size, Rows),
                "xent: upstream.rows has a static size other than the logits' (hidden's) static "
                "rows");
}

/// A saved LSE (extent LseE, elements LseT) of a call of `Rows` rows accumulating in A.
template <std::int64_t Rows, class A, class LseT, class LseE>
constexpr void static_lse() {
  static_assert(std::is_same<std::remove_const_t<LseT>, A>::value,
                "xent: lse must be of the logits' accumulator type (float; double for double "
                "logits)");
  static_assert(compatible_extent(LseE::size, Rows),
                "xent: lse has a static size other than the logits' (hidden's) static rows");
}

/// A gradient of extents GE for logits of extents LE.
template <class LE, class GE>
constexpr void static_grad() {
  static_assert(compatible_extent(GE::rows, LE::rows) && compatible_extent(GE::cols, LE::cols),
                "xent: grad's static extents differ from the logits' static extents");
}

/// hidden (HE), weight (WT, WE) and bias (BT, BE) of a fused linear call on T inputs.
template <class T, class HE, class WT, class WE, class BT, class BE>
constexpr void static_linear_inputs() {
  static_assert(std::is_same<std::remove_const_t<WT>, T>::value &&
                    std::is_same<std::remove_const_t<BT>, T>::value,
                "xent: weight and bias must have hidden's element type");
  static_assert(compatible_extent(HE::cols, WE::cols),
                "xent: hidden and weight have different static D (their columns)");
  static_assert(compatible_extent(BE::size, WE::rows),
                "xent: bias has a static size other than the weight's static rows (V)");
}

/// A fused linear call's gradients against hidden's and the weight's extents.
template <class HE, class WE, class GHE, class GWE>
constexpr void static_linear_grads() {
  static_assert(compatible_extent(GHE::rows, HE::rows) && compatible_extent(GHE::cols, HE::cols),
                "xent: grads.d_hidden's static extents differ from hidden's");
  static_assert(compatible_extent(GWE::rows, WE::rows) && compatible_extent(GWE::cols, WE::cols),
                "xent: grads.d_weight's static extents differ from the weight's");
}

// The run-time sized forms the backends take; optional views as optional_view (views.hpp).
template <class A, class E>
basic_forward_outputs<A> dynamic_outputs(const basic_forward_outputs<A, E>& o) {
  return {o.loss, optional_view(o.row_loss), optional_view(o.lse), optional_view(o.argmax),
          o.num_correct};
}

template <class A, class E>
basic_upstream<A> dynamic_upstream(const basic_upstream<A, E>& u) {
  return {u.scale, u.scale_ptr, optional_view(u.rows)};
}

template <class G, class HE, class WE>
linear_grads<G> dynamic_grads(const linear_grads<G, HE, WE>& g) {
  return {optional_view(g.d_hidden), optional_view(g.d_weight), optional_view(g.d_bias)};
}

/// A fused linear call's inputs in the run-time sized forms the backends take, after the static
/// checks between them.
template <class T, class Targets>
struct linear_inputs {
  matrix_view<const T> x, weight;
  vector_view<const T> bias;
  Targets targets;
  linear_options opts;
};

template <class H, class HE, class WT, class WE, class BT, class BE, class Tgt, class W>
linear_inputs<std::remove_const_t<H>, typename target_traits<Tgt>::type> dynamic_linear_inputs(
    matrix_view<H, HE> hidden, matrix_view<WT, WE> weight, vector_view<BT, BE> bias,
    const Tgt& targets, const basic_linear_options<W>& opts) {
  using T = std::remove_const_t<H>;
  static_linear_inputs<T, HE, WT, WE, BT, BE>();
  return {matrix_view<const T>(hidden), matrix_view<const T>(weight), vector_view<const T>(bias),
          dynamic_targets(targets), linear_options(opts)};
}

/// Whether backend_traits<Exec> takes the logits with their static extents (`static_shape`: the
/// CUDA small-batch kernel's plan at compile time) or their static column count
/// (`static_columns`: the CPU's whole-row sweeps specialise on it).
template <class Exec, class = void>
struct takes_static_shape : std::false_type {};
template <class Exec>
struct takes_static_shape<Exec, std::enable_if_t<backend_traits<Exec>::static_shape>>
    : std::true_type {};
template <class Exec, class = void>
struct takes_static_columns : std::false_type {};
template <class Exec>
struct takes_static_columns<Exec, std::enable_if_t<backend_traits<Exec>::static_columns>>
    : std::true_type {};

/// The logits as backend_traits<Exec> takes them: const, with the static extents it takes,
/// run-time sized otherwise.
template <class Exec, class T, class E>
auto backend_logits(const matrix_view<T, E>& logits) {
  using C = const std::remove_const_t<T>;
  if constexpr (takes_static_shape<Exec>::value) {
    return matrix_view<C, E>(logits);
  } else if constexpr (takes_static_columns<Exec>::value) {
    return matrix_view<C, extents<dynamic, E::cols>>(logits);
  } else {
    return matrix_view<C>(logits);
  }
}

}  // namespace detail
}  // namespace xent
