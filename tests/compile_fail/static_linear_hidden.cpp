// MUST NOT compile: hidden rows of D = 4096 for a weight of D = 4095 (both static).
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::linear_forward(xent::cpu{}, xent::matrix_view<const float, xent::extents<2, 4096>>(nullptr),
                       xent::matrix_view<const float, xent::extents<3, 4095>>(nullptr), c.b(),
                       c.targets(), c.linear_opts(), c.out(), c.ws());
}
