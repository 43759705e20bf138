// MUST NOT compile: a gradient of another static shape than the logits'.
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::forward_backward(xent::cpu{}, c.x(), c.targets(), c.opts(), c.up(), c.out(),
                         xent::matrix_view<float, xent::extents<2, 4>>(c.grad));
}
