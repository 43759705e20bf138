// Must NOT compile: an int gradient is not a CPU dtype.
#include "two_rows.hpp"

int main() {
  two_rows r;
  logits_2x3<float> x;
  int grad[6] = {};
  xent::forward_backward(xent::cpu{}, x.view(), r.ids(), xent::options{}, xent::upstream{},
                         xent::forward_outputs{}, xent::matrix_view<int>(grad, 2, 3));
}
