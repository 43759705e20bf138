// Views of Eigen objects, so CPU callers can pass Eigen::Matrix / Map / Ref / blocks directly:
//   xent::forward(xent::cpu{4}, xent::view(logits), xent::view(targets), opts, out);
// Logits are rows = tokens, so a matrix must be row-major (its rows contiguous); a column-major
// one is rejected at compile time rather than transposed behind the caller's back.
#pragma once

#include <Eigen/Core>
#include <type_traits>

#include "../views.hpp"

namespace xent {

/// A matrix_view of a row-major Eigen expression with direct access (Matrix, Array, Map, Ref,
/// row blocks); its outer stride becomes the leading dimension.
template <class Derived>
auto view(Eigen::DenseBase<Derived>& m) {
  static_assert(Derived::IsVectorAtCompileTime || (Derived::Flags & Eigen::RowMajorBit),
                "xent::view: logits-like matrices must be row-major (Eigen::RowMajor)");
  static_assert(
      int(Eigen::internal::traits<Derived>::InnerStrideAtCompileTime) == 1 ||
          int(Eigen::internal::traits<Derived>::InnerStrideAtCompileTime) == Eigen::Dynamic,
      "xent::view: rows must be contiguous");
  using T = std::remove_reference_t<decltype(*m.derived().data())>;
  if constexpr (Derived::IsVectorAtCompileTime) {
    return vector_view<T>(m.derived().data(), m.size());
  } else {
    return matrix_view<T>(m.derived().data(), m.rows(), m.cols(), m.derived().outerStride());
  }
}

template <class Derived>
auto view(const Eigen::DenseBase<Derived>& m) {
  static_assert(Derived::IsVectorAtCompileTime || (Derived::Flags & Eigen::RowMajorBit),
                "xent::view: logits-like matrices must be row-major (Eigen::RowMajor)");
  using T = const typename Derived::Scalar;
  if constexpr (Derived::IsVectorAtCompileTime) {
    return vector_view<T>(m.derived().data(), m.size());
  } else {
    return matrix_view<T>(m.derived().data(), m.rows(), m.cols(), m.derived().outerStride());
  }
}

}  // namespace xent
