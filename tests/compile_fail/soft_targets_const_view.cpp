// MUST compile: soft targets made by xent::soft() from a view of const probabilities (what
// xent::view() of a const Eigen matrix gives).
#include <Eigen/Core>
#include <cstdint>

#include "xent/xent.hpp"

int main() {
  float logits[6] = {};
  const float probs[6] = {0.5f, 0.25f, 0.25f, 0.2f, 0.2f, 0.6f};
  float loss = 0;
  xent::forward_outputs out;
  out.loss = &loss;
  xent::forward(xent::cpu{}, xent::matrix_view<const float>(logits, 2, 3),
                xent::soft(xent::matrix_view<const float>(probs, 2, 3)), xent::options{}, out);
  const Eigen::Matrix<float, 2, 3, Eigen::RowMajor> p =
      Eigen::Matrix<float, 2, 3, Eigen::RowMajor>::Constant(1.0f / 3);
  xent::forward(xent::cpu{}, xent::matrix_view<const float>(logits, 2, 3),
                xent::soft(xent::view(p)), xent::options{}, out);
  return loss > 0 ? 0 : 1;
}
