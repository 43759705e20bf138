// Must NOT compile: class ids are int32 or int64, not float.
#include "xent/xent.hpp"

int main() {
  float logits[6] = {};
  float targets[2] = {0, 1};
  float loss = 0;
  xent::forward_outputs out;
  out.loss = &loss;
  xent::forward(xent::cpu{}, xent::matrix_view<const float>(logits, 2, 3),
                xent::vector_view<const float>(targets, 2), xent::options{}, out);
}
