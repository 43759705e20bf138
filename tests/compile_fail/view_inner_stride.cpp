// Must NOT compile: a view has no element stride, so a Map whose elements are two apart (known
// at compile time) is rejected, through the const overload too, rather than read as adjacent.
#include <Eigen/Core>

#include "xent/xent.hpp"

int main() {
  const float data[8] = {};
  using Strided = Eigen::Map<const Eigen::Matrix<float, 2, 2, Eigen::RowMajor>, 0,
                             Eigen::Stride<Eigen::Dynamic, 2>>;
  const Strided m(data, Eigen::Stride<Eigen::Dynamic, 2>(4, 2));
  auto v = xent::view(m);
  return static_cast<int>(v.ld);
}
