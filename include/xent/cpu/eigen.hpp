// Views of Eigen objects, so CPU callers can pass Eigen::Matrix / Map / Ref / blocks directly:
//   xent::forward(xent::cpu{4}, xent::view(logits), xent::view(targets), opts, out);
// Logits are rows = tokens, so a matrix must be row-major (its rows contiguous); a column-major
// one is rejected at compile time rather than transposed behind the caller's back. A view has
// no element stride: a row (or a vector) whose elements are not adjacent, as a column of a
// row-major matrix or a Map with an inner stride, is refused at compile time where Eigen knows the
// stride then, and by xent::error at run time otherwise.
#pragma once

#include <Eigen/Core>
#include <type_traits>

#include "../detail/validate.hpp"
#include "../views.hpp"

namespace xent {
namespace detail {

template <class T, class Derived>
auto eigen_view(T* data, const Eigen::DenseBase<Derived>& m) {
  static_assert(Derived::IsVectorAtCompileTime || (Derived::Flags & Eigen::RowMajorBit),
                "xent::view: logits-like matrices must be row-major (Eigen::RowMajor)");
  constexpr int inner = int(Eigen::internal::traits<Derived>::InnerStrideAtCompileTime);
  static_assert(inner == 1 || inner == Eigen::Dynamic,
                "xent::view: a row's (a vector's) elements must be adjacent (inner stride 1)");
  require(m.size() <= 1 || m.derived().innerStride() == 1, "xent::view", "m", [&] {
    return "elements " + std::to_string(m.derived().innerStride()) +
           " apart; a view needs adjacent ones (inner stride 1)";
  });
  if constexpr (Derived::IsVectorAtCompileTime) {
    return vector_view<T>(data, m.size());
  } else {
    return matrix_view<T>(data, m.rows(), m.cols(), m.derived().outerStride());
  }
}

}  // namespace detail

/// A matrix_view of a row-major Eigen expression with direct access (Matrix, Array, Map, Ref,
/// row blocks); its outer stride becomes the leading dimension. Vectors give a vector_view.
template <class Derived>
auto view(Eigen::DenseBase<Derived>& m) {
  return detail::eigen_view(m.derived().data(), m);
}

template <class Derived>
auto view(const Eigen::DenseBase<Derived>& m) {
  return detail::eigen_view<const typename Derived::Scalar>(m.derived().data(), m);
}

}  // namespace xent
