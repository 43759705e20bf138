// The type a call accumulates in, chosen by the logits' dtype: double for double logits (the CPU
// backend's float64 path, a reference to check others against), float for every other dtype
// (float, bfloat16, half: 16-bit logits are widened, never summed in their own type). The loss,
// row losses, LSE and upstream gradient of a call are of this type too (options.hpp).
#pragma once

#include <type_traits>

namespace xent {

template <class T>
struct accumulator {
  using type = float;
};

template <>
struct accumulator<double> {
  using type = double;
};

/// float, or double for double logits (const or not).
template <class T>
using accumulator_t = typename accumulator<std::remove_const_t<T>>::type;

namespace detail {

/// T, in a parameter that takes no part in template argument deduction: the shared formulas
/// deduce their accumulator from the state structs alone, so a float argument still converts
/// as it did before they were templates.
template <class T>
struct non_deduced {
  using type = T;
};
template <class T>
using non_deduced_t = typename non_deduced<T>::type;

/// A call's outputs, upstream gradient and LSE (of accumulator type A) must match its logits L.
template <class L, class A>
constexpr void require_accumulator() {
  static_assert(std::is_same<A, accumulator_t<L>>::value,
                "xent: outputs, upstream and lse must be of the logits' accumulator type "
                "(xent::accumulator_t): basic_forward_outputs<double> / basic_upstream<double> for "
                "double logits, forward_outputs / upstream (float) for float, bfloat16 and half");
}

}  // namespace detail
}  // namespace xent
