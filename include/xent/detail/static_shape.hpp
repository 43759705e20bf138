// The compile-time half of the argument checks: where two arguments of a call both carry a static
// extent (views.hpp) for the same size, they must agree, and a call where they do not is a
// static_assert naming the argument. Sizes known only at run time are checked by validate.hpp,
// after the entry point has turned every view into its run-time sized form (dynamic_outputs and
// the others below), which is the only form the backends see.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../linear/options.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"

namespace xent {
namespace detail {

/// Targets and class weights against the logits' extents LE (RowsE and ColsE for the fused
/// linear calls: hidden's rows, weight's rows). `Weights`: whether the class weights span the
/// logits' columns (not a vocab-parallel shard's, whose weights are all V).
template <std::int64_t Rows, std::int64_t Cols, class Targets, class W, bool Weights = true>
constexpr void static_targets() {
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
}

/// Per-row outputs (OE) and upstream gradients (UE) of a call of `Rows` rows.
template <std::int64_t Rows, class OE, class UE>
constexpr void static_rows() {
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

// The run-time sized forms the backends take.
template <class A, class E>
basic_forward_outputs<A> dynamic_outputs(const basic_forward_outputs<A, E>& o) {
  return {o.loss, o.row_loss, o.lse, o.argmax, o.num_correct};
}

template <class A, class E>
basic_upstream<A> dynamic_upstream(const basic_upstream<A, E>& u) {
  return {u.scale, u.scale_ptr, u.rows};
}

template <class G, class HE, class WE>
linear_grads<G> dynamic_grads(const linear_grads<G, HE, WE>& g) {
  return {g.d_hidden, g.d_weight, g.d_bias};
}

}  // namespace detail
}  // namespace xent
