// Must NOT compile: logits are rows = tokens, so a column-major matrix is rejected rather than
// transposed behind the caller's back.
#include <Eigen/Core>

#include "xent/xent.hpp"

int main() {
  Eigen::MatrixXf logits(2, 3);  // column-major
  auto v = xent::view(logits);
  return static_cast<int>(v.ld);
}
