// Must NOT compile: an int gradient is not a CPU dtype.
#include <cstdint>

#include "xent/xent.hpp"

int main() {
  float logits[6] = {};
  int grad[6] = {};
  std::int64_t targets[2] = {0, 1};
  xent::forward_backward(xent::cpu{}, xent::matrix_view<const float>(logits, 2, 3),
                         xent::vector_view<const std::int64_t>(targets, 2), xent::options{},
                         xent::upstream{}, xent::forward_outputs{},
                         xent::matrix_view<int>(grad, 2, 3));
}
