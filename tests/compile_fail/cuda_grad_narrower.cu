// MUST NOT compile: the CUDA backend writes a gradient at least as wide as the logits (a
// bfloat16 gradient of float logits would fill half of each 16-byte vector it stores).
#include <cstdint>

#include "xent/xent.hpp"

int main() {
  float* logits = nullptr;
  Eigen::bfloat16* grad = nullptr;
  std::int64_t* targets = nullptr;
  xent::forward_outputs out;
  xent::forward_backward(xent::cuda{}, xent::matrix_view<const float>(logits, 2, 3),
                         xent::vector_view<const std::int64_t>(targets, 2), xent::options{},
                         xent::upstream{}, out, xent::matrix_view<Eigen::bfloat16>(grad, 2, 3));
}
