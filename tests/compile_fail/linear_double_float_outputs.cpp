// MUST NOT compile: double hidden / weight accumulate in double, so the outputs are
// basic_forward_outputs<double>, not float ones.
#include <cstdint>

#include "xent/xent.hpp"

int main() {
  double hidden[6] = {}, weight[9] = {};
  std::int64_t targets[2] = {0, 1};
  float loss = 0;
  xent::forward_outputs out;
  out.loss = &loss;
  unsigned char workspace[4096];
  xent::linear_forward(xent::cpu{}, xent::matrix_view<const double>(hidden, 2, 3),
                       xent::matrix_view<const double>(weight, 3, 3), {},
                       xent::vector_view<const std::int64_t>(targets, 2), xent::linear_options{},
                       out, {workspace, sizeof(workspace)});
  return 0;
}
