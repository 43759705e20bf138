// The two kinds of target: class ids (int32 or int64, one per row) and soft targets (a probability
// distribution per row, N x V).
#pragma once

#include <cstdint>
#include <type_traits>

#include "views.hpp"

namespace xent {

/// Soft (probability) targets: row n holds t[n, :], a distribution over the V classes. With label
/// smoothing eps the distribution used is (1 - eps) t + eps / V; mean divides by N.
template <class S>
struct soft_targets {
  matrix_view<const S> probs;
};

template <class S>
soft_targets<std::remove_const_t<S>> soft(matrix_view<S> probs) {
  return {probs};
}

namespace detail {

template <class T>
struct is_class_id : std::bool_constant<std::is_same<T, std::int32_t>::value ||
                                        std::is_same<T, std::int64_t>::value> {};

/// Maps what a caller may pass as targets onto the two forms the backends implement.
template <class Targets, class = void>
struct target_traits {
  static constexpr bool valid = false;  // the entry points' static_assert says what is accepted
  static constexpr bool soft = false;
  using type = Targets;
};

template <class I>
struct target_traits<vector_view<I>, std::enable_if_t<is_class_id<std::remove_const_t<I>>::value>> {
  static constexpr bool valid = true;
  static constexpr bool soft = false;
  using type = vector_view<const std::remove_const_t<I>>;
};

template <class S>
struct target_traits<soft_targets<S>> {
  static constexpr bool valid = true;
  static constexpr bool soft = true;
  using type = soft_targets<S>;
};

}  // namespace detail
}  // namespace xent
