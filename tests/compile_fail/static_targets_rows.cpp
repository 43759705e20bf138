// MUST NOT compile: 64 class ids for logits of 32 static rows.
#include "static_rows.hpp"

int main() {
  static_call c;
  const std::int64_t* ids = nullptr;
  xent::forward(xent::cpu{}, xent::matrix_view<const float, xent::extents<32, 32000>>(nullptr),
                xent::vector_view<const std::int64_t, xent::extent<64>>(ids), xent::options{},
                xent::forward_outputs{&c.loss});
}
