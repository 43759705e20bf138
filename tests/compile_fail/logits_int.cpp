// Must NOT compile: integer logits are not a CPU dtype.
#include <cstdint>

#include "xent/xent.hpp"

int main() {
  int logits[6] = {};
  std::int64_t targets[2] = {0, 1};
  float loss = 0;
  xent::forward_outputs out;
  out.loss = &loss;
  xent::forward(xent::cpu{}, xent::matrix_view<const int>(logits, 2, 3),
                xent::vector_view<const std::int64_t>(targets, 2), xent::options{}, out);
}
