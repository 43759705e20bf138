// Must NOT compile: double logits accumulate in double, so their outputs are
// basic_forward_outputs<double>; float outputs would round what the call computed.
#include <cstdint>

#include "xent/xent.hpp"

int main() {
  double logits[6] = {};
  std::int64_t targets[2] = {0, 1};
  float loss = 0;
  xent::forward_outputs out;
  out.loss = &loss;
  xent::forward(xent::cpu{}, xent::matrix_view<const double>(logits, 2, 3),
                xent::vector_view<const std::int64_t>(targets, 2), xent::options{}, out);
}
