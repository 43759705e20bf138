// MUST NOT compile: a saved LSE of 3 static entries for 2 rows of logits.
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::backward(xent::cpu{}, c.x(), c.targets(), c.opts(),
                 xent::vector_view<const float, xent::extent<3>>(c.weights), c.up(), c.g());
}
