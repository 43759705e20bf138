// MUST NOT compile: per-row outputs of 3 static entries for 2 rows of logits.
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::basic_forward_outputs<float, xent::extent<3>> out;
  out.loss = &c.loss;
  xent::forward(xent::cpu{}, c.x(), c.targets(), c.opts(), out);
}
