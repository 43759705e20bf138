// The two kinds of target: class ids (int32 or int64, one per row) and soft targets (a probability
// distribution per row, N x V).
#pragma once

#include <cstdint>
#include <type_traits>

#include "views.hpp"

namespace xent {

/// Soft (probability) targets: row n holds t[n, :], a distribution over the V classes. With label
/// smoothing eps the distribution used is (1 - eps) t + eps / V; mean divides by N. E: the
/// extents of the N x V probabilities (views.hpp).
template <class S, class E = dynamic_extents>
struct soft_targets {
  matrix_view<const S, E> probs;
};

template <class S, class E>
soft_targets<std::remove_const_t<S>, E> soft(matrix_view<S, E> probs) {
  return {probs};
}

namespace detail {

template <class T>
struct is_class_id : std::bool_constant<std::is_same<T, std::int32_t>::value ||
                                        std::is_same<T, std::int64_t>::value> {};

/// Maps what a caller may pass as targets onto the two forms the backends implement (run-time
/// sized: static extents are checked at the entry points, then dropped). rows and cols are the
/// targets' static extents (cols: soft targets' classes; dynamic where unknown).
template <class Targets, class = void>
struct target_traits {
  static constexpr bool valid = false;  // the entry points' static_assert says what is accepted
  static constexpr bool soft = false;
  static constexpr std::int64_t rows = dynamic;
  static constexpr std::int64_t cols = dynamic;
  using type = Targets;
};

template <class I, class E>
struct target_traits<vector_view<I, E>,
                     std::enable_if_t<is_class_id<std::remove_const_t<I>>::value>> {
  static constexpr bool valid = true;
  static constexpr bool soft = false;
  static constexpr std::int64_t rows = E::size;
  static constexpr std::int64_t cols = dynamic;
  using type = vector_view<const std::remove_const_t<I>>;
};

template <class S, class E>
struct target_traits<soft_targets<S, E>> {
  static constexpr bool valid = true;
  static constexpr bool soft = true;
  static constexpr std::int64_t rows = E::rows;
  static constexpr std::int64_t cols = E::cols;
  using type = soft_targets<S>;
};

/// The targets as the backends take them: `typename target_traits<Targets>::type`.
template <class Targets>
typename target_traits<Targets>::type dynamic_targets(const Targets& targets) {
  if constexpr (target_traits<Targets>::soft) {
    return {targets.probs};
  } else {
    return typename target_traits<Targets>::type(targets);
  }
}

}  // namespace detail
}  // namespace xent
