// MUST NOT compile: d_weight of another static shape than the weight's.
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::linear_grads<float, ext24, xent::extents<4, 4>> grads;
  xent::linear_forward_backward(xent::cpu{}, c.h(), c.w(), c.b(), c.targets(), c.linear_opts(),
                                c.up(), c.out(), grads, c.ws());
}
