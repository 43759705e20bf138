// MUST NOT compile: a bias of 4 static entries for a weight of 3 static rows.
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::linear_forward(xent::cpu{}, c.h(), c.w(),
                       xent::vector_view<const float, xent::extent<4>>(c.hidden), c.targets(),
                       c.linear_opts(), c.out(), c.ws());
}
